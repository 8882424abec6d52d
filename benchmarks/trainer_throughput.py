"""Tokens/s of a real ``transformers.Trainer`` run: no compile, ``torch_compile=True`` and ``fuser.optimize_``.

A Llama-3-8B-shaped model cut to a few layers (random weights, bf16 base), peft LoRA r16 on every linear
layer, ``Trainer(bf16=True)``, fixed-length random tokens. Each mode runs in its own process (``--all-modes``);
the table reports the steady tokens/s (steps after the first ``--warmup``), the first step's time (compile),
peak memory, and what fuser fused.

    python benchmarks/trainer_throughput.py --all-modes --out benchmarks/results/trainer_h200.md
    python benchmarks/trainer_throughput.py --mode fuser --layers 2 --steps 6     # one mode, printed as JSON
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
from jobs import LORA, model_config

MODES = ("none", "torch_compile", "fuser")
# Llama-3-8B, but with LlamaConfig's default rms_norm_eps (1e-6, not the checkpoint's 1e-5) and use_cache (True), as
# results/trainer_llama3-8b_lora_h200_2026-12-01.md was measured
FIELDS = dict(rms_norm_eps=1e-6, attn_implementation="sdpa")


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, rows: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (rows, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i], "attention_mask": torch.ones_like(self.ids[i])}


def run_mode(mode: str, layers: int, steps: int, batch: int, seq: int, warmup: int, out_dir: str) -> dict:
    import peft
    import transformers

    class StepTimes(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.start = 0.0

        def on_step_begin(self, args, state, control, **kw):
            if not self.start:
                torch.cuda.synchronize()
                self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

    config = model_config("llama3-8b", num_hidden_layers=layers, **FIELDS)
    torch.manual_seed(0)
    with torch.device("cuda"):  # random init on the GPU: seconds instead of a minute on the host
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    callbacks = [StepTimes()]
    if mode == "fuser":
        import fuser

        fuser.optimize_(model)
        callbacks.append(fuser.FuserCallback())
    args = transformers.TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=batch,
        max_steps=steps,
        learning_rate=1e-4,
        bf16=True,
        torch_compile=mode == "torch_compile",
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        optim="adamw_torch_fused",
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=RandomTokens(batch * steps, seq, config.vocab_size),
        callbacks=callbacks,
    )
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    times = callbacks[0]
    steady = times.ends[warmup:]
    per_step = (steady[-1] - times.ends[warmup - 1]) / len(steady) if len(steady) >= 1 else float("nan")
    result = {
        "mode": mode,
        "tokens_per_s": batch * seq / per_step,
        "first_step_s": times.ends[0] - times.start,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "losses": [float(e["loss"]) for e in trainer.state.log_history if "loss" in e],
    }
    if mode == "fuser":
        import fuser

        result["fused"] = fuser.report(model).counts
    return result


def versions() -> str:
    names = ("torch", "transformers", "peft", "accelerate", "triton")
    out = []
    for name in names:
        try:
            out.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=MODES)
    parser.add_argument("--all-modes", action="store_true")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    shape = ["--layers", str(args.layers), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    shape += ["--batch", str(args.batch), "--seq", str(args.seq)]
    if not args.all_modes:
        result = run_mode(args.mode, args.layers, args.steps, args.batch, args.seq, args.warmup, "/tmp/trainer_bench")
        print("RESULT " + json.dumps(result))
        return
    results = []
    for mode in MODES:
        proc = subprocess.run(
            [sys.executable, __file__, "--mode", mode, *shape], capture_output=True, text=True, check=False
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            results.append({"mode": mode, "error": " | ".join(tail)})
        else:
            results.append(json.loads(lines[-1][len("RESULT ") :]))
    base = next((r["tokens_per_s"] for r in results if r["mode"] == "torch_compile" and "error" not in r), None)
    rows = [
        f"# Trainer throughput: Llama-3-8B shapes, {args.layers} layers, LoRA r16 all-linear, Trainer(bf16=True)",
        "",
        f"Command: `python benchmarks/trainer_throughput.py --all-modes {shlex.join(shape)}`  ",
        f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC  ",
        f"GPU: {torch.cuda.get_device_name()}  ",
        f"Versions: {versions()}  ",
        f"Batch {args.batch}×{args.seq} tokens, {args.steps} steps, tokens/s over the steps after the first "
        f"{args.warmup}; each mode in its own process.",
        "",
        "| mode | tokens/s | ÷ torch_compile | first step s | peak GiB | losses (first, last) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['mode']} | error: {r['error']} | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / base:.2f}" if base else "–"
        losses = f"{r['losses'][0]:.4f}, {r['losses'][-1]:.4f}" if r["losses"] else ""
        rows.append(
            f"| {r['mode']} | {r['tokens_per_s']:,.0f} | {ratio} | {r['first_step_s']:.1f} | {r['peak_gib']:.1f} "
            f"| {losses} |"
        )
    fused = next((r.get("fused") for r in results if r.get("fused")), None)
    rows += ["", f"fuser fused: {fused}"]
    text = "\n".join(rows)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
