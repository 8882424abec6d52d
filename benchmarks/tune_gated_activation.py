"""Sweep launch configurations of fuser's gated-activation kernels on a GPU, forward and backward timed apart,
next to Inductor's kernel for the same elementwise work on the same buffers.

For each (activation, rows, I) in bf16 it times every tile shape (rows per tile, columns per tile, warps) of the
forward (reads g, u; writes out) and the backward (reads dout, g, u; writes dg, du) as the replay of a CUDA graph
that cycles through enough buffers to defeat the L2 cache, and the Inductor-compiled formula of each pass
(``F.silu(g) * u`` / ``F.gelu(g, approximate="tanh") * u`` and their ``aten`` backward formulas) the same way.
The result chose ``_launch_config``; it is a tool, not a test. (The 2026-11-30 run also tried ``gelu_tanh``
through ``libdevice.tanh`` as activation code 3, a kernel branch since removed: it was no faster than the sigmoid
form, see ``results/tune_gated_activation_h200_2026-11-30.md``.)

    python benchmarks/tune_gated_activation.py [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
from bench_common import bf16_buffers, buffers_beyond_l2, cycled_graph_ms

from fuser.kernels import gated_activation as K
from fuser.kernels.activations import ACTIVATION_CODE

SHAPES = [(8192, 14336), (16384, 28672), (8192, 16384)]
TILES = [(1, 1024, 4), (1, 1024, 8), (2, 1024, 8), (4, 1024, 8), (8, 1024, 16), (1, 2048, 8), (2, 2048, 16),
         (1, 4096, 16), (4, 512, 4), (8, 512, 8), (2, 512, 4)]  # fmt: skip


def inductor_passes(activation):
    if activation == "silu":

        def fwd(g, u):
            return F.silu(g.float()).mul(u.float()).to(g.dtype)

        def bwd(dout, g, u):
            gf, uf, df = g.float(), u.float(), dout.float()
            s = torch.sigmoid(gf)
            return (df * uf * s * (1 + gf * (1 - s))).to(g.dtype), (df * gf * s).to(g.dtype)
    else:

        def fwd(g, u):
            return (F.gelu(g.float(), approximate="tanh") * u.float()).to(g.dtype)

        def bwd(dout, g, u):
            gf, uf, df = g.float(), u.float(), dout.float()
            dg = torch.ops.aten.gelu_backward(df * uf, gf, approximate="tanh")
            return dg.to(g.dtype), (df * F.gelu(gf, approximate="tanh")).to(g.dtype)

    return torch.compile(fwd), torch.compile(bwd)


def tune_shape(activation, rows, cols):
    nbytes = rows * cols * 2
    count = buffers_beyond_l2(nbytes)
    gs, us, douts, outs, dgs, dus = (bf16_buffers(rows, cols, count) for _ in range(6))
    codes = [ACTIVATION_CODE[activation]]
    res = {"fwd": [], "bwd": []}
    for code, (bm, bn, warps) in itertools.product(codes, TILES):
        grid = (triton.cdiv(rows, bm) * triton.cdiv(cols, bn),)

        def fwd(i, code=code, bm=bm, bn=bn, warps=warps, grid=grid):
            K.gated_act_fwd_kernel[grid](
                gs[i], us[i], gs[i], us[i], outs[i], outs[i], outs[i], cols, cols, 0, 0, cols, 0, 0, rows, cols,
                1.0, 1.0, ACTIVATION=code, HAS_GATE_LORA=False, HAS_UP_LORA=False, BLOCK_M=bm, BLOCK_N=bn,
                num_warps=warps,
            )  # fmt: skip

        def bwd(i, code=code, bm=bm, bn=bn, warps=warps, grid=grid):
            K.gated_act_bwd_kernel[grid](
                douts[i], gs[i], us[i], dgs[i], dus[i], dgs[i], dgs[i], cols, cols, cols, cols, cols, 0, 0, rows,
                cols, 1.0, 1.0, ACTIVATION=code, NEED_DG=True, NEED_DU=True, WRITE_DGATE=True, WRITE_DUP=True,
                WRITE_DGATE_LORA=False, WRITE_DUP_LORA=False, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
            )  # fmt: skip

        res["fwd"].append(((code, bm, bn, warps), cycled_graph_ms(fwd, count, rep=20)))
        res["bwd"].append(((code, bm, bn, warps), cycled_graph_ms(bwd, count, rep=20)))
    ind_fwd, ind_bwd = inductor_passes(activation)
    res["inductor_fwd"] = cycled_graph_ms(lambda i: ind_fwd(gs[i], us[i]), count, rep=20)
    res["inductor_bwd"] = cycled_graph_ms(lambda i: ind_bwd(douts[i], gs[i], us[i]), count, rep=20)
    return res


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lines = [
        "| act | rows | I | fwd default | fwd best (code, BM, BN, warps) | inductor fwd | bwd default "
        "| bwd best (code, BM, BN, warps) | inductor bwd |",
        "|---|---:|---:|---:|---|---:|---:|---|---:|",
    ]
    full = []
    for activation, (rows, cols) in itertools.product(("silu", "gelu_tanh"), SHAPES):
        if activation == "gelu_tanh" and cols == 28672:
            continue
        res = tune_shape(activation, rows, cols)
        bm, bn, warps = K._launch_config(cols)
        default = (ACTIVATION_CODE[activation], bm, bn, warps)
        f_def, b_def = dict(res["fwd"]).get(default, float("nan")), dict(res["bwd"]).get(default, float("nan"))
        f_best, b_best = min(res["fwd"], key=lambda r: r[1]), min(res["bwd"], key=lambda r: r[1])
        lines.append(
            f"| {activation} | {rows} | {cols} | {f_def:.4f} | {f_best[1]:.4f} {f_best[0]} | "
            f"{res['inductor_fwd']:.4f} | {b_def:.4f} | {b_best[1]:.4f} {b_best[0]} | {res['inductor_bwd']:.4f} |"
        )
        print(lines[-1], flush=True)
        full.append(f"## {activation} rows {rows} I {cols}")
        for kind in ("fwd", "bwd"):
            full += [f"{kind} {cfg} {ms:.4f}" for cfg, ms in sorted(res[kind], key=lambda r: r[1])]
    text = "\n".join(lines) + "\n\n" + "\n".join(full) + "\n"
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
