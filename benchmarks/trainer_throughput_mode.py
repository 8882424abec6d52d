"""One mode of trainer_throughput.py, in this process: the model (random weights from jobs.py's config; for
``unsloth``, Unsloth's loader over a saved copy of them), rows of random tokens padded by a real collator, a
``transformers.Trainer`` or TRL's ``SFTTrainer`` as users set them up, and the numbers of its run.

Unsloth patches transformers, peft and TRL when it is imported, so nothing here imports them at module level:
the ``unsloth`` mode imports Unsloth first.

``--deepspeed NAME`` hands the trainer one of :data:`DEEPSPEED`'s ZeRO configs (:func:`deepspeed_config`), as
``TrainingArguments(deepspeed=...)``; this one process names itself rank 0 of 1 where no launcher did.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shutil
import socket
import tempfile
import time
from typing import Any

import torch
from jobs import LORA, MODELS, TINY_FIELDS, model_config
from train_step_model import fuser_options

PAD_TO_MULTIPLE_OF = 64
LEARNING_RATE = {"lora": 1e-4, "full": 1e-5}
# LoRA trains adapters over a bf16 base; full fine-tuning keeps fp32 master weights under bf16 autocast
MODEL_DTYPE = {"lora": torch.bfloat16, "full": torch.float32}
# --deepspeed: ZeRO-2 with the optimizer's state offloaded to the CPU; ZeRO-3 with the parameters offloaded too
DEEPSPEED = ("zero2-offload", "zero3-offload")
# --deepspeed-optimizer: DeepSpeed's C++ CPU Adam from the config's "optimizer" section (JIT-built with g++ on first
# use), or the Trainer's own torch optimizer stepping the offloaded fp32 partitions
DEEPSPEED_OPTIMIZERS = ("cpu_adam", "torch")


@dataclasses.dataclass(frozen=True)
class Lengths:
    """Tokens per row: every integer in [low, high] equally likely (low == high: a fixed length)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> Lengths:
        kind, _, spec = text.partition(":")
        try:
            if kind == "fixed":
                return cls(int(spec), int(spec))
            if kind == "uniform":
                low, high = (int(n) for n in spec.split("-"))
                if 0 < low <= high:
                    return cls(low, high)
        except ValueError:
            pass
        raise ValueError(f"--lengths takes fixed:N or uniform:LOW-HIGH (e.g. uniform:512-2048), got {text!r}")

    def __str__(self) -> str:
        return f"fixed:{self.low}" if self.low == self.high else f"uniform:{self.low}-{self.high}"

    def describe(self, seed: int) -> str:
        if self.low == self.high:
            return f"every row {self.low} tokens"
        return f"row lengths uniform over the integers {self.low}–{self.high} (seed {seed})"

    def draw(self, rows: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randint(self.low, self.high) for _ in range(rows)]


def build_config(args: argparse.Namespace, lengths: Lengths):
    """The model's transformers config as a checkpoint's ``from_pretrained`` gives it (``use_cache`` and all), sdpa
    attention, ``--tiny`` and ``--layers`` applied. With ``--packing``, ``use_cache=False``: with a cache (the
    config's default, also in training) transformers builds one causal mask over the packed row, and its rows attend
    to each other; without one it builds the block-diagonal mask from where ``position_ids`` restart."""
    fields: dict[str, Any] = dict(attn_implementation="sdpa")
    if args.packing:
        fields["use_cache"] = False
    if args.tiny:
        fields.update(TINY_FIELDS)
    if args.layers is not None:
        fields["num_hidden_layers"] = args.layers
    positions = fields.get("max_position_embeddings", MODELS[args.model].fields["max_position_embeddings"])
    fields["max_position_embeddings"] = max(positions, lengths.high + PAD_TO_MULTIPLE_OF)
    config = model_config(args.model, **fields)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # --tiny: special tokens inside the vocabulary
        token = getattr(config, key, None)
        if isinstance(token, int) and token >= config.vocab_size:
            setattr(config, key, config.vocab_size - 1)
    return config


def deepspeed_config(name: str, optimizer: str) -> dict[str, Any]:
    """The DeepSpeed config that ``--deepspeed NAME`` gives the trainer: transformers' documented ZeRO-2 / ZeRO-3
    offload configs (offloaded state in pinned host memory, communication overlapped with the backward), every
    ``"auto"`` filled in by the trainer from its TrainingArguments (bf16, batch, accumulation, clipping, AdamW's lr,
    betas, eps and weight decay; ZeRO-3's bucket sizes from the hidden size).

    ``optimizer`` ``cpu_adam``: an ``"optimizer"`` section (AdamW), so DeepSpeed steps the offloaded fp32 master
    weights with its C++ ``DeepSpeedCPUAdam`` (ZeRO-Offload's optimizer, as a user with offload would run it); the
    trainer's ``optim`` is then unused. ``torch``: no such section, the trainer's torch optimizer steps the offloaded
    partitions on the CPU, which DeepSpeed refuses unless ``zero_force_ds_cpu_optimizer`` is off."""
    offload = {"device": "cpu", "pin_memory": True}
    zero: dict[str, Any] = {"offload_optimizer": offload, "overlap_comm": True, "contiguous_gradients": True}
    if name == "zero2-offload":
        zero = {"stage": 2, **zero, "reduce_bucket_size": "auto"}
    elif name == "zero3-offload":
        zero = {
            "stage": 3,
            **zero,
            "offload_param": offload,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        }
    else:
        raise ValueError(f"--deepspeed takes one of {list(DEEPSPEED)}, got {name!r}")
    config: dict[str, Any] = {
        "bf16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
    }
    if optimizer == "cpu_adam":
        params = {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}
        config["optimizer"] = {"type": "AdamW", "params": params}
    elif optimizer == "torch":
        config["zero_force_ds_cpu_optimizer"] = False
    else:
        raise ValueError(f"--deepspeed-optimizer takes one of {list(DEEPSPEED_OPTIMIZERS)}, got {optimizer!r}")
    return config


def single_process_distributed_env() -> None:
    """The variables ``torch.distributed`` reads, for a DeepSpeed run in this one process started without a
    launcher (the trainer initialises a process group for DeepSpeed): rank 0 of 1 on a free local port. Those a
    launcher set are kept."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)


def pad_token_id(config) -> int:
    """The checkpoint's pad token where it has one (Gemma's 0), else the last id (Llama 3 has none)."""
    pad = getattr(config, "pad_token_id", None)
    return pad if isinstance(pad, int) else config.vocab_size - 1


def make_tokenizer(config):
    """A word-level tokenizer over the model's whole vocabulary (``t0`` … ``t<V-1>``), built in memory: the
    collators pad with its pad token, SFTTrainer takes it as ``processing_class``, Unsloth loads it from disk."""
    import transformers
    from tokenizers import Tokenizer, models

    pad = pad_token_id(config)
    eos = config.eos_token_id if isinstance(config.eos_token_id, int) else pad
    bos = config.bos_token_id if isinstance(config.bos_token_id, int) else eos
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=f"t{pad}"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=f"t{pad}", eos_token=f"t{eos}", bos_token=f"t{bos}", unk_token=f"t{pad}"
    )


def token_rows(lengths: Lengths, rows: int, vocab: int, pad: int, seed: int) -> list[list[int]]:
    """``rows`` rows of random token ids of the lengths ``lengths`` draws, none of them the pad token."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths.draw(rows, seed):
        ids = torch.randint(0, vocab - 1, (n,), generator=g)
        out.append((ids + (ids >= pad).long()).tolist())  # skip the pad id: the collators mask it out of the loss
    return out


class TokenRows(torch.utils.data.Dataset):
    """Unpadded rows of ``input_ids``, as a tokenised dataset holds them; the collator pads each batch."""

    def __init__(self, rows: list[list[int]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.rows[i]}


class CountTokens:
    """Wraps a trainer's collator: the real (attended) and padded token count of every batch, in order."""

    def __init__(self, collate, pad: int) -> None:
        self.collate, self.pad = collate, pad
        self.real: list[int] = []
        self.padded: list[int] = []

    def __call__(self, features):
        batch = self.collate(features)
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        self.real.append(int(mask.sum()) if mask is not None else int((ids != self.pad).sum()))
        self.padded.append(ids.numel())
        return batch


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_clock(peak_from_first_step: bool = False):
    """A callback that records when the first step began and when every step ended (after a device sync); with
    ``peak_from_first_step``, the device's peak memory counts from the first step's start."""
    import transformers

    class StepClock(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.start: float | None = None
            self.ends: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            if self.start is None:
                synchronize()
                if peak_from_first_step and torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize()
            self.ends.append(time.perf_counter())

    return StepClock()


def checkpointing_args(enabled: bool | None, training_args_class) -> dict[str, Any]:
    """Gradient checkpointing (non-reentrant) as TrainingArguments fields; none where ``enabled`` is None (the
    trainer's default). transformers 5.25 renamed the field ``activation_checkpointing`` (the old name warns)."""
    if enabled is None:
        return {}
    fields = {f.name for f in dataclasses.fields(training_args_class)}
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    kwargs = {f"{name}_kwargs": {"use_reentrant": False}} if enabled else {}
    return {name: enabled, **kwargs}


def random_model(config, dtype: torch.dtype, device: torch.device, seed: int):
    import transformers

    torch.manual_seed(seed)
    with torch.device(device):  # random init on the GPU: seconds instead of minutes on the host
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def build_model(args: argparse.Namespace, config, device: torch.device):
    """Random weights on ``device``: a bf16 base with peft's LoRA (fp32 adapters, peft's default) or, for full
    fine-tuning, fp32 weights (the master copy; ``bf16=True`` autocasts the forward)."""
    import peft

    model = random_model(config, MODEL_DTYPE[args.method], device, args.seed)
    if args.method == "lora":
        model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
    return model


def checkpointing_default(args: argparse.Namespace) -> bool:
    """Whether the trainer will checkpoint: ``--gradient-checkpointing``, else the trainer's default."""
    if args.gradient_checkpointing is not None or args.trainer != "sft":
        return bool(args.gradient_checkpointing)
    import trl

    defaults = {f.name: f.default for f in dataclasses.fields(trl.SFTConfig)}
    return bool(defaults.get("activation_checkpointing") or defaults.get("gradient_checkpointing"))


def build_unsloth_model(args: argparse.Namespace, config, tokenizer, device: torch.device, max_length: int):
    """Unsloth's loader over a directory holding the same random weights (``save_pretrained``), then its
    ``get_peft_model`` with the LoRA recipe; its own gradient checkpointing (``"unsloth"``) where the trainer's
    is on."""
    from unsloth import FastLanguageModel

    dtype = MODEL_DTYPE[args.method]
    local = tempfile.mkdtemp(prefix="trainer_throughput_unsloth_")
    model = random_model(config, dtype, device, args.seed)
    model.save_pretrained(local)
    tokenizer.save_pretrained(local)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    checkpointing = "unsloth" if checkpointing_default(args) else False
    try:
        model, _ = FastLanguageModel.from_pretrained(
            local,
            max_seq_length=max_length,
            dtype=dtype,
            load_in_4bit=False,
            full_finetuning=args.method == "full",
            use_gradient_checkpointing=checkpointing,
            local_files_only=True,
        )
    finally:
        shutil.rmtree(local, ignore_errors=True)  # an 8B model's copy is 16 GB of the machine's disk
    if args.method == "lora":
        model = FastLanguageModel.get_peft_model(
            model, **LORA, use_gradient_checkpointing=checkpointing, random_state=args.seed
        )
    return model


def make_trainer(args: argparse.Namespace, model, tokenizer, rows: list[list[int]], out_dir: str, callbacks):
    import transformers

    max_length = max(len(r) for r in rows)
    common = dict(
        output_dir=out_dir,
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=LEARNING_RATE[args.method],
        bf16=True,
        optim="adamw_torch_fused",
        torch_compile=args.mode == "torch_compile",
        use_liger_kernel=args.mode == "liger",
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
    )
    if args.deepspeed:
        common["deepspeed"] = deepspeed_config(args.deepspeed, args.deepspeed_optimizer)
    if args.trainer == "sft":
        import datasets
        import trl

        sft_args = trl.SFTConfig(
            **common,
            **checkpointing_args(args.gradient_checkpointing, trl.SFTConfig),  # none given: TRL's default (on)
            max_length=max_length,  # its default (1024) would cut the rows
            **({"padding_free": True} if args.packing else {"pad_to_multiple_of": PAD_TO_MULTIPLE_OF}),
        )
        dataset = datasets.Dataset.from_dict({"input_ids": rows})
        return trl.SFTTrainer(
            model=model, args=sft_args, train_dataset=dataset, processing_class=tokenizer, callbacks=callbacks
        )
    checkpointing = checkpointing_args(bool(args.gradient_checkpointing), transformers.TrainingArguments)
    training_args = transformers.TrainingArguments(**common, **checkpointing)
    # labels: input_ids with -100 at the pads; attention_mask: 0 at the pads
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False, pad_to_multiple_of=PAD_TO_MULTIPLE_OF)
    if args.packing:
        # one row of the batch's tokens, position_ids restarting at each row, labels -100 at each row's first token
        collator = transformers.DataCollatorWithFlattening()
    return transformers.Trainer(
        model=model, args=training_args, train_dataset=TokenRows(rows), data_collator=collator, callbacks=callbacks
    )


def deepspeed_engine(trainer) -> dict[str, Any]:
    """What DeepSpeed ran: its engine's ZeRO stage, what it offloaded, and the optimizer class that stepped."""
    engine = trainer.model_wrapped
    if type(engine).__name__ != "DeepSpeedEngine":
        raise RuntimeError(f"--deepspeed: the trainer ran {type(engine).__name__}, not a DeepSpeedEngine")

    def device(offload) -> str:  # an offload section's device ("cpu", "nvme", "none"); "none" where there is none
        where = getattr(offload, "device", "none")
        return str(getattr(where, "value", where))  # an enum member, or its value where the config stores values

    return {
        "zero_stage": engine.zero_optimization_stage(),
        "offload_optimizer": device(engine.zero_offload_optimizer()),
        "offload_param": device(engine.zero_offload_param()),
        "optimizer_class": type(engine.basic_optimizer).__name__,
    }


def checkpointing_on(trainer) -> bool:
    args = trainer.args
    return bool(getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False))


def run_mode(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Build, train ``--steps`` steps, and fill ``result`` in (status ``ok``); an exception propagates."""
    began = time.perf_counter()
    if args.deepspeed:
        single_process_distributed_env()
    if args.mode == "unsloth":
        os.environ["HF_HUB_OFFLINE"] = "1"
        import unsloth  # noqa: F401  (first: it patches transformers, peft and TRL on import)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lengths = Lengths.parse(args.lengths)
    config = build_config(args, lengths)
    pad = pad_token_id(config)
    tokenizer = make_tokenizer(config)
    rows = token_rows(lengths, args.batch * args.steps, config.vocab_size, pad, args.seed)
    result["phase"] = "build"
    if args.mode == "unsloth":
        model = build_unsloth_model(args, config, tokenizer, device, lengths.high + PAD_TO_MULTIPLE_OF)
    else:
        model = build_model(args, config, device)
    result["layers"] = config.num_hidden_layers
    result["params"] = sum(p.numel() for p in model.parameters())
    result["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # DeepSpeed partitions (ZeRO-3: offloads) the model when the trainer starts: its peak counts from the first step
    clock = step_clock(peak_from_first_step=bool(args.deepspeed))
    callbacks = [clock]
    options = fuser_options(args.fuser_option)
    if args.input_require_grads:
        # the embeddings' output requires a gradient, so every decoder layer's input does (see trainer_throughput.py)
        model.enable_input_require_grads()
        options.setdefault("ignore_input_require_grads", False)  # fuser keeps that hook in its traces
    if args.mode == "fuser":
        import fuser

        fuser.optimize_(model, config=options or None)
        callbacks.append(fuser.FuserCallback())
    with tempfile.TemporaryDirectory(prefix="trainer_throughput_") as out_dir:
        trainer = make_trainer(args, model, tokenizer, rows, out_dir, callbacks)
        counter = CountTokens(trainer.data_collator, pad)
        trainer.data_collator = counter
        result["gradient_checkpointing"] = checkpointing_on(trainer)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        result["setup_s"] = time.perf_counter() - began
        result["phase"] = "train"
        trainer.train()
    result["phase"] = "done"
    # the collator runs once per step, in step order (the data loader may fetch one batch ahead)
    steps = len(clock.ends)
    bounds = [clock.start, *clock.ends]
    warmup = min(args.warmup, steps - 1)
    real = sum(counter.real[warmup:steps])
    result.update(
        status="ok",
        steps_run=steps,
        tokens_per_s=real / (bounds[-1] - bounds[warmup]),
        first_step_s=clock.ends[0] - clock.start,
        real_tokens=counter.real[:steps],
        padded_tokens=counter.padded[:steps],
        losses=[float(e["loss"]) for e in trainer.state.log_history if "loss" in e],
    )
    if args.deepspeed:
        result.update(deepspeed_engine(trainer))
    if torch.cuda.is_available():
        result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if args.mode == "fuser":
        import fuser

        report = fuser.report(model)
        result.update(
            fuser_counts=dict(report.counts),
            fuser_recompiles=report.recompiles,
            fuser_graphs=report.graphs,
            fuser_graph_breaks=report.graph_breaks,
            fuser_inlined=dict(report.inlined),
            fuser_not_inlined=dict(report.not_inlined),
        )
