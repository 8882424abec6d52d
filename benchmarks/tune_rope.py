"""Sweep fuser's RoPE launch configuration (pairs per tile, warps) on a GPU next to Inductor, fwd + bwd of q and k.

Llama-3-8B attention (32 q heads, 8 kv heads, head_dim 128, bf16), HF layouts as in ``bench_rope.py`` (whose
timing it reuses: CUDA-graph replay of one forward + backward). The result chooses ``rope._launch_config``; it
is a tool, not a test.

    python benchmarks/tune_rope.py [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools

import bench_rope as B
import torch

from fuser.kernels import rope as K

SHAPES = ((1, 8192), (4, 4096), (4, 8192))
PAIRS = (256, 512, 1024, 2048)
WARPS = (1, 2, 4, 8)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    default_config = K._launch_config
    lines = ["| B×T | inductor ms | fuser default ms | best ms (pairs/tile, warps) |", "|---|---:|---:|---|"]
    full = []
    for batch, seq in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(seq)
        q_heads, kv_heads, head_dim = B.N_Q_HEADS, B.N_KV_HEADS, B.HEAD_DIM
        q_proj = torch.randn(batch, seq, q_heads * head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        k_proj = torch.randn(batch, seq, kv_heads * head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        dq = torch.randn(batch, q_heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        dk = torch.randn(batch, kv_heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        cos, sin = B.llama_cos_sin(seq, torch.bfloat16)
        inductor = B.time_fwd_bwd(B.make_inductor(), q_proj, k_proj, cos, sin, dq, dk)[0]
        K._launch_config = default_config
        default = B.time_fwd_bwd(B.make_fuser(B.import_fuser_rope()), q_proj, k_proj, cos, sin, dq, dk)[0]
        results = []
        for pairs, warps in itertools.product(PAIRS, WARPS):

            def config(*a, pairs=pairs, warps=warps):
                saved = K._PAIRS_PER_TILE
                K._PAIRS_PER_TILE = pairs
                try:
                    cfg = default_config(*a)
                finally:
                    K._PAIRS_PER_TILE = saved
                return {**cfg, "num_warps": warps}

            K._launch_config = config
            ms = B.time_fwd_bwd(B.make_fuser(B.import_fuser_rope()), q_proj, k_proj, cos, sin, dq, dk)[0]
            results.append(((pairs, warps), ms))
            full.append(f"{batch}x{seq} pairs {pairs} warps {warps}: {ms:.4f}")
        K._launch_config = default_config
        best = min(results, key=lambda r: r[1])
        lines.append(f"| {batch}×{seq} | {inductor:.4f} | {default:.4f} | {best[1]:.4f} {best[0]} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n\n" + "\n".join(full) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
