"""fuser inside the trainers people use: transformers.Trainer and TRL's SFTTrainer, with the documented line
``fuser.optimize_(model)``, in fp32 and under bf16 autocast with fp32 master weights (``bf16=True``).

Each run is compared with the same trainer run without fuser: losses step by step (fp32: equal within the
model tests' tolerance; autocast: no further from the fp32 run than eager autocast is, as the model tests
judge bf16), what fused (every block), save → reload bit for bit, resuming, and a peft LoRA adapter.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import transformers

import fuser

datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

VOCAB, SEQ, ROWS = 128, 16, 12
CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", {}),
}
# per decoder layer: norms (those that feed only projections: rms_norm_linear), rope ops (q and k rotated by one
# op), gated MLPs; plus the final norm
PER_LAYER = {"llama": {"rms_norm_linear": 2, "rms_norm": 0}, "qwen3": {"rms_norm_linear": 2, "rms_norm": 2}}
# one decoder layer: what is checked is the trainers' integration (every block of a layer fused, the losses step by
# step, save/reload, resume, adapters, the callback's warnings), which a second identical layer only made trace twice
LAYERS = 1
# fuser compiles through aot_eager here, which runs the same fused ops as Inductor would (on CPU: their
# reference formulas) and keeps the suite fast; one test runs the README's line exactly (Inductor)
OPTIONS = {"inner_compiler": "aot_eager", "strict": True}
FP32_RTOL = 1e-5
BF16_FACTOR, BF16_FLOOR = 1.5, 4e-3  # tests/models/test_rms_norm.py: bf16 against the higher precision


@pytest.fixture(autouse=True)
def _quiet_and_one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    yield
    torch.set_num_threads(threads)


def tiny(arch: str, seed: int = 0) -> torch.nn.Module:
    cls_name, extra = CONFIGS[arch]
    config = getattr(transformers, cls_name)(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        **extra,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def token_rows(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (SEQ,), generator=g).tolist() for _ in range(ROWS)]


class TokenRows(torch.utils.data.Dataset):
    """What a tokenised causal-LM dataset hands the Trainer: input_ids and labels (plus an unused column)."""

    def __init__(self, rows: list[list[int]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.tensor(self.rows[i])
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny vocabulary, built in memory (no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", bos_token="t2")


class RecordLosses:
    """Mixed into a trainer: the loss of every training step, unrounded (the logs round to 4 digits)."""

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.step_losses.append(loss.detach().float().item())
        return loss


class Trainer(RecordLosses, transformers.Trainer):
    step_losses: list[float]


class SFTTrainer(RecordLosses, trl.SFTTrainer):
    step_losses: list[float]


def make_trainer(kind: str, model, out_dir, bf16: bool, steps: int = 2, **extra_args):
    common = dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=steps,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        bf16=bf16,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    common.update(extra_args)
    callbacks = [fuser.FuserCallback()] if fuser.dynamo_backend._MODEL_BACKENDS.get(model) else []
    if kind == "trainer":
        args = transformers.TrainingArguments(**common)
        trainer = Trainer(model=model, args=args, train_dataset=TokenRows(token_rows()), callbacks=callbacks)
    else:
        args = trl.SFTConfig(**common)
        ds = datasets.Dataset.from_dict({"input_ids": token_rows()})
        trainer = SFTTrainer(
            model=model, args=args, train_dataset=ds, processing_class=tokenizer(), callbacks=callbacks
        )
    trainer.step_losses = []
    return trainer


def expected_counts(arch: str, kind: str) -> dict[str, int]:
    # the trainers run fp32 weights (under autocast with bf16=True), so peft's adapters are plain trainable
    # projections there, which rms_norm_linear takes as it takes full fine-tuning's
    per_layer = PER_LAYER[arch]
    counts = {"rms_norm_linear": per_layer["rms_norm_linear"] * LAYERS, "rope": LAYERS, "swiglu": LAYERS}
    counts["rms_norm"] = per_layer["rms_norm"] * LAYERS + 1
    if kind == "trainer":
        # SFTTrainer computes the loss with TRL's own chunked LM head (trl.trainer.utils.add_fused_lm_head),
        # which never builds the logits either: there is no cross_entropy for fuser to fuse
        counts["linear_cross_entropy"] = 1
    return counts


def with_autocast_lora_sums(counts: dict[str, int]) -> dict[str, int]:
    """``counts`` of a peft LoRA model of fp32 weights trained under bf16 autocast (``bf16=True``): o_proj's and
    down_proj's adapters read a bf16 input (attention's output, the gated product), so their sums fuse in peft's
    autocast form (``lora_sum``, lora_A as ``upcast_linear``); the other adapters read a norm's fp32 output and go
    with ``rms_norm_linear``."""
    return {**counts, "lora_sum": 2 * LAYERS, "upcast_linear": 2 * LAYERS}


def fused_counts(model) -> dict[str, int]:
    counts = dict(fuser.report(model).counts)
    counts.pop("causal_attention", None)  # a proved causal mask: fuses where the batch carries none
    return counts


def _train(kind, arch, bf16, tmp_path, options=None):
    model = tiny(arch)
    if options is not None:
        fuser.optimize_(model, options)
    trainer = make_trainer(kind, model, tmp_path / f"{kind}-{arch}-{bf16}-{options is not None}", bf16)
    trainer.train()
    assert all(math.isfinite(x) for x in trainer.step_losses)
    return model, trainer


_PLAIN_LOSSES: dict[tuple[str, str, bool], list[float]] = {}


def plain_losses(kind: str, arch: str, bf16: bool, tmp_path) -> list[float]:
    """The step losses of the trainer run without fuser (computed once per setting: they do not change)."""
    key = (kind, arch, bf16)
    if key not in _PLAIN_LOSSES:
        _PLAIN_LOSSES[key] = _train(kind, arch, bf16, tmp_path)[1].step_losses
    return _PLAIN_LOSSES[key]


@pytest.mark.parametrize("kind", ["trainer", "sft"])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])  # fp32 first: the bf16 check reuses its plain run
def test_trainer_fuses_every_block_and_trains_like_eager(kind, arch, precision, tmp_path):
    bf16 = precision == "bf16"
    eager = plain_losses(kind, arch, bf16, tmp_path)
    model, fused = _train(kind, arch, bf16, tmp_path, OPTIONS)
    assert fused_counts(model) == expected_counts(arch, kind)
    # the user's model keeps its class and state_dict keys
    assert type(model).__name__.endswith("ForCausalLM")
    assert not any(k.startswith("_orig_mod.") for k in model.state_dict())
    if not bf16:
        for step, (got, want) in enumerate(zip(fused.step_losses, eager, strict=True)):
            assert abs(got - want) <= FP32_RTOL * abs(want), (step, got, want)
        return
    # autocast: judged against the fp32 run of the same trainer, as the model tests judge bf16 against fp64
    reference = plain_losses(kind, arch, False, tmp_path)
    for step, (got, want, ref) in enumerate(zip(fused.step_losses, eager, reference, strict=True)):
        eager_err, fused_err = abs(want - ref) / abs(ref), abs(got - ref) / abs(ref)
        assert fused_err <= BF16_FACTOR * eager_err + BF16_FLOOR, (step, got, want, ref)


@pytest.mark.parametrize("kind", ["trainer", "sft"])
def test_readme_lines_with_inductor(kind, tmp_path):
    """The Quick start's lines as they are written there (Inductor compiles the rest), bf16 autocast."""
    model = tiny("llama")
    args = dict(output_dir=str(tmp_path / kind), max_steps=1, per_device_train_batch_size=2, bf16=True, use_cpu=True)
    args.update(report_to=[], disable_tqdm=True)
    if kind == "trainer":
        ds = TokenRows(token_rows())
        fuser.optimize_(model)  # in place: the trainer keeps your class, forward signature and state_dict keys
        trainer = transformers.Trainer(
            model=model,
            args=transformers.TrainingArguments(**args),
            train_dataset=ds,
            callbacks=[fuser.FuserCallback()],
        )
    else:
        ds, sft_args = datasets.Dataset.from_dict({"input_ids": token_rows()}), trl.SFTConfig(**args)
        trainer = trl.SFTTrainer(
            model=fuser.optimize_(model),
            args=sft_args,
            train_dataset=ds,
            callbacks=[fuser.FuserCallback()],
            processing_class=tokenizer(),
        )
    trainer.train()
    assert fused_counts(model) == expected_counts("llama", kind)
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])


def test_sft_with_peft_config_is_optimized_through_trainer_model(tmp_path):
    """SFTTrainer(peft_config=...) wraps the model itself: optimize_ goes on trainer.model, as the README says."""
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    args = dict(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, use_cpu=True, report_to=[])
    trainer = trl.SFTTrainer(
        model=tiny("llama"),
        args=trl.SFTConfig(**args, disable_tqdm=True),
        train_dataset=datasets.Dataset.from_dict({"input_ids": token_rows()}),
        processing_class=tokenizer(),
        peft_config=config,
    )
    fuser.optimize_(trainer.model, OPTIONS)
    trainer.train()
    assert trainer.args.bf16  # SFTConfig's default: the forward runs under bf16 autocast over fp32 weights
    assert fused_counts(trainer.model) == with_autocast_lora_sums(expected_counts("llama", "sft"))


def test_save_model_reloads_bit_for_bit_and_resume_continues(tmp_path):
    model = fuser.optimize_(tiny("llama"), OPTIONS)
    trainer = make_trainer("trainer", model, tmp_path / "run", bf16=False, steps=4, save_strategy="steps", save_steps=2)
    trainer.train()
    trainer.save_model(tmp_path / "saved")
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    saved = model.state_dict()
    assert list(reloaded.state_dict()) == list(saved)
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, saved[name]), name

    # resume from the step-2 checkpoint in a fresh model and trainer: steps 3 and 4 repeat the first run's (one
    # micro-batch loss each per training_step call, two per step: gradient accumulation)
    resumed_model = fuser.optimize_(tiny("llama", seed=7), OPTIONS)
    resumed = make_trainer("trainer", resumed_model, tmp_path / "run", bf16=False, steps=4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert len(resumed.step_losses) == 4  # two optimizer steps of two micro-batches each
    for got, want in zip(resumed.step_losses, trainer.step_losses[4:], strict=True):
        assert abs(got - want) <= FP32_RTOL * abs(want), (got, want)
    assert fused_counts(resumed_model) == expected_counts("llama", "trainer")


def test_evaluation_and_generation_after_training(tmp_path):
    model = fuser.optimize_(tiny("llama"), OPTIONS)
    trainer = make_trainer("trainer", model, tmp_path / "eval", bf16=False, steps=2)
    trainer.train()
    eval_rows = TokenRows(token_rows(seed=3))
    metrics = trainer.evaluate(eval_dataset=eval_rows)
    plain = tiny("llama", seed=7)  # the same weights in a module fuser never saw
    plain.load_state_dict(model.state_dict())
    want = make_trainer("trainer", plain, tmp_path / "eval-plain", bf16=False).evaluate(eval_dataset=eval_rows)
    assert abs(metrics["eval_loss"] - want["eval_loss"]) <= FP32_RTOL * abs(want["eval_loss"])
    out = model.generate(torch.tensor([[2, 5, 6]]), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)


def test_peft_lora_adapter_saves_and_reloads(tmp_path):
    import peft

    base = tiny("llama")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    model = fuser.optimize_(peft.get_peft_model(base, config), OPTIONS)
    trainer = make_trainer("sft", model, tmp_path / "lora", bf16=True, steps=2)
    trainer.train()
    assert fused_counts(model) == with_autocast_lora_sums(expected_counts("llama", "sft"))
    model.save_pretrained(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(tiny("llama"), tmp_path / "adapter")
    trained = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    again = {k: v for k, v in reloaded.state_dict().items() if "lora_" in k}
    assert trained and list(trained) == list(again)
    for name, value in again.items():
        assert torch.equal(value, trained[name]), name


def test_callback_warns_when_the_trainer_bypasses_fuser(tmp_path):
    model = tiny("llama")
    trainer = make_trainer("trainer", model, tmp_path / "plain", bf16=False, steps=1)
    trainer.add_callback(fuser.FuserCallback())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert any("not given to fuser.optimize_" in str(w.message) for w in caught)


@pytest.mark.parametrize("use_cache", [True, False])
def test_callback_warns_when_packed_rows_would_attend_across_sequences(use_cache, tmp_path):
    """DataCollatorWithFlattening packs the rows; with the config's use_cache=True transformers masks a packed row
    as one sequence (checked here on the eager model), and the callback says so before the first step."""
    model = tiny("llama")
    model.config.use_cache = use_cache
    rows = token_rows()[:2]
    packed = transformers.DataCollatorWithFlattening()([{"input_ids": r} for r in rows])
    with torch.no_grad():
        second = model(**packed).logits[0, SEQ:]
        alone = model(input_ids=torch.tensor([rows[1]])).logits[0]
    assert torch.allclose(second, alone, atol=1e-5) != use_cache  # the cause the warning names
    fuser.optimize_(model, OPTIONS)
    # newer trainers set the config's use_cache from their own argument (default False) as training starts
    extra = {"use_cache": use_cache} if "use_cache" in transformers.TrainingArguments.__dataclass_fields__ else {}
    trainer = make_trainer("trainer", model, tmp_path / "packed", bf16=False, steps=1, **extra)
    trainer.data_collator = transformers.DataCollatorWithFlattening()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    warned = [w for w in caught if "packs several sequences" in str(w.message)]
    assert len(warned) == int(use_cache), [str(w.message) for w in caught]


def test_callback_puts_fused_counts_into_the_logs(tmp_path):
    model = fuser.optimize_(tiny("llama"), OPTIONS)
    trainer = make_trainer("trainer", model, tmp_path / "logs", bf16=False, steps=2)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "fuser/rms_norm" in entry]
    assert logged and logged[0]["fuser/rms_norm"] == expected_counts("llama", "trainer")["rms_norm"]


def test_torch_compile_backend_fuser_in_training_arguments_is_refused_by_accelerate():
    """Why the README does not name ``torch_compile_backend="fuser"``: accelerate checks the name against its
    own list of backends. If a release lifts that, this test fails and the README can name the route."""
    args = transformers.TrainingArguments(
        output_dir="/tmp/unused", torch_compile=True, torch_compile_backend="fuser", use_cpu=True, report_to=[]
    )
    with pytest.raises(ValueError, match="DynamoBackend"):
        transformers.Trainer(model=tiny("llama"), args=args, train_dataset=TokenRows(token_rows()))


def test_callback_warns_where_dynamo_ran_the_models_code_eagerly(tmp_path):
    """With ``checkpoint_side_effects=False`` under gradient checkpointing, transformers >= 5.25 (its ``kernels``
    routing) makes Dynamo give up on each decoder layer: the callback names the function and Dynamo's reason after
    the first step. With the default nothing is run eagerly, and it says nothing."""
    import transformers.models.llama.modeling_llama as modeling_llama

    if not isinstance(getattr(modeling_llama, "apply_rotary_pos_emb", None), torch.nn.Module):
        pytest.skip("this transformers does not route attention through the kernels package")

    def run(options, out_dir):
        model = fuser.optimize_(tiny("llama"), options)
        trainer = make_trainer("trainer", model, out_dir, bf16=False, steps=1, gradient_checkpointing=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        return [str(w.message) for w in caught if "ran it eagerly" in str(w.message)]

    (message,) = run({**OPTIONS, "checkpoint_side_effects": False}, tmp_path / "off")
    assert "modeling_llama.py" in message and "Unsafe side effect" in message, message
    torch._dynamo.reset()  # Dynamo keeps a frame it gave up on as skipped
    assert run(OPTIONS, tmp_path / "on") == []


def test_callback_names_dynamos_recompile_limit_when_nothing_compiled(tmp_path):
    """A model of a class that Dynamo compiled before with another backend, past ``recompile_limit`` (here 1: the
    forward wrapper transformers shares across models holds that compile): Dynamo runs the trainer's model
    eagerly. The callback names that cause, not a model wrapped after optimize_."""
    with torch._dynamo.config.patch(recompile_limit=1):
        ids = torch.tensor(token_rows()[:2])
        torch.compile(tiny("llama"), backend="eager")(input_ids=ids, labels=ids)
        model = fuser.optimize_(tiny("llama"), OPTIONS)
        trainer = make_trainer("trainer", model, tmp_path / "limit", bf16=False, steps=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
    said = [str(w.message) for w in caught if "first training step compiled no graph" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "recompile_limit" in said[0] and "torch._dynamo.reset()" in said[0], said[0]
    assert "wrapped after" not in said[0], said[0]
