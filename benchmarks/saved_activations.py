"""Bytes a training step saves for the backward, per decoder layer and token, as Inductor's partitioner chooses
them (min-cut rematerialisation), for a Llama-3-8B layer with LoRA r16 on all linear layers (bf16 base, peft's
fp32 adapters): torch.compile, fuser without ``upcast_linear``, fuser without its gated-input recompute
(``options={"upcast_linear": {"recompute_gated_input": False}}``), without causal_attention's grouped-query fold
(``{"experimental.causal_attention.gqa_fold": False}``), fuser, fuser with ``rms_norm_linear.lora``; or (``--job
llama32-1b-full``) a Llama-3.2-1B layer under full fine-tuning: torch.compile, fuser without the down projection's
recompute (``options={"gated_mlp": {"recompute_for_down_weight": False}}``), without ``rms_norm_linear`` and the
fold (the defaults before issue 18), without either, fuser. Runs on a CPU (the partition depends on the graph, not
on the device); 1 and 2 layers at batch 2×64, the difference is one layer. Two saved tensors that are views of one
storage count twice (the attention output and o_proj's view of it, since RoPE keeps HF's layout): the H200's peak
is the measure of those.

    python benchmarks/saved_activations.py [--job llama3-8b-lora | llama32-1b-full] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import functools
from collections import Counter

import peft
import torch
from jobs import JOBS, LORA, MODELS
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from transformers import LlamaConfig, LlamaForCausalLM

from fuser.config import FuserConfig
from fuser.engine.rewrite import rewrite
from fuser.patterns import PATTERNS

VIEWS = {"t", "permute", "view", "transpose", "expand", "alias", "_unsafe_view", "reshape", "slice", "unsqueeze"}
BATCH, SEQ = 2, 64


def saved_for_backward(
    fn,
    args: tuple,
    kwargs: dict,
    patterns: list,
    producers: list[str] | None = None,
    config: FuserConfig | None = None,
) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape) of each tensor the forward of ``fn(*args, **kwargs)`` saves for the backward, as Inductor's
    partitioner (min-cut rematerialisation) chooses them after fuser's ``patterns`` rewrote the graph (with the
    options of ``config``, default ``FuserConfig()``); graph inputs
    and views of them (a weight's transpose) hold no memory of their own and are left out. Runs one backward.
    ``producers``, if given, receives the name of the op that made each saved tensor (views looked through)."""
    saved = []

    def forward_compiler(gm, _):
        inputs = {n for n in gm.graph.nodes if n.op == "placeholder"}

        def base(n):
            while isinstance(n, torch.fx.Node) and getattr(n.target, "__name__", "").split(".")[0] in VIEWS:
                n = n.args[0]
            return n

        output = next(n for n in gm.graph.nodes if n.op == "output")
        for node in output.args[0]:
            value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
            if isinstance(value, torch.Tensor) and base(node) not in inputs:
                saved.append((value.dtype, tuple(value.shape)))
                if producers is not None:
                    producers.append(getattr(base(node).target, "__name__", str(base(node).target)))
        return make_boxed_func(gm.forward)

    inner = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                         partition_fn=min_cut_rematerialization_partition)  # fmt: skip

    def backend(gm, example_inputs):
        return inner(rewrite(gm, patterns, config or FuserConfig())[0] if patterns else gm, example_inputs)

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend)(*args, **kwargs)
    (out.loss if hasattr(out, "loss") else out.float().sum()).backward()
    return saved


NO_NORM_LINEAR = "fuser without rms_norm_linear"
NO_GQA = "fuser without causal_attention.gqa_fold"
NEITHER = "fuser without rms_norm_linear and gqa_fold"  # the defaults before 2026-12-02's issue-18 change
WITH_LORA_NORMS = "fuser with rms_norm_linear.lora"
MODES = (
    "compile",
    "fuser without upcast_linear",
    "fuser without the gated-input recompute",
    NO_GQA,
    "fuser",
    WITH_LORA_NORMS,
)
FULL_MODES = ("compile", "fuser without the down-weight recompute", NEITHER, NO_NORM_LINEAR, NO_GQA, "fuser")
# a job of jobs.JOBS → its title; the layers are its checkpoint's widths, the vocabulary a small one
TITLES = {
    "llama3-8b-lora": "Llama-3-8B layer, LoRA r16 on all linear layers",
    "llama32-1b-full": "Llama-3.2-1B layer, full fine-tune",
}
WIDTHS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
VOCAB = 4096


def layer_config(job: str, layers: int) -> LlamaConfig:
    """``layers`` decoder layers of ``job``'s model: its widths, a small vocabulary, LlamaConfig's defaults else."""
    widths = {name: MODELS[JOBS[job].model].fields[name] for name in WIDTHS}
    return LlamaConfig(
        vocab_size=VOCAB, **widths, num_hidden_layers=layers, attn_implementation="sdpa", use_cache=False
    )


@functools.cache
def saved_tensors(mode: str, layers: int, job: str = "llama3-8b-lora") -> list[tuple[str, torch.dtype, tuple]]:
    """(producing op, dtype, shape) of each tensor the forward saves, for ``layers`` layers of ``job`` in ``mode``
    (cached: ``--by-op`` reads the same runs as the table)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(layer_config(job, layers)).to(torch.bfloat16)
    if JOBS[job].method == "lora":
        model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
    model.train()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    names = {name for name, p in PATTERNS.items() if p.default}
    names -= {"rms_norm_linear"} if mode in (NO_NORM_LINEAR, NEITHER) else set()
    names -= {"upcast_linear"} if mode == MODES[1] else set()
    patterns = [p for n, p in PATTERNS.items() if mode != "compile" and n in names]
    fuser_config = FuserConfig(
        patterns=tuple(p.name for p in patterns) if patterns else None,
        upcast_linear={"recompute_gated_input": mode != MODES[2]},
        gated_mlp={"recompute_for_down_weight": mode != FULL_MODES[1]},
        experimental={"causal_attention": {"gqa_fold": mode not in (NO_GQA, NEITHER)}},
        rms_norm_linear={"lora": mode == WITH_LORA_NORMS},
    )
    producers: list[str] = []
    saved = saved_for_backward(model, (), {"input_ids": ids, "labels": ids}, patterns, producers, fuser_config)
    return [(op, dtype, shape) for op, (dtype, shape) in zip(producers, saved, strict=True)]


def saved_bytes(mode: str, layers: int, job: str = "llama3-8b-lora") -> int:
    return sum(torch.Size(shape).numel() * dtype.itemsize for _, dtype, shape in saved_tensors(mode, layers, job))


def saved_by_op(mode: str, job: str) -> list[tuple[str, str, tuple, int, float]]:
    """What one layer saves, tensor by tensor: (producing op, dtype, shape, count, bytes per token), from the
    difference between 2 layers and 1, largest first."""
    one, two = Counter(saved_tensors(mode, 1, job)), Counter(saved_tensors(mode, 2, job))
    rows = []
    for (op, dtype, shape), n in two.items():
        extra = n - one.get((op, dtype, shape), 0)
        if extra:
            per_token = extra * torch.Size(shape).numel() * dtype.itemsize / (BATCH * SEQ)
            rows.append((op, str(dtype).removeprefix("torch."), shape, extra, per_token))
    return sorted(rows, key=lambda r: -r[4])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", default="llama3-8b-lora", choices=sorted(TITLES))
    parser.add_argument("--out")
    parser.add_argument("--by-op", action="store_true", help="also list what one layer saves under fuser, by op")
    args = parser.parse_args()
    title, n_layers = TITLES[args.job], MODELS[JOBS[args.job].model].layers
    adapters = "bf16 base, fp32 adapters" if args.job == "llama3-8b-lora" else "bf16 weights"
    lines = [
        f"# Saved activations per layer and token: {title} (CPU, partitioner only)",
        "",
        f"- command: `python benchmarks/saved_activations.py --job {args.job}{' --by-op' if args.by_op else ''}`; "
        f"date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- torch {torch.__version__}, peft {peft.__version__}; {adapters}; batch {BATCH}×{SEQ};"
        " one layer = (2 layers − 1 layer); graph inputs and their views not counted",
        "",
        f"| mode | bytes / layer / token | at {n_layers} layers × 8192 tokens |",
        "|---|---:|---:|",
    ]
    for mode in MODES if args.job == "llama3-8b-lora" else FULL_MODES:
        per = (saved_bytes(mode, 2, args.job) - saved_bytes(mode, 1, args.job)) / (BATCH * SEQ)
        lines.append(f"| {mode} | {per:,.0f} | {per * n_layers * 8192 / 2**30:.2f} GiB |")
        print(lines[-1], flush=True)
    if args.by_op:
        lines += [
            "",
            f"What one layer saves under fuser (shapes at batch {BATCH}×{SEQ}):",
            "",
            "| producing op | dtype | shape | tensors | bytes / token |",
            "|---|---|---|---:|---:|",
        ]
        for op, dtype, shape, n, per_token in saved_by_op("fuser", args.job):
            lines.append(f"| `{op}` | {dtype} | {list(shape)} | {n} | {per_token:,.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
