"""Whole training steps of real fine-tuning jobs: eager, Inductor, Liger-Kernel and fuser side by side.

Each job is a public checkpoint's shapes with random weights, built from a config (nothing is downloaded):
bf16 weights, sdpa attention, ``torch.optim.AdamW(fused=True)`` over the trainable parameters, lr 1e-5,
labels = input_ids (random tokens, fixed seed), ``model.train()``. A step is forward, ``loss.backward()``,
``optimizer.step()``, ``zero_grad(set_to_none=True)``, timed between two ``torch.cuda.synchronize()``.

Modes: ``eager``; ``compile`` (``torch.compile(model)``, Inductor); ``liger`` (Liger-Kernel's
``apply_liger_kernel_to_llama``/``_qwen3`` with rms_norm, rope, swiglu and fused_linear_cross_entropy, applied
before the model is built; only where ``liger_kernel`` imports); ``fuser`` (``fuser.optimize(model)``).

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
import datetime
import gzip
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from jobs import (
    JOBS,
    LORA,
    MODE_TITLES,
    MODELS,
    MODES,
    TINY_BATCH,
    TINY_FIELDS,
    TINY_SEQ,
    TRAIN_STEP_LR,
    Job,
    model_config,
)

if importlib.util.find_spec("fuser") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


VERSIONED = ("torch", "triton", "transformers", "peft", "liger-kernel", "bitsandbytes")


# ---------------------------------------------------------------------------------------------------------
# Building a job's model
# ---------------------------------------------------------------------------------------------------------


def job_config(job: Job, args: argparse.Namespace, seq: int):
    """The job's transformers config: sdpa, no KV cache, ``--tiny`` and ``--layers`` applied, room for ``seq``."""
    fields: dict[str, Any] = dict(use_cache=False, attn_implementation="sdpa")
    if args.tiny:
        fields.update(TINY_FIELDS)
    if args.layers is not None:
        fields["num_hidden_layers"] = args.layers
    positions = fields.get("max_position_embeddings", MODELS[job.model].fields["max_position_embeddings"])
    fields["max_position_embeddings"] = max(positions, seq)
    return model_config(job.model, **fields)


def apply_liger(job: Job) -> None:
    """Patch transformers' model classes with Liger-Kernel's ops; must run before the model is built."""
    from liger_kernel import transformers as liger

    patch = {"LlamaConfig": liger.apply_liger_kernel_to_llama, "Qwen3Config": liger.apply_liger_kernel_to_qwen3}
    patch[MODELS[job.model].config](
        rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True
    )


def quantize_decoder_linears_nf4(model: torch.nn.Module, device: torch.device, compute_dtype: torch.dtype) -> int:
    """Replace every nn.Linear of the decoder layers by ``bnb.nn.Linear4bit`` (NF4) holding its weights, quantised."""
    import bitsandbytes as bnb

    replaced = 0
    for layer in model.model.layers:
        for name, linear in list(layer.named_modules()):
            if type(linear) is not torch.nn.Linear:
                continue
            quantized = bnb.nn.Linear4bit(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                compute_dtype=compute_dtype,
                quant_type="nf4",
                device="meta",  # no throw-away init: the weights come from `linear`
            )
            weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4", module=quantized)
            quantized.weight = weight.to(device)  # Params4bit quantises on its first move to a device
            if linear.bias is not None:
                quantized.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
            parent_name, _, child = name.rpartition(".")
            setattr(layer.get_submodule(parent_name) if parent_name else layer, child, quantized)
            replaced += 1
    return replaced


def build_model(job: Job, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, seq: int):
    """The job's model on ``device``: random weights, LoRA/QLoRA/checkpointing applied, in training mode."""
    import transformers

    config = job_config(job, args, seq)
    torch.manual_seed(args.seed)
    with torch.device(device):  # initialise on the device: an 8B model's random init on the CPU takes minutes
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if job.method == "qlora":
        quantize_decoder_linears_nf4(model, device, dtype)
        model.is_loaded_in_4bit = True  # as transformers marks a bitsandbytes load: peft then wraps with its Linear4bit
        torch.cuda.empty_cache()
    if job.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if job.method in ("lora", "qlora"):
        import peft

        torch.manual_seed(args.seed + 1)
        model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
    model.train()
    return model


def make_batches(n: int, batch: int, seq: int, vocab: int, seed: int, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(n)]


# ---------------------------------------------------------------------------------------------------------
# One mode, in this process
# ---------------------------------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    found = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    found["cuda"] = str(torch.version.cuda)
    return found


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


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


def new_result(args: argparse.Namespace) -> dict[str, Any]:
    """The record of one run: what ran where, filled in by :func:`run_mode` as it goes."""
    job, device = JOBS[args.job], torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return dict(
        job=args.job,
        mode=args.mode,
        status="running",
        phase="start",
        device=device_name(device),
        versions=versions(),
        dtype=str(dtype).removeprefix("torch."),
        batch=args.batch or (TINY_BATCH if args.tiny else job.batch),
        seq=args.seq or (TINY_SEQ if args.tiny else job.seq),
        tiny=args.tiny,
        attention_mask=args.attention_mask,
        fuser_patterns=args.fuser_patterns,
        steps=args.steps,
        warmup=args.warmup,
        command=shlex.join([sys.executable, *sys.argv]),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )


def run_mode(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Build, warm up, time and (with --profile) profile one job in one mode, filling ``result``.

    An out-of-memory error ends the run with status ``OOM``; any other error sets status ``error`` and is raised.
    """
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        run_mode_into(result, args, device)
        result["status"] = "ok"
    except Exception as error:
        if not is_oom(error):
            result.update(status="error", error=last_error_line(f"{type(error).__name__}: {error}"))
            raise
        result.update(status="OOM", error=last_error_line(str(error)))
    finally:
        take_peak(result, device)


def take_peak(result: dict[str, Any], device: torch.device) -> float | None:
    """The peak allocated GiB since the last call (then reset); ``result["peak_gib"]`` keeps the run's maximum."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    result["peak_gib"] = max(result.get("peak_gib", 0.0), peak)
    return peak


def run_mode_into(result: dict[str, Any], args: argparse.Namespace, device: torch.device) -> None:
    job, mode = JOBS[args.job], result["mode"]
    dtype, batch, seq = getattr(torch, result["dtype"]), result["batch"], result["seq"]
    result["phase"] = "build"
    if mode == "liger":
        apply_liger(job)
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
    n_profile = (3 if args.profile else 0) + (1 if args.memory_at_peak else 0)
    batches = make_batches(args.warmup + args.steps + n_profile, batch, seq, model.config.vocab_size, 1, device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # every batch has the same shape: one all-ones mask serves them all
    extra = {"attention_mask": torch.ones_like(batches[0])} if args.attention_mask else {}

    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids, **extra).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    losses, warmup_s, step_s = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for i, ids in enumerate(batches[: args.warmup + args.steps]):
                result["phase"] = "warm-up" if i < args.warmup else "timed"
                if i == args.warmup:
                    result["peak_warmup_gib"] = take_peak(result, device)  # build and warm-up
                sync()
                start = time.perf_counter()
                loss = train_step(ids)
                sync()
                (warmup_s if i < args.warmup else step_s).append(time.perf_counter() - start)
                losses.append(loss.item())
                step_ms = 1e3 * (warmup_s + step_s)[-1]
                progress = f"step {i} ({result['phase']}): loss {losses[-1]:.4f}, {step_ms:.0f} ms"
                print(f"[{args.job} {mode}] {progress}", file=sys.stderr)
        finally:  # also when a step failed: a fuser fall-back warning may explain it
            for category, message in dict.fromkeys((w.category.__name__, str(w.message)[:300]) for w in caught):
                if "fuser" in message:  # fuser's fall-backs are results; the rest is passed on
                    result.setdefault("fuser_warnings", []).append(message)
                if category not in ("DeprecationWarning", "FutureWarning"):
                    print(f"warning: {category}: {message}", file=sys.stderr)

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
        result["memory_at_peak"] = memory_at_peak(result, args, batches[-1], train_step, sync, device)
    result["phase"] = "done"


# ---------------------------------------------------------------------------------------------------------
# Profile: kernel time by op family
# ---------------------------------------------------------------------------------------------------------


def fuser_kernel_names() -> list[str]:
    """The launched ``@triton.jit`` kernels of fuser/kernels/*.py (helpers, named ``_…``, are inlined)."""
    spec = importlib.util.find_spec("fuser")
    if spec is None or spec.origin is None:
        return []
    names = []
    for path in sorted((Path(spec.origin).parent / "kernels").glob("*.py")):
        names += re.findall(r"@triton\.jit[^\n]*\n(?:\s*@[^\n]*\n)*\s*def\s+(\w+)", path.read_text())
    return sorted(n for n in names if not n.startswith("_"))


LIGER_KERNELS = re.compile(
    r"^(_rms_norm_|_block_rms_norm|_swiglu_|_geglu_|_triton_rope|liger_|element_mul_kernel|_cross_entropy)"
)
FAMILY_RULES: list[tuple[str, re.Pattern]] = [  # first match wins
    ("matmul", re.compile(r"^triton_tem_")),  # Inductor's matmul templates (max-autotune)
    ("elementwise: Inductor (triton_)", re.compile(r"^triton_")),
    # before matmul: memory-efficient attention's kernels are CUTLASS ones (fmha_cutlassF_…)
    ("attention", re.compile(r"flash|fmha|sdpa|scaled_dot_product|efficient_attention|attention|attn", re.I)),
    ("bitsandbytes NF4", re.compile(r"kDequantize|kQuantize|kgemm_4bit|dequantize_4bit|quantize_4bit", re.I)),
    # fp32 matmuls without TF32 run on the CUDA cores (cuBLAS's sm80 "ffma" kernels): peft's fp32 LoRA adapters
    ("matmul fp32 (CUDA cores)", re.compile(r"f32f32_f32f32.*ffma|ffma.*f32f32_f32f32|sgemm")),
    # cuBLAS/CUTLASS (nvjet: cuBLAS's Hopper kernels); aten's on a CPU
    ("matmul", re.compile(r"gemm|gemv|cutlass|cublas|nvjet|xmma|splitKreduce|^aten::(mm|addmm|bmm)$")),
    ("optimizer", re.compile(r"multi_tensor|adam|foreach", re.I)),
]
FAMILIES = (
    "matmul",
    "matmul fp32 (CUDA cores)",
    "attention",
    "fused ops (fuser)",
    "fused ops (Liger)",
    "elementwise: Inductor (triton_)",
    "elementwise: other",
    "optimizer",
    "bitsandbytes NF4",
)


def kernel_family(name: str, fuser_kernels: list[str]) -> str:
    """The op family of a GPU kernel (or, on a CPU, of an aten op) by its name."""
    short = name.removeprefix("void ").split("<")[0].split("(")[0].rsplit("::", 1)[-1]
    if name.startswith("fuser::") or any(short.startswith(k) for k in fuser_kernels):
        return "fused ops (fuser)"
    if LIGER_KERNELS.match(short):
        return "fused ops (Liger)"
    for family, rule in FAMILY_RULES:
        if rule.search(name):
            return family
    return "elementwise: other"


def kernel_times_from_trace(trace: dict) -> dict[str, list[float]]:
    """Kernel name → [total µs, launches] from a Chrome trace of the profiler (GPU kernels, copies, memsets)."""
    times: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X" and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            entry = times[event["name"]]
            entry[0] += float(event.get("dur", 0.0))
            entry[1] += 1
    return dict(times)


def family_table(times: dict[str, list[float]], n_steps: int, wall_ms: float | None) -> tuple[str, str]:
    """Markdown: ms per step and share of kernel time by family; and the top-15 kernels."""
    fuser_kernels = fuser_kernel_names()
    total_us = sum(t for t, _ in times.values()) or 1.0
    by_family = collections.Counter()
    for name, (t, _) in times.items():
        by_family[kernel_family(name, fuser_kernels)] += t
    rows = [
        [family, f"{by_family[family] / 1e3 / n_steps:.2f}", f"{by_family[family] / total_us:.1%}"]
        for family in FAMILIES
        if by_family[family] > 0
    ]
    rows.append(["**all kernels**", f"**{total_us / 1e3 / n_steps:.2f}**", "100%"])
    if wall_ms is not None:
        idle = wall_ms - total_us / 1e3 / n_steps
        rows.append(["wall time of the step (idle GPU / host overhead: " + f"{idle:.2f} ms)", f"{wall_ms:.2f}", ""])
    families = markdown_table(["op family", "ms / step", "% of kernel time"], rows)
    top = sorted(times.items(), key=lambda kv: -kv[1][0])[:15]
    top_rows = [
        [
            "`" + name.replace("|", "\\|")[:110] + "`",
            kernel_family(name, fuser_kernels),
            f"{calls / n_steps:g}",
            f"{t / 1e3 / n_steps:.3f}",
            f"{t / total_us:.1%}",
        ]
        for name, (t, calls) in top
    ]
    return families, markdown_table(["kernel", "family", "calls / step", "ms / step", "%"], top_rows)


def live_at_peak(events: list[dict]) -> tuple[int, list[dict]]:
    """Replay an allocator trace (``alloc`` / ``free_requested`` / ``free_completed`` events of ``addr`` and
    ``size``): the most bytes allocated at once (blocks allocated before the trace began not counted), and the
    events of the blocks live at that moment. A block counts as freed at its first free event."""
    live: dict[int, dict] = {}
    now = peak = 0
    peak_live: list[dict] = []
    for ev in events:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            now += ev["size"]
            if now > peak:
                peak, peak_live = now, list(live.values())
        elif ev["action"] in ("free_requested", "free_completed") and ev["addr"] in live:
            now -= live.pop(ev["addr"])["size"]
    return peak, peak_live


# groups listed by --memory-at-peak: 30 left the 1B job's 1.4 GiB difference to Liger-Kernel in the unlisted ones
MEMORY_GROUPS = 80


def memory_at_peak(result, args, ids, train_step, sync, device: torch.device) -> dict[str, Any] | None:
    """One more step with the CUDA allocator's history recorded; replay its trace to the moment the allocated
    bytes peak and write what is live then, grouped by where it was allocated (the first frame outside torch's
    own files, with its source line: Inductor's generated code names the buffer and its shape there), to
    ``memory_<job>_<mode>.md`` in ``--memory-at-peak``."""
    if device.type != "cuda":
        print("train_step: --memory-at-peak needs CUDA; skipped", file=sys.stderr)
        return None
    import linecache

    sync()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)
    try:
        train_step(ids)
        sync()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, peak_live = live_at_peak(snapshot["device_traces"][device.index or 0])

    def where(ev: dict) -> str:
        for frame in ev.get("frames", []):
            name = frame.get("filename", "")
            if "/torch/" in name and "torchinductor" not in name or name.startswith("<") or name.endswith(".cpp"):
                continue
            source = linecache.getline(name, frame.get("line", 0)).strip()[:110]
            return f"`{Path(name).name}:{frame.get('line')}` {frame.get('name', '')}: `{source}`"
        return "(no Python frame outside torch)"

    groups: dict[str, list[int]] = {}
    for ev in peak_live:
        groups.setdefault(where(ev), []).append(ev["size"])
    top = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:MEMORY_GROUPS]
    gib = 2.0**30
    lines = [
        f"# Memory at the peak of one step: {result['job']}, {result['mode']}",
        "",
        f"- command: `{result['command']}`",
        f"- date: {result['date']}; device: {result['device']}",
        f"- allocated before the step (parameters, gradients, optimizer state, caches): {base / gib:.2f} GiB;"
        f" allocated during the step, at its peak: {peak / gib:.2f} GiB; sum {(base + peak) / gib:.2f} GiB",
        f"- {len(peak_live)} blocks live at the peak; the {MEMORY_GROUPS} largest groups by allocation site:",
        "",
        "| GiB | blocks | largest MiB | allocated at |",
        "|---:|---:|---:|---|",
    ]
    for site, sizes in top:
        lines.append(f"| {sum(sizes) / gib:.3f} | {len(sizes)} | {max(sizes) / 2**20:.1f} | {site} |")
    out_dir = Path(args.memory_at_peak)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"memory_{result['job']}_{result['mode']}.md").write_text("\n".join(lines) + "\n")
    return {"before_gib": base / gib, "step_peak_gib": peak / gib, "blocks_at_peak": len(peak_live)}


def profile_steps(result, args, batches, train_step, sync, device: torch.device) -> dict[str, Any]:
    """Run ``batches`` under torch.profiler; write ``profile_<job>_<mode>.md`` (and the trace) to --profile."""
    from torch.profiler import ProfilerActivity, profile

    out_dir = Path(args.profile)
    out_dir.mkdir(parents=True, exist_ok=True)
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    sync()
    with profile(activities=[activity]) as prof:
        start = time.perf_counter()
        for ids in batches:
            train_step(ids)
        sync()
        wall_ms = 1e3 * (time.perf_counter() - start) / len(batches)
    stem = f"profile_{result['job']}_{result['mode']}"
    if device.type == "cuda":
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            trace = json.loads(raw.read_text())
            with gzip.open(out_dir / f"{stem}.trace.json.gz", "wt") as f:
                json.dump(trace, f)
        times = kernel_times_from_trace(trace)
        if not times:  # no kernel events in the trace: take the profiler's own device-time table
            print("train_step: the trace holds no kernel events; using key_averages()", file=sys.stderr)
            averages = prof.key_averages()
            times = {e.key: [e.self_device_time_total, e.count] for e in averages if e.self_device_time_total > 0}
        what = "CUDA kernel time (torch.profiler, CUDA activity)"
    else:  # no kernels on a CPU: self time of each op, so the code path runs in a smoke test
        times = {e.key: [e.self_cpu_time_total, e.count] for e in prof.key_averages() if e.self_cpu_time_total > 0}
        what = "CPU self time per op (torch.profiler, CPU activity; a smoke test of the code path only)"
    families, top = family_table(times, len(batches), wall_ms)
    header = report_header(f"Profile: {result['job']}, {MODE_TITLES[result['mode']]}", [result])
    text = (
        f"{header}\n{what} over {len(batches)} steps after {args.warmup} warm-up and {args.steps} timed steps; "
        f"per step, batch {result['batch']}×{result['seq']}.\n\n"
        f"{families}\n\nTop 15 kernels:\n\n{top}\n"
    )
    path = out_dir / f"{stem}.md"
    path.write_text(text)
    print(text)
    return {"file": str(path), "wall_ms": wall_ms, "kernel_ms": sum(t for t, _ in times.values()) / 1e3 / len(batches)}


# ---------------------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------------------


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(["---"] + ["---:"] * (len(columns) - 1)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


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
        + f", batch {batch}×{seq}, {any_result.get('dtype', 'bf16')}, sdpa, AdamW(fused), lr {TRAIN_STEP_LR:g}; "
        f"median of {steps} timed steps after {warmup} warm-up; peak = max_memory_allocated over the run; "
        f"warm-up = wall time of the warm-up steps, compilation included"
        + (" (tiny smoke-test config)" if any_result.get("tiny") else "")
        + ("; all-ones attention_mask passed, as HF Trainer's do" if any_result.get("attention_mask") else "")
        + (f"; fuser patterns `{any_result['fuser_patterns']}`" if any_result.get("fuser_patterns") else "")
    )
    text = report_header(f"Training step: {job_name}", list(results.values()), command)
    text += f"- setup: {setup}\n" + (f"- {note}\n" if note else "") + "\n"
    text += markdown_table(columns, rows) + "\n"

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
        text += markdown_table(["fuser", "ratio", "target", "met"], ratio_rows) + "\n"
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


# ---------------------------------------------------------------------------------------------------------
# Driver: every mode in its own process
# ---------------------------------------------------------------------------------------------------------


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
    return cmd


def fuser_config(args: argparse.Namespace):
    """fuser's config for this run: the inner compiler, and the patterns ``--fuser-patterns`` names."""
    import fuser

    patterns = None
    if args.fuser_patterns:
        names = tuple(n for n in args.fuser_patterns.removeprefix("+").split(",") if n)
        patterns = (*fuser.DEFAULT_PATTERNS, *names) if args.fuser_patterns.startswith("+") else names
    return fuser.FuserConfig(patterns=patterns, inner_compiler=args.fuser_inner_compiler)


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
    with tempfile.TemporaryDirectory(prefix="train_step_") as tmp:
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
        help="fuser's patterns, comma-separated; a leading + adds to the default ones (e.g. +lora_sum)",
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
