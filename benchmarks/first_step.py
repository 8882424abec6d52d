"""Issue 16's first step, taken apart: where a bf16 run's loss after its first AdamW step departs from fp32's.

The convergence table (``convergence.py``) shows fuser's bf16 loss further from fp32's than Inductor's from step 1
on, at lr 1e-4. This script separates the two things a step-1 loss depends on, at a preset's widths, from LoRA's
B = 0 start:

- ``cross``: every run takes one AdamW step; then each run's updated adapters are evaluated under each run's
  forward (rows: whose forward, columns: whose update), as the loss minus fp32's own step-1 loss. A column that
  differs means the update differs; a row that differs means the forward does. Also: the share of B's update
  signs that differ from fp32's.
- ``modules``: fp32's first update (times 1 and 4), applied to one module type's B at a time (q, k, v, o, gate,
  up, down) and to all, and the loss response ``loss(B) − loss(B = 0)`` under each run's forward.

Each forward is the training graph (a backward follows, its gradients dropped). Runs as in ``convergence.py``:
``eager-fp32``, ``eager-bf16``, ``inductor-bf16``, ``fuser-bf16`` and fuser runs with ``:patterns=-name``.

    python benchmarks/first_step.py cross --preset llama3-8b --layers 4 --lr 1e-4,1e-5 \\
        --runs eager-fp32,eager-bf16,inductor-bf16,fuser-bf16,fuser-bf16:patterns=-rms_norm
    python benchmarks/first_step.py modules --preset llama3-8b --layers 4 --lr 1e-4 \\
        --runs eager-fp32,inductor-bf16,fuser-bf16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import convergence as C  # noqa: E402

KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def build(base: torch.nn.Module, run: str, device: torch.device):
    """(model, the callable that runs its training forward, its initial adapters) for ``run``."""
    spec = C.parse_run(run)
    if spec.autocast:
        raise SystemExit(f"first_step: {run} runs under autocast, which this script does not apply")
    model = C.prepare(base, "lora", spec.dtype, device, 0)
    if spec.how == "inductor":
        step = torch.compile(model)
    elif spec.how == "fuser":
        import fuser

        step = fuser.optimize(model, fuser.FuserConfig(patterns=spec.patterns))
    else:
        step = model
    return model, step, {n: p.detach().clone() for n, p in adapters(model).items()}


def load(model: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in adapters(model).items():
            p.copy_(values[n])


def loss_of(model: torch.nn.Module, step, ids: torch.Tensor) -> float:
    """The training forward's loss; the backward runs (as in training) and its gradients are dropped."""
    loss = step(input_ids=ids, labels=ids).loss
    value = loss.item()
    loss.backward()
    for p in adapters(model).values():
        p.grad = None
    return value


def first_update(model: torch.nn.Module, step, ids: torch.Tensor, lr: float) -> tuple[float, dict]:
    """(step-0 loss, the adapters after one fused AdamW step)."""
    opt = torch.optim.AdamW(list(adapters(model).values()), lr=lr, fused=True)
    loss = step(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item(), {n: p.detach().clone() for n, p in adapters(model).items()}


def cross(built: dict, runs: list[str], ids: torch.Tensor, lr: float) -> list[str]:
    ref_run = runs[0]
    loss0, states = {}, {}
    for run in runs:
        model, step, init = built[run]
        load(model, init)
        loss0[run], states[run] = first_update(model, step, ids, lr)
    table = {}
    for f in runs:
        model, step, _ = built[f]
        for s in runs:
            load(model, states[s])
            table[f, s] = loss_of(model, step, ids)
    ref = table[ref_run, ref_run]
    lines = [
        f"lr {lr:g}: step-1 loss − {ref_run}'s own step-1 loss (×1e-3); rows: whose forward, columns: whose update",
        "",
        "| forward \\ update | step-0 loss − fp32's | " + " | ".join(f"`{r}`" for r in runs) + " |",
        "|---|---:|" + "---:|" * len(runs),
    ]
    for f in runs:
        cells = " | ".join(f"{(table[f, s] - ref) * 1e3:+.3f}" for s in runs)
        lines.append(f"| `{f}` | {(loss0[f] - loss0[ref_run]) * 1e3:+.3f} | {cells} |")
    lines.append("")
    for s in runs[1:]:
        flips = total = 0
        for n, v in states[s].items():
            if "lora_B" in n:
                flips += (torch.sign(v) != torch.sign(states[ref_run][n])).sum().item()
                total += v.numel()
        lines.append(f"- `{s}`: B's update sign differs from `{ref_run}`'s in {flips / total:.3%} of elements")
    return lines


def modules(built: dict, runs: list[str], ids: torch.Tensor, lr: float, base: torch.nn.Module, device) -> list[str]:
    ref = C.prepare(base, "lora", torch.float32, device, 0)
    _, update = first_update(ref, ref, ids, lr)
    del ref
    chosen = {"all": None, **{k: {n for n in update if "lora_B" in n and f".{k}." in n} for k in KINDS}}
    lines = []
    for scale in (1.0, 4.0):
        response = {}
        for run in runs:
            model, step, init = built[run]
            load(model, init)
            zero = loss_of(model, step, ids)
            for name, names in chosen.items():
                values = {
                    n: update[n] * scale if "lora_B" in n and (names is None or n in names) else init[n] for n in init
                }
                load(model, values)
                response[run, name] = (loss_of(model, step, ids) - zero) * 1e3
        lines += [
            "",
            f"B = {scale:g} × {runs[0]}'s first AdamW update (lr {lr:g}): loss(B) − loss(B = 0), ×1e-3",
            "",
            "| B of | "
            + " | ".join(f"`{r}`" for r in runs)
            + " | "
            + " | ".join(f"`{r}` − ref" for r in runs[1:])
            + " |",
            "|---|" + "---:|" * (2 * len(runs) - 1),
        ]
        for name in chosen:
            got = [response[r, name] for r in runs]
            lines.append(
                f"| {name} | " + " | ".join(f"{x:+.3f}" for x in got) + " | "
                + " | ".join(f"{x - got[0]:+.3f}" for x in got[1:]) + " |"
            )  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["cross", "modules"])
    parser.add_argument("--preset", default="cpu-small", choices=list(C.PRESETS))
    parser.add_argument("--layers", type=int)
    parser.add_argument("--lr", default="1e-4", help="comma-separated")
    parser.add_argument("--runs", default="eager-fp32,inductor-bf16,fuser-bf16", help="the first is the reference")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    runs = C.split_runs(args.runs)
    preset = C.PRESETS[args.preset]
    base = C.round_parameters(C.build_preset(args.preset, args.layers, args.seed), torch.bfloat16)
    ids = C.fixed_batch(C.MODELS[preset.model].fields["vocab_size"], preset.batch, preset.seq, args.seed).to(device)
    built = {run: build(base, run, device) for run in runs}
    print(f"# first step: {args.preset}, {args.layers or preset.layers} layers, batch {tuple(ids.shape)}, "
          f"{C.versions()}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}")  # fmt: skip
    for lr in (float(x) for x in args.lr.split(",")):
        lines = cross(built, runs, ids, lr) if args.what == "cross" else modules(built, runs, ids, lr, base, device)
        print("\n" + "\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
