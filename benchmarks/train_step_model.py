"""A train_step job's model, built from its config (random weights, nothing downloaded): bf16 weights, sdpa
attention, LoRA/QLoRA/gradient checkpointing as the job says, ``model.train()``; the Liger-Kernel patch, fuser's
config and the batches of random tokens.
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any

import torch
from jobs import LORA, MODELS, TINY_FIELDS, Job, model_config


def job_config(job: Job, args: argparse.Namespace, seq: int):
    """The job's transformers config: sdpa, no KV cache, ``--tiny`` and ``--layers`` applied, room for ``seq``."""
    fields: dict[str, Any] = dict(use_cache=False, attn_implementation="sdpa")
    if args.tiny:
        fields.update(TINY_FIELDS)
    if args.layers is not None:
        fields["num_hidden_layers"] = args.layers
    positions = fields.get("max_position_embeddings", MODELS[job.model].fields["max_position_embeddings"])
    fields["max_position_embeddings"] = max(positions, seq)
    if args.tiny:  # the checkpoint's special tokens (Phi-3's pad 32000) must lie inside the tiny vocabulary
        import transformers

        model = MODELS[job.model]
        defaults = transformers.CONFIG_MAPPING[model.model_type]()
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            token = model.fields.get(key, getattr(defaults, key, None))
            if isinstance(token, int) and token >= fields["vocab_size"]:
                fields[key] = fields["vocab_size"] - 1
    return model_config(job.model, **fields)


def apply_liger(job: Job) -> None:
    """Patch transformers' model classes with Liger-Kernel's ops; must run before the model is built."""
    from liger_kernel import transformers as liger

    model_type = MODELS[job.model].model_type
    patch = getattr(liger, f"apply_liger_kernel_to_{model_type}", None)  # Liger names its patches by model type
    if patch is None:
        raise SystemExit(f"Liger-Kernel has no apply_liger_kernel_to_{model_type}: no liger mode for this job")
    gated = "geglu" if "geglu" in inspect.signature(patch).parameters else "swiglu"  # Gemma's patches take geglu
    patch(rope=True, rms_norm=True, cross_entropy=False, fused_linear_cross_entropy=True, **{gated: True})


def quantize_decoder_linears_nf4(model: torch.nn.Module, device: torch.device, compute_dtype: torch.dtype) -> int:
    """Replace every nn.Linear of the decoder layers by ``bnb.nn.Linear4bit`` (NF4) holding its weights, quantised."""
    import bitsandbytes as bnb

    replaced = 0
    for layer in model.model.layers:
        for name, linear in list(layer.named_modules()):
            if type(linear) is not torch.nn.Linear:
                continue
            quantized = bnb.nn.Linear4bit(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                compute_dtype=compute_dtype,
                quant_type="nf4",
                device="meta",  # no throw-away init: the weights come from `linear`
            )
            weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4", module=quantized)
            quantized.weight = weight.to(device)  # Params4bit quantises on its first move to a device
            if linear.bias is not None:
                quantized.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
            parent_name, _, child = name.rpartition(".")
            setattr(layer.get_submodule(parent_name) if parent_name else layer, child, quantized)
            replaced += 1
    return replaced


def build_model(job: Job, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, seq: int):
    """The job's model on ``device``: random weights, LoRA/QLoRA/checkpointing applied, in training mode."""
    import transformers

    config = job_config(job, args, seq)
    torch.manual_seed(args.seed)
    with torch.device(device):  # initialise on the device: an 8B model's random init on the CPU takes minutes
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if job.method == "qlora":
        quantize_decoder_linears_nf4(model, device, dtype)
        model.is_loaded_in_4bit = True  # as transformers marks a bitsandbytes load: peft then wraps with its Linear4bit
        torch.cuda.empty_cache()
    if job.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if job.method in ("lora", "qlora"):
        import peft

        torch.manual_seed(args.seed + 1)
        model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
    model.train()
    return model


def fuser_options(pairs: list[str]) -> dict[str, Any]:
    """``--fuser-option`` values (``experimental.upcast_linear.triton=false``, ``keep_logits=true``) as the dict that
    ``torch.compile(..., backend="fuser", options=...)`` takes, names as given (it reads dotted ones as nested):
    ``true`` and ``false`` are booleans, anything else a string."""
    options: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep:
            raise SystemExit(
                f"--fuser-option takes NAME=VALUE (e.g. experimental.upcast_linear.triton=false), got {pair!r}"
            )
        options[name] = {"true": True, "false": False}.get(text.lower(), text)
    return options


def fuser_config(args: argparse.Namespace):
    """fuser's config for this run: the inner compiler, the patterns ``--fuser-patterns`` names (a leading ``+``
    adds them to the default ones, a leading ``-`` takes them out), and the options
    ``--fuser-option`` sets, by name as a trainer's ``options=`` sets them."""
    import fuser

    patterns = None
    if args.fuser_patterns:
        names = tuple(n for n in args.fuser_patterns.lstrip("+-").split(",") if n)
        if args.fuser_patterns.startswith("+"):
            patterns = (*fuser.DEFAULT_PATTERNS, *names)
        elif args.fuser_patterns.startswith("-"):
            patterns = tuple(p for p in fuser.DEFAULT_PATTERNS if p not in names)
        else:
            patterns = names
    options = {**fuser_options(args.fuser_option), "patterns": patterns, "inner_compiler": args.fuser_inner_compiler}
    return fuser.FuserConfig.from_options(options)


def make_batches(n: int, batch: int, seq: int, vocab: int, seed: int, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(n)]
