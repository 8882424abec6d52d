"""A whole gated-MLP block inside a compiled model on one GPU: fuser vs Inductor (and eager), with and without LoRA.

The block is Llama's ``down(silu(gate(x)) * up(x))`` at Llama-3-8B sizes (hidden 4096, intermediate 14336),
bf16, on ``--tokens`` tokens. For each of eager, ``torch.compile`` (Inductor) and ``fuser.optimize`` (fuser's
rewrite, then Inductor) it reports:

- forward + backward time: median of ``triton.testing.do_bench(return_mode="median")`` over the plain call
  (matmuls dominate, so the host keeps ahead of the GPU);
- saved-for-backward bytes: the unique storages autograd saves during one forward
  (``torch.autograd.graph.saved_tensors_hooks``), parameters excluded;
- peak memory above the inputs during one forward + backward.

With ``--lora``, peft LoRA (r 16, alpha 32, dropout 0) wraps gate, up and down; base weights are frozen.

    python benchmarks/bench_mlp_block.py --out FILE.md [--tokens 8192]
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
from bench_common import block_step_figures, fused_counts_since
from jobs import LORA, MODELS

LLAMA3_8B = MODELS["llama3-8b"].fields
HIDDEN, INTERMEDIATE = LLAMA3_8B["hidden_size"], LLAMA3_8B["intermediate_size"]


class LlamaMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = torch.nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.up_proj = torch.nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.down_proj = torch.nn.Linear(INTERMEDIATE, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def build(lora: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    block = LlamaMLP().cuda().bfloat16()
    if lora:
        import peft

        targets = ["gate_proj", "up_proj", "down_proj"]
        config = peft.LoraConfig(**{**LORA, "target_modules": targets})
        block = peft.get_peft_model(block, config)
        for name, p in block.named_parameters():  # random B, so the LoRA path is not all zeros
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    return block


def measure(name, fn, x, dout, params):
    def step():
        out = fn(x)
        out.backward(dout)

    ms, saved, peak = block_step_figures(step, lambda: fn(x), [x, *params], params)
    return {"name": name, "ms": ms, "saved": saved, "peak": peak}


def run(tokens: int, lora: bool):
    import fuser

    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    rows = []
    reference = None
    # with LoRA also fuser with its off-by-default lora_sum pattern named
    names = ("eager", "inductor", "fuser", "fuser + lora_sum") if lora else ("eager", "inductor", "fuser")
    for name in names:
        torch._dynamo.reset()
        block = build(lora)
        params = [p for p in block.parameters() if p.requires_grad]
        config = fuser.FuserConfig(patterns=(*fuser.DEFAULT_PATTERNS, "lora_sum")) if "lora_sum" in name else None
        if name == "inductor":
            fn = torch.compile(block)
        elif name.startswith("fuser"):
            fn = fuser.optimize(block, config)
            already = len(fuser.backend(config).results)
        else:
            fn = block
        out = fn(x)
        if reference is None:
            reference = out.detach().float()
        err = ((out.detach().float() - reference).norm() / reference.norm()).item()
        row = measure(name, fn, x, dout, params)
        row["err_vs_eager"] = err
        if name.startswith("fuser"):
            row["counts"] = fused_counts_since(config, already)
        rows.append(row)
        del block, fn, params
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import triton

    lines = [
        "# Gated-MLP block inside a compiled model (Llama-3-8B MLP sizes, bf16)",
        "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- GPU: {torch.cuda.get_device_name()}",
        f"- torch {torch.__version__}, triton {triton.__version__}; tokens {args.tokens}, hidden {HIDDEN}, "
        f"intermediate {INTERMEDIATE}",
        "- time: median fwd+bwd of the plain call (`do_bench`, warmup 25 ms, rep 200 ms); saved: unique storages "
        "autograd saves in one forward, parameters excluded; peak: max allocated above the start of one step",
        "",
        "| block | mode | fwd+bwd ms | saved for backward MiB | peak MiB | rel. diff vs eager | fused |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for lora in (False, True):
        for r in run(args.tokens, lora):
            lines.append(
                f"| {'LoRA r16' if lora else 'full'} | {r['name']} | {r['ms']:.3f} | {r['saved'] / 2**20:.0f} | "
                f"{r['peak'] / 2**20:.0f} | {r['err_vs_eager']:.1e} | {r.get('counts', '')} |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
