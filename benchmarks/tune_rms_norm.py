"""Sweep launch configurations of fuser's RMSNorm kernels on a GPU, forward and backward timed apart.

For each shape (bf16, Llama semantics) it times every forward config (rows per program, warps) and every
backward config (rows per program, warps, programs per SM, rstd recomputed or loaded), each as the replay of a
CUDA graph that cycles through enough input buffers to defeat the L2 cache, and prints the best of each with the
current default's time. The result chooses ``_launch_config``; it is a tool, not a test.

    python benchmarks/tune_rms_norm.py [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
from bench_common import bf16_buffers, buffers_beyond_l2, cycled_graph_ms

from fuser.kernels import rms_norm as K

SHAPES = [(2048, 8192), (2048, 32768), (4096, 16384), (8192, 8192), (8192, 32768)]
EPS = 1e-6


def tune_shape(hidden, rows, sm_count):
    block_n = triton.next_power_of_2(hidden)
    nbytes = rows * hidden * 2
    count = buffers_beyond_l2(nbytes)
    xs, dys = bf16_buffers(rows, hidden, count), bf16_buffers(rows, hidden, count)
    ys, dxs = bf16_buffers(rows, hidden, count), bf16_buffers(rows, hidden, count)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).bfloat16()
    rstd = torch.empty(rows, device="cuda", dtype=torch.float32)
    results = {"fwd": [], "bwd": []}

    for block_m, warps, store in itertools.product((1, 2, 4, 8, 16), (4, 8, 16, 32), (False, True)):
        if block_m * block_n > 32768 or block_m * block_n < 256:
            continue

        def launch(i, block_m=block_m, warps=warps, store=store):
            K.rms_norm_fwd_kernel[(triton.cdiv(rows, block_m),)](
                xs[i], w, ys[i], rstd, hidden, hidden, rows, hidden, EPS, 0.0,
                HAS_WEIGHT=True, NORM_CAST=2, STORE_RSTD=store, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
            )  # fmt: skip

        results["fwd"].append(((block_m, warps, store), cycled_graph_ms(launch, count, rep=15)))

    K.rms_norm_fwd_kernel[(rows,)](
        xs[0], w, ys[0], rstd, hidden, hidden, rows, hidden, EPS, 0.0,
        HAS_WEIGHT=True, NORM_CAST=2, STORE_RSTD=True, BLOCK_M=1, BLOCK_N=block_n, num_warps=8,
    )  # fmt: skip
    for block_m, warps, per_sm, load in itertools.product((1, 2, 4), (4, 8, 16), (1, 2, 4, 8), (False, True)):
        if block_m * block_n > 32768:
            continue
        n_programs = min(per_sm * sm_count, triton.cdiv(rows, block_m))
        partial = torch.empty(n_programs, hidden, device="cuda", dtype=torch.float32)
        tiles = triton.cdiv(triton.cdiv(rows, block_m), n_programs)

        def launch(i, block_m=block_m, warps=warps, load=load, n_programs=n_programs, partial=partial, tiles=tiles):
            K.rms_norm_bwd_kernel[(n_programs,)](
                dys[i], xs[i], w, dxs[i], partial, rstd, dxs[i], dxs[i], dys[i], dys[i], hidden, hidden, hidden,
                hidden, hidden, rows, hidden, n_programs, tiles, EPS, 0.0, HAS_WEIGHT=True, COMPUTE_DW=True,
                NORM_CAST=2, LOAD_RSTD=load, HAS_DRES=False, STORE_DX2=False, N_DY=1, BLOCK_M=block_m,
                BLOCK_N=block_n, num_warps=warps,
            )  # fmt: skip
            partial.sum(0).to(torch.bfloat16)

        results["bwd"].append(((block_m, warps, per_sm, load), cycled_graph_ms(launch, count, rep=15)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    lines = ["| hidden | rows | fwd default ms | fwd best ms (BLOCK_M, warps, store rstd) | fwd floor ms "
             "| bwd default ms | bwd best ms (BLOCK_M, warps, progs/SM, load rstd) | bwd floor ms |",
             "|---:|---:|---:|---|---:|---:|---|---:|"]  # fmt: skip
    full = []
    for hidden, rows in SHAPES:
        res = tune_shape(hidden, rows, sm_count)
        d_bm, _, d_warps = K._launch_config(hidden)
        fwd_default = dict(res["fwd"]).get((d_bm, d_warps, False), float("nan"))
        bwd_default = dict(res["bwd"]).get((d_bm, d_warps, 4, False), float("nan"))
        fwd_best = min(res["fwd"], key=lambda r: r[1])
        bwd_best = min(res["bwd"], key=lambda r: r[1])
        fwd_best_nostore = min((r for r in res["fwd"] if not r[0][2]), key=lambda r: r[1])
        bwd_best_noload = min((r for r in res["bwd"] if not r[0][3]), key=lambda r: r[1])
        floor = rows * hidden * 2 / 4.24e12 * 1e3  # one tensor at the measured copy rate, in ms
        lines.append(
            f"| {hidden} | {rows} | {fwd_default:.4f} | {fwd_best[1]:.4f} {fwd_best[0]}; no store: "
            f"{fwd_best_nostore[1]:.4f} {fwd_best_nostore[0]} | {2 * floor:.4f} | {bwd_default:.4f} | "
            f"{bwd_best[1]:.4f} {bwd_best[0]}; no load: {bwd_best_noload[1]:.4f} {bwd_best_noload[0]} | "
            f"{3 * floor:.4f} |"
        )
        full.append(f"## hidden {hidden}, rows {rows}")
        for kind in ("fwd", "bwd"):
            for cfg, ms in sorted(res[kind], key=lambda r: r[1]):
                full.append(f"{kind} {cfg} {ms:.4f}")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n\n" + "\n".join(full) + "\n"
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
