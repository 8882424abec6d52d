"""RMSNorm forward + backward on one GPU: eager, Inductor, Liger-Kernel and fuser side by side.

bf16 activations and weight, eps 1e-6, Llama semantics (statistics in fp32, the normalised value cast back to the
input dtype before the weight multiply). For hidden in (2048, 4096, 8192) × rows in (8192, 16384, 32768):

- each implementation's output, dx and dweight are first checked against an fp32-computed reference
  (max of the three relative errors ‖a − b‖/‖b‖; the column says FAIL above 2e-2 and that time is left out);
- then one forward + backward (a fresh random dy per shape, grads reset between runs) is timed twice, both with
  ``triton.testing.do_bench(warmup=25, rep=100, return_mode="median")`` (which flushes L2 before every run):
  * GPU time: do_bench of the replay of a CUDA graph captured from that forward + backward. This is the kernel
    comparison: the host's launch cost is out of it (one graph launch), so bytes / time is meaningful;
  * launched from Python: do_bench of the plain call, as a training step issues it. Up to ~0.5 GB per tensor
    the host cannot keep up with the GPU (autograd, custom-op dispatch and Triton launch cost ~0.4–1 ms per
    forward + backward on the H200 machine this was written on), so these times measure Python, not kernels.
  Warm-up (Inductor's compile, Triton's JIT) happens before either measurement and is not timed.

Bytes counted for fuser's GB/s are the minimum any fused implementation must move: forward reads x and writes y,
backward reads x and dy and writes dx, i.e. 5 × rows × hidden × 2 bytes (the weight and dweight are negligible).
The copy ceiling is measured in the same run: a ≥ 1 GiB device-to-device ``copy_``, bytes read + written over its
median time (an H200 moves about 4.3 TB/s).

Run from the repository root, on a GPU (takes ~2–4 minutes on an H200):

    python benchmarks/bench_rms_norm.py --out benchmarks/results/rms_norm_<gpu>_<date>.md
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import shlex
import sys
from pathlib import Path

import torch
from bench_common import (
    FAIL_ABOVE,
    IMPLS,
    fmt_err,
    markdown_table,
    measure_copy_ceiling,
    rel_err,
    time_graph_and_launched,
    timing_columns,
)

HIDDEN_SIZES = (2048, 4096, 8192)
ROW_COUNTS = (8192, 16384, 32768)
DTYPE = torch.bfloat16
EPS = 1e-6
NOMINAL_COPY_TBPS = 4.3  # H200 device-to-device copy, bytes read + written


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm.forward."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class LlamaRMSNorm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().clone())
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return llama_rms_norm(x, self.weight, self.eps)


def import_fuser_rms_norm():
    try:
        import fuser
    except ImportError:  # a checkout without `pip install -e .`
        sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src"), str(Path(__file__).resolve().parents[1])]
        import fuser
    if hasattr(fuser, "rms_norm"):
        return fuser.rms_norm
    from fuser.kernels.rms_norm import rms_norm

    return rms_norm


def import_liger():
    """LigerRMSNorm and its version, or (None, reason) when liger-kernel is not installed."""
    try:
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
    except ImportError as e:
        return None, f"not installed ({e})"
    try:
        version = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return LigerRMSNorm, version


# ---------------------------------------------------------------------------------------------------------
# The implementations: each is (forward(x) -> y, the weight parameter whose .grad the backward fills)
# ---------------------------------------------------------------------------------------------------------


def make_eager(weight):
    module = LlamaRMSNorm(weight, EPS)
    return module, module.weight


def make_inductor(weight):
    # a fresh compile per shape: static shapes, as a training run at a fixed sequence length gets, and no
    # recompile limit reached across the nine shapes
    torch._dynamo.reset()
    compiled = torch.compile(llama_rms_norm, dynamic=False)
    w = torch.nn.Parameter(weight.detach().clone())
    return (lambda x: compiled(x, w, EPS)), w


def make_liger(weight, liger_cls):
    # defaults: casting_mode="llama", in_place=True (backward writes dx into dy's storage; each run gets its own dy)
    module = liger_cls(weight.shape[0], EPS).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
    return module, module.weight


def make_fuser(weight, fuser_rms_norm):
    w = torch.nn.Parameter(weight.detach().clone())
    return (lambda x: fuser_rms_norm(x, w, EPS, norm_dtype=x.dtype, out_dtype=x.dtype)), w


# ---------------------------------------------------------------------------------------------------------
# Checking and timing
# ---------------------------------------------------------------------------------------------------------


def fp32_reference(x, weight, dy):
    """Output, dx and dweight of the Llama formula computed entirely in fp32 (no bf16 rounding in between)."""
    x32 = x.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    y32 = w32 * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS))
    y32.backward(dy.float())
    return y32.detach(), x32.grad, w32.grad


def check(forward, weight_param, x, dy, reference) -> float:
    """Max relative error of (y, dx, dweight) against the fp32 reference."""
    x = x.detach().clone().requires_grad_()
    y = forward(x)
    y.backward(dy.clone())  # a copy: Liger's in-place backward overwrites it
    errors = [
        rel_err(y.detach(), reference[0]),
        rel_err(x.grad, reference[1]),
        rel_err(weight_param.grad, reference[2]),
    ]
    weight_param.grad = None
    return max(errors)


def time_fwd_bwd(forward, weight_param, x, dy) -> tuple[float, float]:
    """Median ms of one forward + backward: (GPU time, via a CUDA graph replay; launched from Python)."""
    x = x.detach().clone().requires_grad_()
    dy = dy.clone()

    def step():
        forward(x).backward(dy)

    return time_graph_and_launched(step, grads=[x, weight_param])


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------


def bench_shape(hidden: int, rows: int, fuser_rms_norm, liger_cls) -> tuple[dict, dict]:
    """Per implementation: (GPU ms, launched ms) and the max relative error (None: not installed or failed)."""
    gen = torch.Generator(device="cuda").manual_seed(hidden * 100003 + rows)
    x = torch.randn(rows, hidden, device="cuda", dtype=DTYPE, generator=gen)
    weight = (1.0 + 0.5 * torch.randn(hidden, device="cuda", generator=gen)).to(DTYPE)
    dy = torch.randn(rows, hidden, device="cuda", dtype=DTYPE, generator=gen)
    reference = fp32_reference(x, weight, dy)
    makers = {
        "eager": (make_eager, ()),
        "inductor": (make_inductor, ()),
        "liger": (make_liger, (liger_cls,)) if liger_cls is not None else None,
        "fuser": (make_fuser, (fuser_rms_norm,)),
    }
    ms, err = {}, {}
    for name in IMPLS:
        if makers[name] is None:
            ms[name], err[name] = (None, None), None
            continue
        make, extra = makers[name]
        forward, weight_param = make(weight, *extra)
        err[name] = check(forward, weight_param, x, dy, reference)
        ms[name] = time_fwd_bwd(forward, weight_param, x, dy) if err[name] <= FAIL_ABOVE else (None, None)
        del forward, weight_param
        torch.cuda.empty_cache()
    return ms, err


def run(args) -> str:
    import triton

    if not torch.cuda.is_available():
        raise SystemExit("bench_rms_norm: needs a CUDA GPU (torch.cuda.is_available() is False)")
    fuser_rms_norm = import_fuser_rms_norm()
    liger_cls, liger_version = import_liger()

    gpu = torch.cuda.get_device_name()
    header = [
        "# RMSNorm forward + backward (bf16, Llama semantics, eps 1e-6)",
        "",
        f"- command: `{' '.join(shlex.quote(a) for a in sys.argv)}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- GPU: {gpu}",
        f"- torch {torch.__version__}, triton {triton.__version__}, liger-kernel {liger_version}",
        "- times: median ms of one forward + backward, `triton.testing.do_bench(warmup=25, rep=100, "
        'return_mode="median")` (L2 flushed before each run), grads reset between runs, a random dy per shape; '
        "compiles excluded. GPU time: do_bench of a CUDA graph replay of the step; launched: of the Python call",
        "- fuser GB/s: 5 × rows × hidden × 2 bytes (fwd reads x, writes y; bwd reads x, dy, writes dx) / time",
    ]
    print("\n".join(header), flush=True)
    ceiling = measure_copy_ceiling()
    ceiling_line = (
        f"- measured copy ceiling: {ceiling:.0f} GB/s (2 GiB device-to-device `copy_`, read + write; "
        f"{ceiling / (NOMINAL_COPY_TBPS * 1e3):.0%} of a nominal {NOMINAL_COPY_TBPS} TB/s)"
    )
    print(ceiling_line, flush=True)
    header.append(ceiling_line)

    gpu_rows, launched_rows, error_rows = [], [], []
    for hidden in HIDDEN_SIZES:
        for rows in ROW_COUNTS:
            ms, err = bench_shape(hidden, rows, fuser_rms_norm, liger_cls)
            nbytes = 5 * rows * hidden * DTYPE.itemsize
            for which, table_rows in ((0, gpu_rows), (1, launched_rows)):
                times = {n: ms[n][which] for n in IMPLS}
                table_rows.append([str(hidden), str(rows)] + timing_columns(times, err, nbytes, ceiling))
            error_rows.append([str(hidden), str(rows)] + [fmt_err(err[n]) for n in IMPLS])
            print(
                f"hidden {hidden} rows {rows} | GPU:",
                " | ".join(gpu_rows[-1][2:]),
                "| launched:",
                " | ".join(launched_rows[-1][2:6]),
                "| max rel err:",
                " ".join(error_rows[-1][2:]),
                flush=True,
            )

    columns = [
        "hidden",
        "rows",
        "eager ms",
        "inductor ms",
        "liger ms",
        "fuser ms",
        "fuser GB/s",
        "% of copy ceiling",
        "fuser / best other",
    ]
    error_table = markdown_table(
        ["hidden", "rows", "eager", "inductor", "liger", "fuser"],
        error_rows,
    )
    report = "\n".join(
        header
        + [
            "",
            "## GPU time (CUDA graph replay: kernels only, host launch cost excluded)",
            "",
            markdown_table(columns, gpu_rows),
            "",
            "fuser / best other: fuser's time over the fastest of eager, Inductor and Liger (below 1: fuser faster).",
            "",
            "## Launched from Python (host cost included: autograd, op dispatch, kernel launches)",
            "",
            markdown_table(columns, launched_rows),
            "",
            f"## Max relative error of (y, dx, dweight) vs an fp32 reference (FAIL above {FAIL_ABOVE:g})",
            "",
            error_table,
            "",
        ]
    )
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown report to this file")
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
