"""One mode of a train_step job, in this process: build the model, warm up, time the steps, and fill in the
run's record (``--profile`` and ``--memory-at-peak`` run their steps after the timed ones).

A step is forward, ``loss.backward()``, ``optimizer.step()``, ``zero_grad(set_to_none=True)``, timed between two
``torch.cuda.synchronize()``. Peak memory is ``torch.cuda.max_memory_allocated`` over the whole run; an
out-of-memory error ends the run with status ``OOM``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import os
import re
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from jobs import JOBS, TINY_BATCH, TINY_SEQ, TRAIN_STEP_LR
from train_step_memory import GradientWatch, memory_at_peak, record_memory_history
from train_step_model import apply_liger, build_model, fuser_config, make_batches
from train_step_profile import profile_steps
from train_step_report import versions


def new_result(args: argparse.Namespace) -> dict[str, Any]:
    """The record of one run: what ran where, filled in by :func:`run_mode` as it goes."""
    job, device = JOBS[args.job], torch.device(args.device)
    default = torch.bfloat16 if device.type == "cuda" and not job.autocast else torch.float32
    dtype = getattr(torch, args.dtype) if args.dtype else default
    return dict(
        job=args.job,
        mode=args.mode,
        status="running",
        phase="start",
        device=device_name(device),
        versions=versions(),
        dtype=str(dtype).removeprefix("torch."),
        autocast="bfloat16" if job.autocast else None,
        batch=args.batch or (TINY_BATCH if args.tiny else job.batch),
        seq=args.seq or (TINY_SEQ if args.tiny else job.seq),
        tiny=args.tiny,
        attention_mask=args.attention_mask,
        fuser_patterns=args.fuser_patterns,
        fuser_options=args.fuser_option,
        inductor_config=args.inductor_config,
        steps=args.steps,
        warmup=args.warmup,
        command=shlex.join([sys.executable, *sys.argv]),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        fuser_source=fuser_source(),
    )


def fuser_source() -> str | None:
    """Where this process imports fuser from (its package directory), without importing it: an A/B of two trees
    (``benchmarks/gpu_ab.sh``) shows in each run which one it measured."""
    spec = importlib.util.find_spec("fuser")
    return str(Path(spec.origin).resolve().parent) if spec is not None and spec.origin else None


def run_mode(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Build, warm up, time and (with --profile) profile one job in one mode, filling ``result``.

    An out-of-memory error ends the run with status ``OOM``; any other error sets status ``error`` and is raised.
    """
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        build_and_time(result, args, device)
        result["status"] = "ok"
    except Exception as error:
        if not is_oom(error):
            result.update(status="error", error=last_error_line(f"{type(error).__name__}: {error}"))
            raise
        result.update(status="OOM", error=last_error_line(str(error)))
    finally:
        take_peak(result, device)


def build_and_time(result: dict[str, Any], args: argparse.Namespace, device: torch.device) -> None:
    job, mode = JOBS[args.job], result["mode"]
    dtype, batch, seq = getattr(torch, result["dtype"]), result["batch"], result["seq"]
    result["phase"] = "build"
    if mode == "liger":
        apply_liger(job)
    if args.memory_at_peak and device.type == "cuda":
        # allocation sites of what is still live when the memory step begins (train_step_memory.memory_at_peak)
        record_memory_history()
    model = build_model(job, args, device, dtype, seq)
    result["layers"] = model.config.num_hidden_layers
    result["params"] = sum(p.numel() for p in model.parameters())
    result["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=TRAIN_STEP_LR, fused=True)

    if mode == "compile":
        model = torch.compile(model)
    elif mode == "fuser":
        import fuser

        model = fuser.optimize(model, fuser_config(args))
    # which steps' gradients are still allocated when the memory step begins (--memory-at-peak only)
    watch = GradientWatch([p for p in model.parameters() if p.requires_grad]) if args.memory_at_peak else None
    n_profile = (3 if args.profile else 0) + (1 if args.memory_at_peak else 0)
    batches = make_batches(args.warmup + args.steps + n_profile, batch, seq, model.config.vocab_size, 1, device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # every batch has the same shape: one all-ones mask serves them all
    extra = {"attention_mask": torch.ones_like(batches[0])} if args.attention_mask else {}

    def train_step(ids: torch.Tensor) -> torch.Tensor:
        if watch is not None:
            watch.begin_step()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=job.autocast):
            loss = model(input_ids=ids, labels=ids, **extra).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    losses, warmup_s, step_s = time_steps(result, args, batches[: args.warmup + args.steps], train_step, sync, device)
    result["peak_timed_gib"] = take_peak(result, device)
    tokens = batch * seq
    step_median = statistics.median(step_s) if step_s else float("nan")
    result.update(
        losses=losses,
        first_loss=losses[0] if losses else None,
        last_loss=losses[-1] if losses else None,
        warmup_s=sum(warmup_s),
        warmup_step_s=warmup_s,
        step_s=step_s,
        step_ms=1e3 * step_median,
        tokens_per_step=tokens,
        tokens_per_s=tokens / step_median if step_s else None,
    )
    if mode == "fuser":
        import fuser

        backend = fuser.backend(fuser_config(args))
        result["fuser_counts"] = backend.counts
        result["fuser_post_grad"] = dict(backend.post_grad_counts)
        result["fuser_inlined"] = dict(backend.inliner.inlined)  # FuserConfig.inline_ops: calls Inductor launches
        result["fuser_not_inlined"] = dict(backend.inliner.declined)
        result["fuser_inline_s"] = backend.inliner.seconds
        refined: dict[str, int] = {}
        for one in backend.results:  # the fused ops a pattern's refinement rebuilt (rms_norm: the adds it absorbed)
            for name, n in one.refined.items():
                refined[name] = refined.get(name, 0) + n
        result["fuser_refined"] = refined
    if mode in ("compile", "fuser"):
        from torch._dynamo.utils import counters

        result["graphs"] = int(counters["stats"]["unique_graphs"])
        result["graph_breaks"] = sum(counters["graph_break"].values())

    if args.profile:
        result["phase"] = "profile"
        profiled = batches[args.warmup + args.steps : args.warmup + args.steps + 3]
        result["profile"] = profile_steps(result, args, profiled, train_step, sync, device)
    if args.memory_at_peak:
        result["phase"] = "memory"
        params = [p for group in optimizer.param_groups for p in group["params"]]
        known = {p.data_ptr() for p in params}  # with the optimizer state: what is expected to live between steps
        known |= {v.data_ptr() for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)}
        result["memory_at_peak"] = memory_at_peak(result, args, batches[-1], train_step, sync, device, known, watch)
    result["phase"] = "done"


class GcTimer:
    """While entered, ``total`` sums the seconds Python's garbage collector runs (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._start

    def __enter__(self) -> GcTimer:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def time_steps(result, args, batches, train_step, sync, device: torch.device) -> tuple[list, list, list]:
    """Run the warm-up and timed steps on ``batches``: (losses, warm-up step seconds, timed step seconds). fuser's
    warnings are kept in ``result``, the others echoed."""
    losses, warmup_s, step_s = [], [], []
    # per step, warm-up ones included: the host's time until train_step returned (its launches, before the final
    # synchronize: close to the step's time where the GPU waited on the host), and the time Python's garbage
    # collector ran inside the step
    host_s, gc_s = result.setdefault("host_s", []), result.setdefault("gc_s", [])
    gc_time = GcTimer()
    with warnings.catch_warnings(record=True) as caught, gc_time:
        warnings.simplefilter("always")
        try:
            for i, ids in enumerate(batches):
                result["phase"] = "warm-up" if i < args.warmup else "timed"
                if i == args.warmup:
                    result["peak_warmup_gib"] = take_peak(result, device)  # build and warm-up
                sync()
                gc_before = gc_time.total
                start = time.perf_counter()
                loss = train_step(ids)
                host_s.append(time.perf_counter() - start)
                sync()
                (warmup_s if i < args.warmup else step_s).append(time.perf_counter() - start)
                gc_s.append(gc_time.total - gc_before)
                losses.append(loss.item())
                step_ms = 1e3 * (warmup_s + step_s)[-1]
                progress = f"step {i} ({result['phase']}): loss {losses[-1]:.4f}, {step_ms:.0f} ms"
                print(f"[{args.job} {result['mode']}] {progress}", file=sys.stderr)
        finally:  # also when a step failed: a fuser fall-back warning may explain it
            for category, message in dict.fromkeys((w.category.__name__, str(w.message)[:300]) for w in caught):
                if "fuser" in message:  # fuser's fall-backs are results; the rest is passed on
                    result.setdefault("fuser_warnings", []).append(message)
                if category not in ("DeprecationWarning", "FutureWarning"):
                    print(f"warning: {category}: {message}", file=sys.stderr)
    return losses, warmup_s, step_s


def take_peak(result: dict[str, Any], device: torch.device) -> float | None:
    """The peak allocated GiB since the last call (then reset); ``result["peak_gib"]`` keeps the run's maximum."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    result["peak_gib"] = max(result.get("peak_gib", 0.0), peak)
    return peak


def is_oom(error: BaseException) -> bool:
    seen = error
    while seen is not None:  # Inductor and Dynamo wrap the allocator's error
        if isinstance(seen, torch.OutOfMemoryError) or "out of memory" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"(Error|Exception|error:)", ln)]
    return (errors or lines or ["no output"])[-1][:200]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
