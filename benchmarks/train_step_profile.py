"""``--profile``: kernel time of a few training steps under ``torch.profiler``, grouped by op family (matmul,
attention, fuser's and Liger-Kernel's fused ops, Inductor's elementwise kernels, the optimizer, ...).
"""

from __future__ import annotations

import bisect
import collections
import gzip
import importlib.util
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_common import markdown_table
from jobs import MODE_TITLES
from train_step_report import report_header


def fuser_kernel_names() -> list[str]:
    """The launched ``@triton.jit`` kernels of src/fuser/kernels/*.py (helpers, named ``_…``, are inlined)."""
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


GAP_US = 10.0  # GPU idle shorter than this is launch latency, not a host stall


def _innermost_ops(ops_by_tid: dict, tid, t: float) -> list[str]:
    """Names of the CPU ops on thread ``tid`` running at time ``t``, outermost first (the profiler nests them; the
    5,000 ops started last before ``t`` are searched)."""
    starts, ops = ops_by_tid.get(tid, ([], []))
    last = bisect.bisect_right(starts, t) - 1
    chain = []
    for i in range(last, max(-1, last - 5000), -1):
        op = ops[i]
        if op["ts"] + op.get("dur", 0.0) >= t:
            chain.append(op["name"])
    return chain[::-1]


def idle_gaps(trace: dict, n_steps: int) -> str:
    """Markdown: where the GPU sits idle (no kernel, copy or set on any stream for over ``GAP_US``), attributed to
    what the host was doing when it launched the kernel that ended the gap: the innermost CPU op enclosing that
    launch, and the fuser/aten op above it. Needs a trace with CPU activity."""
    events = trace.get("traceEvents", [])
    gpu = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: e["ts"],
    )
    launches = {
        e["args"]["correlation"]: e
        for e in events
        # Triton launches through the driver API (cuLaunchKernelEx), cuBLAS and aten through the runtime
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    ops_by_tid: dict = {}
    for e in sorted((e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"), key=lambda e: e["ts"]):
        starts, ops = ops_by_tid.setdefault(e["tid"], ([], []))
        starts.append(e["ts"])
        ops.append(e)
    by_op: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    busy_until, total, count = None, 0.0, 0
    for e in gpu:
        if busy_until is not None and e["ts"] - busy_until > GAP_US:
            gap = e["ts"] - busy_until
            launch = launches.get(e.get("args", {}).get("correlation"))
            chain = _innermost_ops(ops_by_tid, launch["tid"], launch["ts"]) if launch else []
            named = [n for n in chain if n.startswith(("fuser::", "aten::", "triton", "## ", "Torch-Compiled"))]
            where = " / ".join(dict.fromkeys((named[-2:] if named else chain[-1:]) or ["(no CPU op)"]))
            entry = by_op[f"{where[:120]} → `{e['name'][:50]}`"]
            entry[0] += gap
            entry[1] += 1
            total += gap
            count += 1
        end = e["ts"] + e.get("dur", 0.0)
        busy_until = end if busy_until is None else max(busy_until, end)
    rows = [
        [name.replace("|", "\\|"), f"{n / n_steps:g}", f"{t / 1e3 / n_steps:.3f}", f"{t / max(total, 1e-9):.1%}"]
        for name, (t, n) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:20]
    ]
    head = (
        f"GPU idle gaps over {GAP_US:g} µs: {count / n_steps:g} per step, {total / 1e3 / n_steps:.2f} ms per step, "
        "by the host op that launched the kernel ending the gap (the op's CPU time is what the GPU waited for):\n\n"
    )
    columns = ["launched in → kernel", "gaps / step", "ms / step", "% of idle"]
    return head + markdown_table(columns, rows, label_columns=1)


TOP_KERNELS = 40  # rows of the kernel table


def family_table(times: dict[str, list[float]], n_steps: int, wall_ms: float | None) -> tuple[str, str]:
    """Markdown: ms per step and share of kernel time by family; and the top-``TOP_KERNELS`` kernels."""
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
        label = f"median timed step, unprofiled (idle GPU / host overhead: {idle:.2f} ms)"
        rows.append([label, f"{wall_ms:.2f}", ""])
    families = markdown_table(["op family", "ms / step", "% of kernel time"], rows, label_columns=1)
    top = sorted(times.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
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
    return families, markdown_table(["kernel", "family", "calls / step", "ms / step", "%"], top_rows, label_columns=1)


def profile_steps(result, args, batches, train_step, sync, device: torch.device) -> dict[str, Any]:
    """Run ``batches`` under torch.profiler; write ``profile_<job>_<mode>.md`` (and the trace) to --profile."""
    from torch.profiler import ProfilerActivity, profile

    out_dir = Path(args.profile)
    out_dir.mkdir(parents=True, exist_ok=True)
    # on CUDA the CPU ops too, so idle_gaps can say what the host was doing while the GPU waited
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    sync()
    with profile(activities=activities) as prof:
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
    # the idle GPU time against the timed steps' median: recording CPU ops slows the host, so the profiled
    # steps' own wall time overstates what a host-bound step loses (the gap table attributes it, in those units)
    families, top = family_table(times, len(batches), result.get("step_ms", wall_ms))
    gaps = f"\n{idle_gaps(trace, len(batches))}\n" if device.type == "cuda" else ""
    header = report_header(f"Profile: {result['job']}, {MODE_TITLES[result['mode']]}", [result])
    text = (
        f"{header}\n{what} over {len(batches)} steps after {args.warmup} warm-up and {args.steps} timed steps; "
        f"per step, batch {result['batch']}×{result['seq']}.\n\n"
        f"{families}\n\nTop {TOP_KERNELS} kernels:\n\n{top}\n{gaps}"
    )
    path = out_dir / f"{stem}.md"
    path.write_text(text)
    print(text)
    return {"file": str(path), "wall_ms": wall_ms, "kernel_ms": sum(t for t, _ in times.values()) / 1e3 / len(batches)}
