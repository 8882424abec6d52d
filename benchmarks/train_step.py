"""Whole training steps of real fine-tuning jobs: eager, Inductor, Liger-Kernel and fuser side by side.

Each job is a public checkpoint's shapes with random weights, built from a config (nothing is downloaded):
bf16 weights, sdpa attention, ``torch.optim.AdamW(fused=True)`` over the trainable parameters, lr 1e-5,
labels = input_ids (random tokens, fixed seed), ``model.train()``. A step is forward, ``loss.backward()``,
``optimizer.step()``, ``zero_grad(set_to_none=True)``, timed between two ``torch.cuda.synchronize()``.

Modes: ``eager``; ``compile`` (``torch.compile(model)``, Inductor); ``liger`` (Liger-Kernel's
``apply_liger_kernel_to_<model type>``, e.g. ``_llama``, ``_gemma3_text``, ``_phi3``, with rms_norm, rope, the gated
activation and fused_linear_cross_entropy, applied before the model is built; only where ``liger_kernel`` imports
and has a patch for the job's model type); ``fuser`` (``fuser.optimize(model)``).

One mode (prints a summary, ``--json`` writes every number):

    python benchmarks/train_step.py --job llama3-8b-lora --mode fuser [--steps 10 --warmup 3] [--json out.json]

Every mode, each in its own process (fresh Inductor and Triton caches unless ``--warm-cache``), as one table:

    python benchmarks/train_step.py --job llama3-8b-lora --all-modes --out results.md [--timeout 300]

or mode by mode (one device call each), then one table from their JSON files:

    python benchmarks/train_step.py --job llama3-8b-lora --all-modes --modes compile --json compile.json
    python benchmarks/train_step.py --job llama3-8b-lora --combine eager.json compile.json ... --out results.md

A kernel-time profile of 3 more steps after the timed ones, grouped by op family (``--profile DIR``):

    python benchmarks/train_step.py --job llama3-8b-lora --mode fuser --profile benchmarks/results/

A smoke test on a CPU: 2 layers, hidden 64, vocab 512, fp32, batch 2×64 (QLoRA and Liger need CUDA):

    python benchmarks/train_step.py --job llama3-8b-lora --all-modes --tiny --device cpu --steps 2 --warmup 1

Peak memory is ``torch.cuda.max_memory_allocated`` over the whole run (model, optimizer state, warm-up and
compilation included); warm-up seconds are the wall time of the warm-up steps, compilation included; tokens/s
and step ms come from the median timed step. An out-of-memory error is reported as ``OOM``, not raised.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Any

import torch
from jobs import JOBS, MODES, Job
from train_step_report import results_table
from train_step_timing import last_error_line, new_result, run_mode

if importlib.util.find_spec("fuser") is None:  # run from a checkout without `pip install -e .`
    sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src"), str(Path(__file__).resolve().parents[1])]

# This file is the driver (the command line, every mode in its own process, --combine). The jobs are jobs.py's;
# one mode's run is train_step_timing.py, its model train_step_model.py, --profile train_step_profile.py,
# --memory-at-peak train_step_memory.py, and the tables train_step_report.py.


def check_mode(job: Job, mode: str, device: torch.device) -> str | None:
    """Why ``mode`` of ``job`` cannot run on ``device``, or None."""
    if device.type != "cuda" and job.method == "qlora":
        return "bitsandbytes NF4 (QLoRA) needs CUDA"
    if mode == "liger":
        if device.type != "cuda":
            return "Liger-Kernel needs CUDA"
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger_kernel is not installed"
    return None


def child_command(args: argparse.Namespace, mode: str, json_path: Path) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--job", args.job, "--mode", mode, "--json", str(json_path)]
    for flag in ("steps", "warmup", "batch", "seq", "layers", "device", "dtype", "seed", "profile", "memory_at_peak"):
        value = getattr(args, flag)
        if value is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(value)]
    if args.tiny:
        cmd.append("--tiny")
    if args.attention_mask:
        cmd.append("--attention-mask")
    cmd += ["--fuser-inner-compiler", args.fuser_inner_compiler]
    if args.fuser_patterns:
        cmd += ["--fuser-patterns", args.fuser_patterns]
    for option in args.fuser_option:
        cmd += ["--fuser-option", option]
    for option in args.inductor_config:
        cmd += ["--inductor-config", option]
    return cmd


def run_child(cmd: list[str], env: dict[str, str], timeout: float | None) -> tuple[int | None, str]:
    """Run ``cmd``, echoing its output to stderr; (exit code, or None if killed at ``timeout``; its last lines)."""
    tail: collections.deque[str] = collections.deque(maxlen=200)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)

    def echo() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line)
            sys.stderr.write(line)

    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    try:
        rc: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = None
    reader.join(timeout=10)
    return rc, "".join(tail)


def run_all_modes(args: argparse.Namespace) -> int:
    job = JOBS[args.job]
    device = torch.device(args.device)
    results: dict[str, dict[str, Any]] = {}
    command = shlex.join([sys.executable, *sys.argv])
    with tempfile.TemporaryDirectory(prefix="train_step_", ignore_cleanup_errors=True) as tmp:
        for mode in args.modes:
            reason = check_mode(job, mode, device)
            if reason is not None:
                print(f"[{args.job} {mode}] skipped: {reason}", file=sys.stderr)
                results[mode] = {"status": "skipped", "error": reason}
                continue
            json_path = Path(tmp) / f"{mode}.json"
            env = dict(os.environ)
            if not args.warm_cache:  # every mode compiles from scratch, as a user's first run does
                env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / mode / "inductor")
                env["TRITON_CACHE_DIR"] = str(Path(tmp) / mode / "triton")
            cmd = child_command(args, mode, json_path)
            print(f"[{args.job} {mode}] {shlex.join(cmd)}", file=sys.stderr, flush=True)
            rc, output = run_child(cmd, env, args.timeout)
            result = json.loads(json_path.read_text()) if json_path.exists() else {}
            if rc is None:
                result.update(status="timeout", error=f"killed after {args.timeout:g} s")
            elif result.get("status") not in ("ok", "OOM"):
                result.update(status="crashed", error=result.get("error") or last_error_line(output))
            results[mode] = result
    note = "caches: " + ("warm (shared)" if args.warm_cache else "cold (fresh Inductor and Triton caches per mode)")
    write_report(args, results, command, note)
    return 0 if all(r.get("status") in ("ok", "skipped") for r in results.values()) else 1


def combine(args: argparse.Namespace) -> int:
    """The table of one job from JSON files written by earlier runs (one mode each, or --all-modes)."""
    results: dict[str, dict[str, Any]] = {}
    for name in args.combine:
        data = json.loads(Path(name).read_text())
        found = data["modes"] if "modes" in data else {data.get("mode"): data}
        for mode, result in found.items():
            if result.get("job", args.job) != args.job or mode not in MODES:
                raise SystemExit(f"train_step: {name} holds {result.get('job')} / {mode}, not a mode of {args.job}")
            results[mode] = result
    results = {m: results[m] for m in MODES if m in results}
    commands = "; ".join(dict.fromkeys(r["command"] for r in results.values() if "command" in r))
    write_report(args, results, shlex.join([sys.executable, *sys.argv]), f"combined from runs of: `{commands}`")
    return 0


def write_report(args: argparse.Namespace, results: dict[str, dict[str, Any]], command: str, note: str) -> None:
    text = results_table(args.job, results, command, note)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"job": args.job, "command": command, "modes": results}, indent=1))


def apply_inductor_config(settings: list[str]) -> None:
    """``NAME=VALUE`` pairs onto ``torch._inductor.config`` (``true``/``false``, numbers, or a string)."""
    import torch._inductor.config as inductor_config

    for setting in settings:
        name, sep, text = setting.partition("=")
        if not sep:
            raise SystemExit(f"train_step: --inductor-config takes NAME=VALUE, got {setting!r}")
        value: Any = {"true": True, "false": False}.get(text.lower(), text)
        if isinstance(value, str):
            try:
                value = json.loads(text)
            except ValueError:
                pass
        owner = inductor_config
        *path, leaf = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        if not hasattr(owner, leaf):
            raise SystemExit(f"train_step: torch._inductor.config has no {name!r}")
        setattr(owner, leaf, value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", required=True, choices=sorted(JOBS))
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--mode", choices=MODES, help="run one mode in this process")
    which.add_argument("--all-modes", action="store_true", help="run every mode, each in its own process")
    which.add_argument("--combine", nargs="+", metavar="JSON", help="one table from the --json files of earlier runs")
    parser.add_argument("--modes", default=",".join(MODES), help="--all-modes: which, comma-separated (default all)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps, compilation included (default 3)")
    parser.add_argument("--batch", type=int, help="sequences per step (default: the job's)")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default: the job's)")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the checkpoint's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--tiny", action="store_true", help="2 layers, hidden 64, vocab 512, batch 2×64: a smoke test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--attention-mask", action="store_true", help="pass an all-ones attention_mask, as HF Trainer's collators do"
    )
    parser.add_argument("--fuser-inner-compiler", default="inductor", choices=["inductor", "aot_eager", "eager"])
    parser.add_argument(
        "--fuser-patterns",
        help="fuser's patterns, comma-separated; a leading + adds to the default ones (e.g. +lora_sum), a leading - "
        "takes them out (write it --fuser-patterns=-rms_norm_linear: argparse reads a bare -word as a flag)",
    )
    parser.add_argument(
        "--fuser-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a FuserConfig option by name, repeatable: experimental.upcast_linear.triton=false, keep_logits=true",
    )
    parser.add_argument(
        "--inductor-config",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set torch._inductor.config.NAME (dotted) before compiling, repeatable, for the compile and fuser modes "
        "alike: triton.cudagraphs=true",
    )
    parser.add_argument("--profile", metavar="DIR", help="profile 3 more steps; write profile_<job>_<mode>.md to DIR")
    parser.add_argument(
        "--memory-at-peak", metavar="DIR", help="one more step with allocator history: write what is live at its peak"
    )
    parser.add_argument("--json", metavar="FILE", help="write every number as JSON")
    parser.add_argument("--out", metavar="FILE", help="--all-modes, --combine: write the markdown table here too")
    parser.add_argument("--timeout", type=float, help="--all-modes: seconds allowed to each mode's process")
    parser.add_argument("--warm-cache", action="store_true", help="--all-modes: keep the Inductor/Triton caches")
    args = parser.parse_args(argv)
    args.modes = args.modes.split(",")
    if unknown := sorted(set(args.modes) - set(MODES)):
        parser.error(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be ≥ 1 and --warmup ≥ 0")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device; use --device cpu --tiny for a smoke test")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.all_modes:
        return run_all_modes(args)
    if args.combine:
        return combine(args)
    reason = check_mode(JOBS[args.job], args.mode, torch.device(args.device))
    if reason is not None:
        print(f"train_step: cannot run {args.job} in mode {args.mode}: {reason}", file=sys.stderr)
        return 2
    result = new_result(args)
    try:
        apply_inductor_config(args.inductor_config)
        run_mode(args, result)
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    summary = {k: result.get(k) for k in ("status", "tokens_per_s", "step_ms", "peak_gib", "warmup_s")}
    print(json.dumps(summary | {"losses": result.get("losses"), "fuser_counts": result.get("fuser_counts")}))
    return 0 if result["status"] in ("ok", "OOM") else 1


if __name__ == "__main__":
    sys.exit(main())
