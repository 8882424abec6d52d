"""Train a tiny Llama (built from a config, random weights) with fuser and with eager PyTorch, side by side.

    python examples/train_tiny.py                      # CPU or GPU, whichever is there
    python examples/train_tiny.py --arch qwen3 --steps 10 --inner-compiler aot_eager

Prints what fuser fused (``fuser.explain``), then the loss of each step for eager and fuser.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import transformers

import fuser

CONFIGS = {"llama": "LlamaConfig", "qwen3": "Qwen3Config", "gemma": "GemmaConfig", "olmo2": "Olmo2Config"}


def tiny_model(arch: str) -> torch.nn.Module:
    config = getattr(transformers, CONFIGS[arch])(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(CONFIGS), default="llama")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--inner-compiler", choices=["inductor", "aot_eager", "eager"], default="inductor")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model(args.arch).to(device)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 512, (2, args.seq), generator=g).to(device) for _ in range(args.steps)]

    print(fuser.explain(model, input_ids=batches[0], labels=batches[0]))

    eager_model = copy.deepcopy(model)
    fused_model = fuser.optimize(model, fuser.FuserConfig(inner_compiler=args.inner_compiler))
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
    fused_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    print(f"\n{'step':>4} {'eager loss':>12} {'fuser loss':>12} {'rel diff':>10} {'fuser s':>8}")
    for step, ids in enumerate(batches):
        losses = []
        for m, opt in ((eager_model, eager_opt), (fused_model, fused_opt)):
            start = time.perf_counter()
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append((loss.item(), time.perf_counter() - start))
        (le, _), (lf, tf) = losses
        print(f"{step:>4} {le:>12.6f} {lf:>12.6f} {abs(lf - le) / abs(le):>10.2e} {tf:>8.2f}")
    print("\n(the first fuser step includes compilation)")


if __name__ == "__main__":
    main()
