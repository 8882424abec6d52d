"""How far one bf16 LoRA step's adapter gradients land from fp32's, for eager, Inductor and fuser (CPU, tiny Llama).

The model is ``tests/models/tiny.py``'s ``lora_model``: a tiny Llama in bf16 with peft's fp32 adapters on every
linear layer, no autocast. For each sequence length and batch seed, one forward + backward runs in fp32 (the
reference), eagerly in bf16, through ``torch.compile`` (Inductor) and through ``fuser.optimize``; each line gives the
summed relative distance of the adapter gradients from fp32 as a ratio to eager's, and the worst single gradient's.
The project's bar is Inductor's distance, with no slack.

    python benchmarks/lora_grad_distance.py --seqs 16,24,32 --seeds 1,2,3
    python benchmarks/lora_grad_distance.py --seqs 24 --seeds 2 --without lora_sum   # fuser without one pattern
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src"), str(Path(__file__).resolve().parents[1])]

import fuser  # noqa: E402
from tests.models import tiny  # noqa: E402


def step(model: torch.nn.Module, seq: int, seed: int, compile_with=None) -> dict[str, torch.Tensor]:
    run = model if compile_with is None else compile_with(model)
    run(**tiny.batch(seq=seq, seed=seed)).loss.backward()
    return tiny.grads(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="16,24,32")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--without", default="", help="fuser's default patterns but these, comma-separated")
    args = parser.parse_args()
    torch._dynamo.config.recompile_limit = 64
    left_out = {p for p in args.without.split(",") if p}
    config = fuser.FuserConfig(patterns=tuple(p for p in fuser.DEFAULT_PATTERNS if p not in left_out))
    if left_out:
        print(f"fuser without {', '.join(sorted(left_out))}")
    print("| tokens | seed | Σ Inductor ÷ Σ eager | Σ fuser ÷ Σ eager | Σ fuser ÷ Σ Inductor | worst fuser ÷ eager |")
    print("|---:|---:|---:|---:|---:|---:|")
    for seq in map(int, args.seqs.split(",")):
        for seed in map(int, args.seeds.split(",")):
            model = tiny.lora_model(torch.bfloat16)
            g32 = step(copy.deepcopy(model).float(), seq, seed)
            g16 = step(copy.deepcopy(model), seq, seed)
            gi = step(copy.deepcopy(model), seq, seed, torch.compile)
            gf = step(model, seq, seed, lambda m: fuser.optimize(m, config))
            dist = {k: {n: tiny.rel(g[n], g32[n]) for n in gf} for k, g in (("eager", g16), ("ind", gi), ("fuser", gf))}
            se, si, sf = (sum(dist[k].values()) for k in ("eager", "ind", "fuser"))
            worst = max(dist["fuser"][n] / dist["eager"][n] for n in gf)
            print(f"| {seq} | {seed} | {si / se:.2f} | {sf / se:.2f} | {sf / si:.2f} | {worst:.2f} |", flush=True)
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
