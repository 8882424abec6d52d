"""An RMSNorm and the projections it feeds, inside a compiled model on one GPU: fuser (``rms_norm_linear`` on by
default; with LoRA also with ``rms_norm_linear.lora``) against fuser without ``rms_norm_linear``, Inductor and eager;
full fine-tuning and LoRA (issue 18).

The block is Llama's ``input_layernorm`` → q/k/v (4096 → 4096, 1024, 1024) or ``post_attention_layernorm`` →
gate/up (4096 → 14336, 14336) at Llama-3-8B sizes, bf16, on ``--tokens`` tokens; its input is the residual stream
(it requires a gradient, as in a model). For each mode it reports the forward + backward time (median of
``triton.testing.do_bench`` over the plain call), the bytes autograd saves in one forward (unique storages,
parameters and the input excluded), the peak above the start of one step, and the matmul rate the time implies
(the block's matmul FLOPs over its time: the floor is the FLOPs at the H200's dense bf16 rate).

With LoRA, peft (r 16, alpha 32, dropout 0, random B) wraps every projection and the bases are frozen.

    python benchmarks/bench_rms_norm_linear.py --out FILE.md [--tokens 8192]
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
from bench_common import block_step_figures, fused_counts_since
from jobs import LORA, MODELS

FIELDS = MODELS["llama3-8b"].fields
HIDDEN, INTERMEDIATE = FIELDS["hidden_size"], FIELDS["intermediate_size"]
KV = HIDDEN // FIELDS["num_attention_heads"] * FIELDS["num_key_value_heads"]
BLOCKS = {"q/k/v": (HIDDEN, KV, KV), "gate/up": (INTERMEDIATE, INTERMEDIATE)}
MODES = ("eager", "inductor", "fuser without rms_norm_linear", "fuser", "fuser + rms_norm_linear.lora")


class NormProjections(torch.nn.Module):
    """Llama's RMSNorm and the linears that read its output."""

    def __init__(self, outs: tuple[int, ...], eps: float = 1e-5):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(HIDDEN))
        self.eps = eps
        self.projs = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, n, bias=False) for n in outs)

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * h.to(x.dtype)
        return tuple(p(y) for p in self.projs)


def build(outs: tuple[int, ...], lora: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    block = NormProjections(outs).cuda().bfloat16()
    with torch.no_grad():
        block.weight.add_(0.1 * torch.randn_like(block.weight))
    if lora:
        import peft

        block = peft.get_peft_model(block, peft.LoraConfig(**{**LORA, "target_modules": ["0", "1", "2"]}))
        for name, p in block.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    return block


def run(tokens: int, block_name: str, lora: bool) -> list[dict]:
    import fuser

    outs = BLOCKS[block_name]
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    douts = tuple(torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16) for n in outs)
    rows, reference = [], None
    for mode in MODES:
        if mode.endswith(".lora") and not lora:
            continue
        torch._dynamo.reset()
        block = build(outs, lora)
        params = [p for p in block.parameters() if p.requires_grad]
        config = {
            "fuser without rms_norm_linear": fuser.FuserConfig(
                patterns=tuple(p for p in fuser.DEFAULT_PATTERNS if p != "rms_norm_linear")
            ),
            "fuser + rms_norm_linear.lora": fuser.FuserConfig(rms_norm_linear={"lora": True}),
        }.get(mode)
        if mode == "inductor":
            fn = torch.compile(block)
        elif mode.startswith("fuser"):
            fn = fuser.optimize(block, config)
            already = len(fuser.backend(config).results)
        else:
            fn = block
        out = torch.cat([o.detach().float() for o in fn(x)], -1)
        reference = out if reference is None else reference

        def step(fn=fn, params=params):
            torch.autograd.backward(fn(x), douts)

        ms, saved, peak = block_step_figures(step, lambda fn=fn: fn(x), [x, *params], [*params, x])
        row = {"mode": mode, "ms": ms, "saved": saved, "peak": peak}
        row["err"] = ((out - reference).norm() / reference.norm()).item()
        if mode.startswith("fuser"):
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
        "# RMSNorm + its projections inside a compiled model (Llama-3-8B sizes, bf16)",
        "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- GPU: {torch.cuda.get_device_name()}",
        f"- torch {torch.__version__}, triton {triton.__version__}; tokens {args.tokens}, hidden {HIDDEN}",
        "- time: median fwd+bwd of the plain call (`do_bench`, warmup 25 ms, rep 200 ms); saved: unique storages "
        "autograd saves in one forward, parameters and the input excluded; peak: max allocated above the start of "
        "one step; TFLOP/s: the block's matmul FLOPs (full: 6·tokens·4096·outputs; LoRA: the frozen bases' 4·…, "
        "the adapters' left out) over its time",
        "",
        "| block | mode | fwd+bwd ms | TFLOP/s | saved MiB | peak MiB | rel. diff vs eager | fused |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for lora in (False, True):
        for block_name, outs in BLOCKS.items():
            flops = (4 if lora else 6) * args.tokens * HIDDEN * sum(outs)
            for r in run(args.tokens, block_name, lora):
                lines.append(
                    f"| {block_name}, {'LoRA r16' if lora else 'full'} | {r['mode']} | {r['ms']:.3f} | "
                    f"{flops / r['ms'] / 1e9:.0f} | {r['saved'] / 2**20:.0f} | {r['peak'] / 2**20:.0f} | "
                    f"{r['err']:.1e} | {r.get('counts', '')} |"
                )
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
