"""The markdown reports of train_step.py: the header every report starts with (command, date, device,
versions), and the table of one job's modes with fuser's ratios against issue 6's targets.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import math
import shlex
import sys
from typing import Any

import torch
from bench_common import markdown_table
from jobs import JOBS, MODE_TITLES, TRAIN_STEP_LR

VERSIONED = ("torch", "triton", "transformers", "peft", "liger-kernel", "bitsandbytes")


def versions() -> dict[str, str]:
    found = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    found["cuda"] = str(torch.version.cuda)
    return found


def report_header(title: str, results: list[dict[str, Any]], command: str | None = None) -> str:
    """Title, command, date, device and versions, taken from the first result that has them."""
    known = next((r for r in results if r.get("versions")), {})
    v = known.get("versions", versions())
    version_line = ", ".join(f"{name} {v.get(name, '?')}" for name in VERSIONED) + f", CUDA {v.get('cuda', '?')}"
    return (
        f"# {title}\n\n"
        f"- command: `{command or known.get('command', shlex.join([sys.executable, *sys.argv]))}`\n"
        f"- date: {known.get('date', datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'))}\n"
        f"- device: {known.get('device', '?')}\n"
        f"- versions: {version_line}\n"
    )


def fmt(value: float | None, spec: str) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def one_mode(record: dict[str, Any]) -> dict[str, Any]:
    """A train_step.py JSON file's record of one mode (an ``--all-modes`` file: its first mode's)."""
    return record["modes"][next(iter(record["modes"]))] if "modes" in record else record


def timed_host_ms(result: dict[str, Any]) -> float | None:
    """The median host (launch) time of a run's timed steps, in ms; None for a run without them (older JSON)."""
    timed = len(result["step_s"])
    host = sorted(result.get("host_s", [])[-timed:]) if timed else []
    return 1e3 * host[len(host) // 2] if host else None


def timed_gc_ms(result: dict[str, Any]) -> float | None:
    """The garbage collector's time summed over a run's timed steps, in ms; None for a run without it."""
    timed = len(result["step_s"])
    return 1e3 * sum(result["gc_s"][-timed:]) if result.get("gc_s") and timed else None


def results_table(job_name: str, results: dict[str, dict[str, Any]], command: str, note: str = "") -> str:
    """The markdown report of one job: a row per mode, then fuser's ratios against the issue's targets."""
    job = JOBS[job_name]
    ok = {m: r for m, r in results.items() if r.get("status") == "ok"}
    rows = []
    for mode, r in results.items():
        status = r.get("status")
        if status == "ok":
            rows.append(
                [
                    MODE_TITLES[mode],
                    fmt(r.get("tokens_per_s"), ",.0f"),
                    fmt(r.get("step_ms"), ".0f"),
                    fmt(r.get("peak_gib"), ".1f"),
                    fmt(r.get("warmup_s"), ".1f"),
                    fmt(r.get("first_loss"), ".4f"),
                    fmt(r.get("last_loss"), ".4f"),
                ]
            )
        else:
            what = "OOM" if status == "OOM" else f"{status} ({r.get('error', '')})"
            peak = fmt(r.get("peak_gib"), ".1f") if status == "OOM" else "–"
            rows.append([MODE_TITLES[mode], what, "–", peak, "–", "–", "–"])
    columns = ["mode", "tokens/s", "step ms", "peak GiB", "warm-up s", "first loss", "last loss"]
    any_result = next(iter(results.values()), {})
    batch, seq = any_result.get("batch", job.batch), any_result.get("seq", job.seq)
    layers = next((r["layers"] for r in results.values() if "layers" in r), None)
    steps = any_result.get("steps", "?")
    warmup = any_result.get("warmup", "?")
    setup = (
        f"{job.about}: random weights with the public checkpoint's shapes"
        + (f" ({layers} layers)" if layers is not None else "")
        + f", batch {batch}×{seq}, {any_result.get('dtype', 'bf16')}"
        + (f" weights under {any_result['autocast']} autocast" if any_result.get("autocast") else "")
        + f", sdpa, AdamW(fused), lr {TRAIN_STEP_LR:g}; "
        f"median of {steps} timed steps after {warmup} warm-up; peak = max_memory_allocated over the run; "
        f"warm-up = wall time of the warm-up steps, compilation included"
        + (" (tiny smoke-test config)" if any_result.get("tiny") else "")
        + ("; all-ones attention_mask passed, as HF Trainer's do" if any_result.get("attention_mask") else "")
        + (f"; fuser patterns `{any_result['fuser_patterns']}`" if any_result.get("fuser_patterns") else "")
        + (f"; fuser options `{' '.join(any_result['fuser_options'])}`" if any_result.get("fuser_options") else "")
    )
    text = report_header(f"Training step: {job_name}", list(results.values()), command)
    text += f"- setup: {setup}\n" + (f"- {note}\n" if note else "") + "\n"
    text += markdown_table(columns, rows, label_columns=1) + "\n"

    fz = ok.get("fuser")
    anchors = [ok[m] for m in ("compile", "liger") if m in ok]
    if fz and anchors:
        best_tps = max(a["tokens_per_s"] for a in anchors)
        low_peak = min((a["peak_gib"] for a in anchors if a.get("peak_gib") is not None), default=None)
        of = " and ".join(MODE_TITLES[m].split(" ")[0] for m in ("compile", "liger") if m in ok)
        targets = [
            (f"tokens/s ÷ the better of {of}", ratio(fz["tokens_per_s"], best_tps), "≥ 1.15", 1.15, 1),
            (f"peak memory ÷ the lower of {of}", ratio(fz.get("peak_gib"), low_peak), "≤ 0.85", 0.85, -1),
        ]
        if "compile" in ok:
            warm = ratio(fz["warmup_s"], ok["compile"]["warmup_s"])
            targets.append(("warm-up ÷ Inductor's", warm, "≤ 1.1", 1.1, -1))
        if "eager" in ok:
            targets.append(("tokens/s ÷ eager", ratio(fz["tokens_per_s"], ok["eager"]["tokens_per_s"]), "≥ 1", 1.0, 1))
        met = lambda value, bound, sign: "–" if value is None else ("yes" if sign * (value - bound) >= 0 else "no")
        ratio_rows = [[name, fmt(v, ".2f"), target, met(v, bound, sign)] for name, v, target, bound, sign in targets]
        text += "\nfuser against the targets of issue 6:\n\n"
        text += markdown_table(["fuser", "ratio", "target", "met"], ratio_rows, label_columns=1) + "\n"
    if fz:
        counts = fz.get("fuser_counts") or {}
        text += "\nfuser fused: " + (", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "nothing")
        post_grad = fz.get("fuser_post_grad") or {}
        if post_grad:  # what fuser's post-grad pass changed in the graphs Inductor compiled (not from its cache)
            text += "; post-grad: " + ", ".join(f"{k}={v}" for k, v in sorted(post_grad.items()))
        text += f"; graphs {fz.get('graphs', '?')}, graph breaks {fz.get('graph_breaks', '?')}"
        if "compile" in ok:
            ind = ok["compile"]
            text += f" (Inductor: graphs {ind.get('graphs', '?')}, graph breaks {ind.get('graph_breaks', '?')})"
        text += "\n"
        for w in fz.get("fuser_warnings", []):
            text += f"\nfuser warned: {w}\n"
    return text
