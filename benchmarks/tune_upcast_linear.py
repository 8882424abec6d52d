"""Sweep the launch configurations of fuser's ``upcast_linear`` Triton kernels (forward, dx, dW) on a GPU, next to
cuBLAS's fp32 path (what the op runs without them) and the memory floor, at Llama-3-8B LoRA-A shapes (8192 rows).

Each kernel's time is the median of ``triton.testing.do_bench`` over the whole wrapper (allocation and, for dW, the
sum of the row splits' partial sums included). The relative error of each kernel's output against fp64 is printed
for the best configuration, for the default one, for ``input_precision="ieee"`` and for cuBLAS. The result chooses
``upcast_linear.CONFIGS``; it is a tool, not a test.

    python benchmarks/tune_upcast_linear.py [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from fuser.kernels import upcast_linear as K

SHAPES = ((8192, 4096, 16), (8192, 14336, 16), (8192, 4096, 64))
# calls per Llama-3-8B LoRA r16 layer at each shape (q, k, v, o, gate, up read 4096 inputs; down 14336); the
# rank-64 shape weighs in once, so a configuration must also serve wider adapters
LAYER_CALLS = {(4096, 16): 6, (14336, 16): 1, (4096, 64): 1}
# lora_sum's forward per layer, by output width: q, o and down write 4096 columns, gate and up 14336 (k and v's 1024
# are not among the shapes)
SUM_CALLS = {(4096, 16): 3, (14336, 16): 2, (4096, 64): 1}
CONFIG_OF = {"fwd": "fwd", "dx": "dx", "dw": "dw", "sum": "dx"}  # which CONFIGS entry a kernel's timing tunes
HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e, nominal
SPACE = {
    "fwd": [
        {"BLOCK_M": m, "BLOCK_K": k, "num_warps": 4, "num_stages": 4, "SPLIT_K": sk}
        for m, k, sk in itertools.product((32, 64), (64, 128), (1, 2, 4, 8))
    ],
    # dx (and "sum": the same kernel as lora_sum's forward, base + s · (a @ Bᵀ)): each program ROW_TILES row tiles
    "dx": [
        {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": 2, "ROW_TILES": t}
        for m, n, w, t in itertools.product((32, 64), (128, 256), (4, 8), (1, 4, 8, 16))
    ],
    # dW: more row splits (with fewer row blocks each) and narrower column blocks, for more programs at 4096 inputs
    "dw": [
        {
            "BLOCK_M": m,
            "BLOCK_N": n,
            "num_warps": 4,
            "num_stages": 3,
            "SPLITS": sp,
            "MIN_SPLIT_BLOCKS": 2,
            "PRECISION": p,
            "BLOCK_N_WIDE_RANK": None,  # the BLOCK_N swept at every rank
        }
        for m, n, sp, p in itertools.product((32, 64), (32, 64, 128), (16, 32, 64), ("tf32x3", "ieee"))
    ],
}


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def runs(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> dict:
    """Per kernel: fuser's wrapper, cuBLAS's fp32 equivalent, the bytes it must move at least."""
    rows, n_in = x.shape
    n_out = w.shape[0]
    bt = w.t().contiguous().t()  # [n_out, n_in] at strides (1, n_out): lora_sum passes B [n_in, n_out] transposed
    return {
        "fwd": (lambda: K._forward_triton(x, w), lambda: x.float() @ w.t(), 2 * rows * n_in + 4 * rows * n_out),
        "dx": (lambda: K._dx_triton(dy, w, x.dtype), lambda: (dy @ w).to(x.dtype), 2 * rows * n_in),
        "dw": (lambda: K._dw_triton(dy, x), lambda: dy.t() @ x.float(), 2 * rows * n_in + 4 * rows * n_out),
        # lora_sum's forward: x as the bf16 base, dy as the fp32 LoRA A output, w's transpose as B
        "sum": (
            lambda: K._dx_triton(dy, bt, x.dtype, base=x, scale=2.0),
            lambda: (x.float() + 2.0 * (dy @ bt)).to(x.dtype),
            4 * rows * n_in,
        ),
    }


def measure(kind: str, ours, want: torch.Tensor, base: dict, cfg: dict) -> tuple[float, float]:
    """(µs, relative error against fp64) of ``ours`` with ``cfg`` laid over the kernel's default configuration."""
    K.CONFIGS[kind] = {**base, **cfg}
    try:
        out = ours()
        return triton.testing.do_bench(ours) * 1e3, rel(out, want)
    finally:
        K.CONFIGS[kind] = dict(base)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--kinds", default=",".join(SPACE), help="comma-separated kernels to sweep (fwd,dx,dw)")
    args = parser.parse_args()
    kinds = [k for k in CONFIG_OF if k in args.kinds.split(",") or (k == "sum" and "dx" in args.kinds.split(","))]
    default = {k: dict(v) for k, v in K.CONFIGS.items()}
    lines = [
        "| rows×in×out | kernel | floor µs | cuBLAS fp32 µs | ieee (default tiles) µs | default µs | best µs"
        " | best config | err cuBLAS | err ieee | err default | err best |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    full = []
    totals: dict[str, dict[str, list]] = {kind: {} for kind in SPACE}  # per CONFIGS entry and configuration:
    # [time weighted by calls per layer, worst error, shapes run]
    for rows, n_in, n_out in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(rows + n_in + n_out)
        x = torch.randn(rows, n_in, device="cuda", generator=gen).to(torch.bfloat16)
        w = 0.02 * torch.randn(n_out, n_in, device="cuda", generator=gen)
        dy = torch.randn(rows, n_out, device="cuda", generator=gen)
        x64, w64, dy64 = x.double(), w.double(), dy.double()
        want = {"fwd": x64 @ w64.t(), "dx": dy64 @ w64, "dw": dy64.t() @ x64, "sum": x64 + 2.0 * (dy64 @ w64)}
        for kind, (ours, cublas, nbytes) in runs(x, w, dy).items():
            if kind not in kinds:
                continue
            tuned = CONFIG_OF[kind]
            floor_us = nbytes / HBM_BYTES_PER_S * 1e6
            t_cublas = triton.testing.do_bench(cublas) * 1e3
            err_cublas = rel(cublas(), want[kind])

            t_ieee, err_ieee = measure(tuned, ours, want[kind], default[tuned], {"PRECISION": "ieee"})
            t_default, err_default = measure(tuned, ours, want[kind], default[tuned], {})
            results = []
            for cfg in SPACE[tuned]:
                try:
                    t, err = measure(tuned, ours, want[kind], default[tuned], cfg)
                except Exception as exc:  # a tile that does not fit in shared memory
                    full.append(f"{rows}x{n_in}x{n_out} {kind} {cfg}: failed ({type(exc).__name__})")
                    continue
                results.append((t, err, cfg))
                full.append(f"{rows}x{n_in}x{n_out} {kind} {cfg}: {t:.1f} us, err {err:.2e}")
                entry = totals[tuned].setdefault(repr(cfg), [0.0, 0.0, 0])
                entry[0] += t * (SUM_CALLS if kind == "sum" else LAYER_CALLS).get((n_in, n_out), 1)
                entry[1] = max(entry[1], err)
                entry[2] += 1
            t_best, err_best, cfg_best = min(results, key=lambda r: r[0])
            lines.append(
                f"| {rows}×{n_in}×{n_out} | {kind} | {floor_us:.1f} | {t_cublas:.1f} | {t_ieee:.1f} | {t_default:.1f}"
                f" | {t_best:.1f} | `{cfg_best}` | {err_cublas:.1e} | {err_ieee:.1e} | {err_default:.1e}"
                f" | {err_best:.1e} |"
            )
            print(lines[-1], flush=True)
    # the configuration to take: least time per Llama-3-8B LoRA layer (6 adapters on 4096 inputs, 1 on 14336, and
    # the rank-64 shape once), among those that ran at every shape; its worst error is printed beside it
    lines += ["", "Suggested `CONFIGS` (least time per Llama-3-8B layer's lora_A calls, every shape run):", ""]
    for kind, by_cfg in totals.items():
        timed = sum(CONFIG_OF[k] == kind for k in kinds)  # kernels timed with this CONFIGS entry, at every shape
        complete = {c: v for c, v in by_cfg.items() if v[2] == timed * len(SHAPES)}
        if complete:
            cfg, (layer_us, worst_err, _) = min(complete.items(), key=lambda kv: kv[1][0])
            lines.append(f"- {kind}: `{cfg}`: {layer_us:.0f} µs per layer, worst error {worst_err:.1e}")
    text = "\n".join(lines) + "\n\nAll configurations:\n\n" + "\n".join(f"- {f}" for f in full) + "\n"
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
