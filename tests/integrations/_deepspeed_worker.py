"""What each process of ``test_deepspeed.py`` runs, under ``torch.distributed.run -m`` (2 processes, CPU, gloo): a
real ``transformers.Trainer(deepspeed={...}, use_cpu=True)`` on a tiny Llama and a tiny Qwen3, under ZeRO-2 and
ZeRO-3, once without fuser and once after ``fuser.optimize_(model)`` (the README's line, nothing else). Rank 0 saves,
per scenario and run: the logged losses, fuser's report (counts, graphs, graph breaks) and the trained parameters,
gathered whole under ZeRO-3.

ZeRO-2 scenarios run first: ``deepspeed.initialize`` at stage 3 replaces ``torch.nn.functional.linear`` for the rest
of the process (DeepSpeed's ``memory_efficient_linear``), and a ZeRO-2 run should see the plain one.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

from tests.integrations._distributed_worker import VOCAB

# the ZeRO-3 scenarios also offload the optimizer to the CPU and accumulate gradients over two micro-batches
SCENARIOS = ["llama_zero2", "qwen3_zero2", "llama_zero3", "qwen3_zero3"]
STEPS, ACCUMULATE = 2, 2


def tiny(arch: str) -> torch.nn.Module:
    """The same random-weight 2-layer model in every process (fixed seed), fp32, norm weights randomised; Qwen3's
    lm_head tied to its embedding."""
    import transformers
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    # the previous run's TrainingArguments(deepspeed=...) left its ZeRO-3 config set globally: a model built then
    # would be initialised partitioned (deepspeed.zero.Init), with other random weights
    unset_hf_deepspeed_config()
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    config = config_class(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=arch == "qwen3",  # as the small Qwen3 models: the loss's weight is the embedding's
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return model.train()


def dataset():
    import datasets

    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, VOCAB, (16,), generator=g).tolist()} for _ in range(16)]
    return datasets.Dataset.from_list([{**row, "labels": list(row["input_ids"])} for row in rows])


def deepspeed_config(stage: int) -> dict:
    zero: dict = {"stage": stage}
    if stage == 3:
        zero["offload_optimizer"] = {"device": "cpu"}
        # every parameter partitioned and released as soon as DeepSpeed may: by default it keeps parameters under
        # 100k elements whole (all of a tiny model's) and keeps those it will reuse soon gathered
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
        zero["stage3_max_live_parameters"] = 0
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": zero,
        # the Trainer's torch SGD on the offloaded partitions (DeepSpeed's CPU Adam would be a compiled extension)
        "zero_force_ds_cpu_optimizer": False,
    }


def whole_parameters(model: torch.nn.Module, stage: int) -> dict[str, torch.Tensor]:
    """Every parameter, whole: under ZeRO-3 gathered from the partitions (collective: every rank calls it)."""
    import deepspeed

    gathered = deepspeed.zero.GatheredParameters(list(model.parameters())) if stage == 3 else contextlib.nullcontext()
    with gathered:
        return {name: p.detach().clone() for name, p in model.named_parameters()}


@contextlib.contextmanager
def peak_gathered(model: torch.nn.Module) -> Iterator[list[int]]:
    """The most parameter elements whole at once on this rank (a partitioned parameter holds none), read after each
    module's ZeRO-3 gather, into the list yielded."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    peak = [0]
    fetch = PartitionedParameterCoordinator.fetch_sub_module

    def fetch_and_count(self, *args, **kwargs):
        out = fetch(self, *args, **kwargs)
        peak[0] = max(peak[0], sum(p.data.numel() for p in model.parameters()))
        return out

    PartitionedParameterCoordinator.fetch_sub_module = fetch_and_count
    try:
        yield peak
    finally:
        PartitionedParameterCoordinator.fetch_sub_module = fetch


def train(scenario: str, with_fuser: bool, out_dir: str) -> dict:
    import torch._dynamo
    import transformers

    import fuser
    import fuser.dynamo_backend

    torch._dynamo.reset()
    fuser.dynamo_backend._BACKENDS.clear()
    arch, stage = scenario.split("_")[0], int(scenario[-1])
    model = tiny(arch)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = fuser.FuserConfig(inner_compiler="aot_eager", strict=True)
    if with_fuser:
        fuser.optimize_(model, config)
    args = transformers.TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS,
        optim="sgd",  # an update is lr × gradient: the gradients' tolerance holds for it (Adam amplifies noise)
        learning_rate=0.1,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        dataloader_num_workers=0,
        seed=0,
        deepspeed=deepspeed_config(stage),
    )
    callbacks = [fuser.FuserCallback()] if with_fuser else []
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(), callbacks=callbacks)
    with peak_gathered(model) as peak:
        trainer.train()
    report = fuser.report(model) if with_fuser else None
    return {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "wrapper": type(trainer.model_wrapped).__name__,
        "counts": dict(report.counts) if report else {},
        "graphs": report.graphs if report else 0,
        "graph_breaks": len(report.breaks) if report else 0,
        "params": whole_parameters(trainer.model, stage),
        "peak_gathered": peak[0],
        "numel": {
            "model": sum(initial[name].numel() for name in initial),
            "layer": sum(p.numel() for name, p in initial.items() if name.startswith("model.layers.0.")),
            "embedding": initial["model.embed_tokens.weight"].numel(),
            "lm_head": 0 if "lm_head.weight" not in initial else initial["lm_head.weight"].numel(),
        },
        "initial": initial,
    }


def main(out_path: str) -> None:
    import deepspeed.comm.torch
    import torch.distributed as dist
    import transformers

    # DeepSpeed compiles a C++ shared-memory all-reduce for CPU on its first use (g++, minutes on two busy cores);
    # only its tensor-parallel inference calls it, never ZeRO training, which uses gloo: not built here
    deepspeed.comm.torch.build_shm_op = lambda: None
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    results = {}
    for scenario in SCENARIOS:
        results[scenario] = {
            "eager": train(scenario, False, f"{out_path}.{scenario}.eager"),
            "fuser": train(scenario, True, f"{out_path}.{scenario}.fuser"),
        }
    if dist.get_rank() == 0:
        torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
