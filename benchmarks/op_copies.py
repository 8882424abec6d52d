"""Copies inside fuser's ops in one training step of a tiny model, counted on CPU.

The ops run their Triton path through the interpreter with the kernels themselves not launched (``--no-kernels``):
what is left is the host code around them, whose ``aten::copy_`` calls are the copies the same code makes on a GPU
(e.g. ``as_rows`` copying a strided input into contiguous rows). The reference paths' own casts (CPU only, e.g.
``linear_wide``'s upcast) are listed too, by op. Each copy is listed under the fused op that made it, with its
shape.

    python benchmarks/op_copies.py --model gemma3-4b [--layers 2] [--out report.md]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src"), str(Path(__file__).resolve().parents[1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-4b", help="a key of jobs.MODELS")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import peft
    import torch
    import transformers
    from jobs import LORA, TINY_FIELDS, model_config
    from torch.profiler import ProfilerActivity, profile
    from triton.runtime import interpreter

    import fuser
    from fuser.kernels import _triton as tt

    interpreter.InterpretedFunction.run = lambda self, *a, grid=None, warmup=False, **k: None  # no kernel runs
    torch.set_num_threads(1)
    fields = dict(TINY_FIELDS, use_cache=False, attn_implementation="sdpa", num_hidden_layers=args.layers)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(model_config(args.model, **fields), dtype=torch.float16)
    model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **LORA)).train()
    compiled = fuser.optimize(model)
    ids = torch.randint(0, fields["vocab_size"], (2, 64))
    with tt.triton_on_cpu():
        compiled(input_ids=ids, labels=ids).loss.backward()  # compiles
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            compiled(input_ids=ids, labels=ids).loss.backward()
    counts: collections.Counter = collections.Counter()
    for event in prof.events():
        if event.name != "aten::copy_":
            continue
        chain, parent = [], event.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        op = next((name for name in chain if name.startswith("fuser::")), "(outside fuser's ops)")
        made_by = chain[0] if chain else ""
        shape = tuple(event.input_shapes[0]) if event.input_shapes else ()
        counts[(op, made_by, shape)] += 1
    rows = [f"| `{op}` | `{made_by}` | {list(shape)} | {n} |" for (op, made_by, shape), n in counts.most_common()]
    now = datetime.datetime.now(datetime.UTC)
    text = "\n".join(
        [
            f"Copies in one LoRA training step of a tiny {args.model} ({args.layers} layers, 2×64 tokens, fp16), "
            "fuser's Triton paths on the interpreter, kernels not launched; "
            f"{now:%Y-%m-%d %H:%M} UTC, torch {torch.__version__}",
            "",
            "| fused op | made by | shape | copies |",
            "|---|---|---|---:|",
            *rows,
            f"| all | | | {sum(counts.values())} |",
        ]
    )
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
