"""Host time per call of fuser's ops (issue 19: a Gemma-3 step through fuser leaves the GPU idle for 19 of 113 ms).

Each op is called in a loop on tensors so small that its kernels take a few µs on the GPU: the wall time per call,
with the queue kept from filling (a synchronize every ``--chunk`` calls), is then what the host spends to launch
it. Beside fuser's ops, the floors it is made of: an aten op (``torch.add``), an empty ``torch.library.custom_op``
(the dispatcher and the custom-op wrapper alone) and a bare Triton launch of a one-line kernel. Each fuser op is
timed twice: through its default overload (the custom-op wrapper, as eager calls it) and through its ``direct``
overload (what Inductor's compiled graphs call, ``src/fuser/inductor/direct_calls.py``).

    python benchmarks/host_overhead.py [--calls 2000] [--out report.md]      # CUDA
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import triton
import triton.language as tl
from bench_common import markdown_table

import fuser  # noqa: F401  (registers torch.ops.fuser)


@triton.jit
def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n), mask=offsets < n)


@torch.library.custom_op("fuser_bench::identity", mutates_args=())
def _identity(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def host_us(fn, calls: int, chunk: int) -> float:
    """Median over 5 runs of the wall µs per call of ``fn()``, synchronising every ``chunk`` calls."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for i in range(calls):
            fn()
            if i % chunk == chunk - 1:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        runs.append(1e6 * (time.perf_counter() - start) / calls)
    return sorted(runs)[2]


class _Overloads:
    """``torch.ops.fuser`` with each op's ``overload`` standing in for its default one (``ops.rms_norm.default``
    is then ``torch.ops.fuser.rms_norm.direct``)."""

    def __init__(self, overload: str) -> None:
        self.overload = overload

    def __getattr__(self, name: str):
        # made once per op and kept: the lambdas below look it up on every call, which is not the op's host time
        packet = type(name, (), {"default": getattr(getattr(torch.ops.fuser, name), self.overload)})
        setattr(self, name, packet)
        return packet


def cases(rows: int, hidden: int, rank: int, overload: str = "default") -> dict:
    dev, bf16, f32 = "cuda", torch.bfloat16, torch.float32
    ops = torch.ops.fuser if overload == "default" else _Overloads(overload)
    x = torch.randn(rows, hidden, device=dev, dtype=bf16)
    h = torch.randn(rows, hidden, device=dev, dtype=bf16)
    w_norm = torch.randn(hidden, device=dev, dtype=bf16)
    a_w = torch.randn(rank, hidden, device=dev, dtype=f32)
    b_w = torch.randn(hidden, rank, device=dev, dtype=f32)
    a = torch.randn(rows, rank, device=dev, dtype=f32)
    sum32 = torch.randn(rows, hidden, device=dev, dtype=f32)
    dy32 = torch.randn(rows, rank, device=dev, dtype=f32)
    g = torch.randn(rows, hidden, device=dev, dtype=bf16)
    u = torch.randn(rows, hidden, device=dev, dtype=bf16)
    heads, dim = 2, 64
    q = torch.randn(1, heads, rows, dim, device=dev, dtype=bf16)
    k = torch.randn(1, heads, rows, dim, device=dev, dtype=bf16)
    cos = torch.randn(1, 1, rows, dim, device=dev, dtype=bf16)
    sin = torch.randn(1, 1, rows, dim, device=dev, dtype=bf16)
    y = torch.empty_like(x)
    n = x.numel()
    rstd = ops.rms_norm.default(x, w_norm, 1e-6, 0.0, f32, bf16)[1]
    return {
        "torch.add (aten)": lambda: torch.add(x, h),
        "empty custom_op (clone)": lambda: torch.ops.fuser_bench.identity.default(x),
        "bare Triton launch": lambda: _copy_kernel[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024),
        "fuser::rms_norm": lambda: ops.rms_norm.default(x, w_norm, 1e-6, 0.0, f32, bf16),
        "fuser::rms_norm_backward": lambda: ops.rms_norm_backward.default(x, x, w_norm, rstd, 1e-6, 0.0, f32, True),
        "fuser::add_rms_norm": lambda: ops.add_rms_norm.default(h, sum32, w_norm, 1e-6, 0.0, f32, bf16),
        "fuser::upcast_linear": lambda: ops.upcast_linear.default(x, a_w, None, True),
        "fuser::upcast_linear_grads": lambda: ops.upcast_linear_grads.default(dy32, x, a_w, True, True, True),
        "fuser::lora_sum": lambda: ops.lora_sum.default(x, a, b_w, 2.0, False, None, True),
        "fuser::lora_sum_grads": lambda: ops.lora_sum_grads.default(sum32, a, b_w, 2.0, True, True, True),
        "fuser::gated_activation": lambda: ops.gated_activation.default(g, u, None, None, 1.0, 1.0, "gelu_tanh"),
        "fuser::rope": lambda: ops.rope.default(q, k, cos, sin, dim, "half", None),
        "fuser::upcast_linear_gated_grads_acc_": lambda: torch.ops.fuser.upcast_linear_gated_grads_acc_.default(
            y, a, g, u, a_w, 1.0, 1.0, "gelu_tanh", True
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--chunk", type=int, default=200)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from fuser.inductor import direct_calls

    direct_calls.register()
    rows = []
    direct = cases(args.rows, args.hidden, args.rank, "direct")
    for name, fn in cases(args.rows, args.hidden, args.rank).items():
        row = [name]
        for one in (fn, direct[name] if name.startswith("fuser::") else None):
            try:
                row.append("–" if one is None else f"{host_us(one, args.calls, args.chunk):.1f}")
            except Exception as error:  # noqa: BLE001  (a failing op is a cell, not the end of the table)
                row.append(f"error: {type(error).__name__}: {str(error)[:80]}")
        rows.append(row)
    now = datetime.datetime.now(datetime.UTC)
    text = (
        f"# Host µs per call (`python benchmarks/host_overhead.py`, {now:%Y-%m-%d %H:%M} "
        f"UTC, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
        f"[{args.rows}, {args.hidden}] bf16 rows, rank {args.rank}, {args.calls} calls, median of 5)\n\n"
        + markdown_table(["call", "µs per call", "µs, direct overload"], rows, label_columns=1)
    )
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
