"""Whole-step error under CPU bf16 autocast (fp32 weights) at tiny width: eager, Inductor and fuser against an fp64
run of the same model, per seed (results: ``autocast_step_error_spread_cpu_2026-12-06.md``).

    PYTHONPATH=src python3 benchmarks/autocast_error_spread.py [seeds]
"""

from __future__ import annotations

import copy
import sys

import torch

import fuser
from tests.models.tiny import batch, build_rope_arch, grads, rel

MODES = {
    "Inductor": lambda m: torch.compile(m),
    "fuser": lambda m: fuser.optimize(m, fuser.FuserConfig(inner_compiler="aot_eager")),
    "fuser, swiglu only": lambda m: fuser.optimize(
        m, fuser.FuserConfig(inner_compiler="aot_eager", patterns=("swiglu",))
    ),
    "fuser, rope only": lambda m: fuser.optimize(m, fuser.FuserConfig(inner_compiler="aot_eager", patterns=("rope",))),
}


def step(model, data, autocast=True):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(**data)
    out.loss.backward()
    return out.loss.detach()


def grads_error(g, g64):
    """All parameters' gradients as one vector: ‖g − g64‖ / ‖g64‖."""
    num = sum((g[n].double() - g64[n]).norm() ** 2 for n in g64) ** 0.5
    return (num / sum(g64[n].norm() ** 2 for n in g64) ** 0.5).item()


def main(seeds: int = 6) -> None:
    print("| model | mode | loss error ÷ eager's, per seed | gradient error ÷ eager's, per seed |")
    print("|---|---|---|---|")
    for arch in ("llama", "qwen3"):
        rows = {name: [] for name in MODES}
        for seed in range(seeds):
            base, data = build_rope_arch(arch, seed), batch(seed=seed + 1)
            ref = copy.deepcopy(base).double()
            loss64 = step(ref, data, autocast=False)
            g64 = grads(ref)
            eager = copy.deepcopy(base)
            eager_loss, eager_grads = rel(step(eager, data), loss64), grads_error(grads(eager), g64)
            for name, wrap in MODES.items():
                torch._dynamo.reset()
                model = copy.deepcopy(base)
                loss = step(wrap(model), data)  # the wrapper shares the model's parameters: their .grad is set
                rows[name].append((rel(loss, loss64) / eager_loss, grads_error(grads(model), g64) / eager_grads))
        for name, r in rows.items():
            losses = " ".join(f"{a:.3f}" for a, _ in r)
            gradients = " ".join(f"{b:.3f}" for _, b in r)
            print(f"| {arch} | {name} | {losses} | {gradients} |", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
