"""Gated activation (SwiGLU, GeGLU) forward + backward on one GPU: eager, Inductor, Liger-Kernel and fuser.

bf16 gate g and up u (both requiring grad) and a random upstream gradient dout. SwiGLU ``F.silu(g) * u`` for
intermediate size I in (8192, 14336, 28672) × rows in (8192, 16384), then GeGLU ``F.gelu(g, approximate="tanh")
* u`` at I = 16384 and 10240 (Gemma-3-4B), rows = 8192 (``--ops geglu``: GeGLU only):

- eager: the formula as models write it; Inductor: ``torch.compile`` of that (static shapes, recompiled per
  shape); Liger-Kernel: ``LigerSiLUMulFunction`` / ``LigerGELUMulFunction`` (``n/a`` when not installed; its
  backward writes dg and du into the saved g and u, so its inputs change between timed runs, which an elementwise
  kernel's time does not depend on); fuser: ``fuser.kernels.gated_activation.swiglu`` / ``geglu``;
- each implementation's out, dg and du are first checked against an fp32-computed reference (max of the three
  relative errors ‖a − b‖/‖b‖; the column says FAIL above 2e-2 and that time is left out);
- then timed with ``triton.testing.do_bench(warmup=25, rep=100, return_mode="median")`` (which flushes L2 before
  every run), grads reset between runs:
  * GPU time: do_bench of the replay of a CUDA graph captured from one forward + backward (and, in a second table,
    from the forward alone). This is the kernel comparison: the host's launch cost is out of it;
  * launched from Python: do_bench of the plain forward + backward call, as a training step issues it (host
    bound below a few hundred MB per tensor: autograd, op dispatch and kernel launches).
  Warm-up (Inductor's compile, Triton's JIT) happens before either measurement and is not timed.

Bytes counted for GB/s are the minimum any fused implementation must move: the forward reads g and u and writes
out (3 × rows × I × 2 bytes), the backward reads dout, g and u and writes dg and du (5 × rows × I × 2 bytes).
The copy ceiling is measured in the same run: a 2 GiB device-to-device ``copy_``, bytes read + written over its
median time (an H200 moves about 4.3 TB/s).

Run from the repository root, on a GPU (about 2–3 minutes on an H200, most of it Inductor compiling):

    python benchmarks/bench_gated_activation.py --out benchmarks/results/gated_activation_<gpu>_<date>.md
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import shlex
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_common import (
    FAIL_ABOVE,
    IMPLS,
    cuda_graph_ms,
    fmt_err,
    markdown_table,
    measure_copy_ceiling,
    rel_err,
    time_graph_and_launched,
    timing_columns,
)

SWIGLU_SHAPES = [(i, rows) for i in (8192, 14336, 28672) for rows in (8192, 16384)]  # (intermediate, rows)
GEGLU_SHAPES = ((16384, 8192), (10240, 8192))  # (I, rows); 10240: Gemma-3-4B's intermediate size
DTYPE = torch.bfloat16
NOMINAL_COPY_TBPS = 4.3  # H200 device-to-device copy, bytes read + written


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Llama's MLP: ``act_fn(gate_proj(x)) * up_proj(x)`` with SiLU."""
    return F.silu(g) * u


def gelu_tanh_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Gemma's MLP: ``gelu_pytorch_tanh``."""
    return F.gelu(g, approximate="tanh") * u


EAGER = {"swiglu": silu_mul, "geglu": gelu_tanh_mul}


def import_fuser_ops():
    """{"swiglu": ..., "geglu": ...} from fuser, importing from the checkout when fuser is not installed."""
    try:
        import fuser.kernels.gated_activation as ops
    except ImportError:  # a checkout without `pip install -e .`
        sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src"), str(Path(__file__).resolve().parents[1])]
        import fuser.kernels.gated_activation as ops
    return {"swiglu": ops.swiglu, "geglu": lambda g, u: ops.geglu(g, u, approximate="tanh")}


def import_liger():
    """({"swiglu": fn, "geglu": fn}, version), with None for what could not be imported."""
    fns = {}
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        fns["swiglu"] = LigerSiLUMulFunction.apply
    except Exception as e:  # not installed, or an import-time failure on this machine
        fns["swiglu"] = None
        reason = f"not available ({type(e).__name__}: {e})"
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction

        fns["geglu"] = LigerGELUMulFunction.apply
    except Exception as e:
        fns["geglu"] = None
        reason = f"not available ({type(e).__name__}: {e})"
    if all(fn is None for fn in fns.values()):
        return fns, reason
    try:
        version = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return fns, version


def make_impls(kind: str, fuser_ops: dict, liger_fns: dict) -> dict:
    """name → forward(g, u) -> out, or None when the implementation is not available."""
    # a fresh compile per shape: static shapes, as a training run at a fixed sequence length gets, and no
    # recompile limit reached across the shapes
    torch._dynamo.reset()
    return {
        "eager": EAGER[kind],
        "inductor": torch.compile(EAGER[kind], dynamic=False),
        "liger": liger_fns.get(kind),
        "fuser": fuser_ops[kind],
    }


# ---------------------------------------------------------------------------------------------------------
# Checking and timing
# ---------------------------------------------------------------------------------------------------------


def fp32_reference(kind: str, g: torch.Tensor, u: torch.Tensor, dout: torch.Tensor):
    """out, dg and du of the formula computed entirely in fp32 (no bf16 rounding in between)."""
    g32 = g.detach().float().requires_grad_()
    u32 = u.detach().float().requires_grad_()
    out32 = EAGER[kind](g32, u32)
    out32.backward(dout.float())
    return out32.detach(), g32.grad, u32.grad


def check(forward, g, u, dout, reference) -> float:
    """Max relative error of (out, dg, du) against the fp32 reference, on fresh copies of the inputs."""
    g = g.detach().clone().requires_grad_()
    u = u.detach().clone().requires_grad_()
    out = forward(g, u)
    out.backward(dout.clone())
    return max(
        rel_err(out.detach(), reference[0]),
        rel_err(g.grad, reference[1]),
        rel_err(u.grad, reference[2]),
    )


def time_impl(forward, g, u, dout) -> tuple[float, float, float]:
    """Median ms: (forward + backward GPU time, forward-only GPU time, forward + backward launched from Python)."""
    g = g.detach().clone().requires_grad_()
    u = u.detach().clone().requires_grad_()
    dout = dout.clone()

    def step():
        forward(g, u).backward(dout)

    def forward_only():
        with torch.no_grad():
            forward(g, u)

    gpu, launched = time_graph_and_launched(step, grads=[g, u], warm_up_also=[forward_only])
    return gpu, cuda_graph_ms(forward_only), launched


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------


def bench_shape(kind: str, intermediate: int, rows: int, fuser_ops: dict, liger_fns: dict) -> tuple[dict, dict]:
    """Per implementation: (GPU fwd+bwd ms, GPU fwd ms, launched ms) and the max relative error (None: n/a)."""
    gen = torch.Generator(device="cuda").manual_seed(intermediate * 100003 + rows)
    g = torch.randn(rows, intermediate, device="cuda", dtype=DTYPE, generator=gen) * 2
    u = torch.randn(rows, intermediate, device="cuda", dtype=DTYPE, generator=gen)
    dout = torch.randn(rows, intermediate, device="cuda", dtype=DTYPE, generator=gen)
    reference = fp32_reference(kind, g, u, dout)
    impls = make_impls(kind, fuser_ops, liger_fns)
    ms, err = {}, {}
    for name in IMPLS:
        forward = impls[name]
        if forward is None:
            ms[name], err[name] = (None, None, None), None
            continue
        try:
            err[name] = check(forward, g, u, dout, reference)
        except Exception as e:  # e.g. a Liger release whose kernel fails on this GPU: report, keep going
            print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            ms[name], err[name] = (None, None, None), None
            continue
        ms[name] = time_impl(forward, g, u, dout) if err[name] <= FAIL_ABOVE else (None, None, None)
        torch.cuda.empty_cache()
    del reference, impls
    torch.cuda.empty_cache()
    return ms, err


def run(args) -> str:
    import triton

    if not torch.cuda.is_available():
        raise SystemExit("bench_gated_activation: needs a CUDA GPU (torch.cuda.is_available() is False)")
    fuser_ops = import_fuser_ops()
    liger_fns, liger_version = import_liger()

    header = [
        "# Gated activation forward + backward (bf16; SwiGLU `F.silu(g) * u`, GeGLU `F.gelu(g, 'tanh') * u`)",
        "",
        f"- command: `{' '.join(shlex.quote(a) for a in sys.argv)}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- GPU: {torch.cuda.get_device_name()}",
        f"- torch {torch.__version__}, triton {triton.__version__}, liger-kernel {liger_version}",
        '- times: median ms, `triton.testing.do_bench(warmup=25, rep=100, return_mode="median")` (L2 flushed '
        "before each run), grads reset between runs, g ~ 2·N(0,1), u and dout ~ N(0,1); compiles excluded. "
        "GPU time: do_bench of a CUDA graph replay; launched: of the Python call",
        "- GB/s: bytes / fuser's time; forward 3 × rows × I × 2 bytes (reads g, u; writes out), backward "
        "5 × rows × I × 2 (reads dout, g, u; writes dg, du), forward + backward 8 × rows × I × 2",
        "- Liger's backward writes dg and du into its saved g and u (in place); the other three allocate them",
    ]
    print("\n".join(header), flush=True)
    ceiling = measure_copy_ceiling()
    ceiling_line = (
        f"- measured copy ceiling: {ceiling:.0f} GB/s (2 GiB device-to-device `copy_`, read + write; "
        f"{ceiling / (NOMINAL_COPY_TBPS * 1e3):.0%} of a nominal {NOMINAL_COPY_TBPS} TB/s)"
    )
    print(ceiling_line, flush=True)
    header.append(ceiling_line)

    tables = {"gpu": [], "gpu_forward": [], "launched": []}
    error_rows = []
    cases = [("swiglu", i, rows) for i, rows in SWIGLU_SHAPES] + [("geglu", i, rows) for i, rows in GEGLU_SHAPES]
    cases = [c for c in cases if c[0] in args.ops.split(",")]
    for kind, intermediate, rows in cases:
        ms, err = bench_shape(kind, intermediate, rows, fuser_ops, liger_fns)
        elements = rows * intermediate * DTYPE.itemsize
        for which, (table, nbytes) in enumerate(
            ((tables["gpu"], 8 * elements), (tables["gpu_forward"], 3 * elements), (tables["launched"], 8 * elements))
        ):
            times = {n: ms[n][which] for n in IMPLS}
            table.append([kind, str(intermediate), str(rows)] + timing_columns(times, err, nbytes, ceiling))
        error_rows.append([kind, str(intermediate), str(rows)] + [fmt_err(err[n]) for n in IMPLS])
        print(
            f"{kind} I {intermediate} rows {rows} | GPU fwd+bwd:",
            " | ".join(tables["gpu"][-1][3:]),
            "| GPU fwd:",
            " | ".join(tables["gpu_forward"][-1][3:7]),
            "| launched:",
            " | ".join(tables["launched"][-1][3:7]),
            "| max rel err:",
            " ".join(error_rows[-1][3:]),
            flush=True,
        )

    columns = [
        "op",
        "I",
        "rows",
        "eager ms",
        "inductor ms",
        "liger ms",
        "fuser ms",
        "fuser GB/s",
        "% of copy ceiling",
        "fuser / best other",
    ]
    return "\n".join(
        header
        + [
            "",
            "## GPU time, forward + backward (CUDA graph replay: kernels only, host launch cost excluded)",
            "",
            markdown_table(columns, tables["gpu"]),
            "",
            "fuser / best other: fuser's time over the fastest of eager, Inductor and Liger (below 1: fuser faster).",
            "",
            "## GPU time, forward only (CUDA graph replay, no grad)",
            "",
            markdown_table(columns, tables["gpu_forward"]),
            "",
            "## Launched from Python, forward + backward (host cost included: autograd, op dispatch, launches)",
            "",
            markdown_table(columns, tables["launched"]),
            "",
            f"## Max relative error of (out, dg, du) vs an fp32 reference (FAIL above {FAIL_ABOVE:g})",
            "",
            markdown_table(["op", "I", "rows", "eager", "inductor", "liger", "fuser"], error_rows),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown report to this file")
    parser.add_argument("--ops", default="swiglu,geglu", help="comma-separated subset of swiglu,geglu")
    args = parser.parse_args(argv)
    report = run(args)
    print()
    print(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
        print(f"written to {args.out}")


if __name__ == "__main__":
    main()
