"""FuserConfig.padding_free: a padded batch runs as one packed row of its real tokens, and trains as the padded
batch does: the loss, ``num_items_in_batch`` and every gradient are the padded eager run's (fp32 within 1e-5
relative; bf16 no further from an fp64 run than padded eager bf16 is), for right-, left- and mixed-padded batches.

Most checks call the packing itself around the eager model (``PaddingFree``, no Dynamo): what they test is what
transformers computes for the packed row. One Llama run goes through ``fuser.optimize`` over three batches (two
compiles: a static and a dynamic length), a Gemma-3 run with ``causal_attention.block_sparse_masks`` on, and a
``transformers.Trainer`` run with a padding collator through ``fuser.optimize_``.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import transformers

import fuser
from fuser.padding_free import PaddingFree, PaddingFreeStats
from tests.models.tiny import grads, rel

VOCAB, LENGTH = 512, 9
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    pad_token_id=0,
    attn_implementation="sdpa",
)
ARCHS = {
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", {}),
    # a window of 4 keys on the first layer, global attention on the second: rows of 9 tokens cross the window
    "gemma3": (
        "Gemma3TextConfig",
        {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 16},
    ),
    "mistral": ("MistralConfig", {"sliding_window": 4}),
    "phi3": ("Phi3Config", {}),
    "olmo2": ("Olmo2Config", {}),
}
# rows' real lengths and which rows are left-padded: right only, one left among right, left only
BATCHES = {"right": ((5, 9, 3), ()), "mixed": ((7, 4, 9), (1,)), "left": ((6, 2, 8), (0, 1, 2))}


def tiny(arch: str, dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    cls_name, extra = ARCHS[arch]
    extra = {**extra, **overrides}
    torch.manual_seed(0)
    config = getattr(transformers, cls_name)(**{**COMMON, **extra})
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype).train()  # dropout is 0 in these configs


def padded_batch(lengths, left=(), seed: int = 1, length: int = LENGTH) -> dict[str, torch.Tensor]:
    """A batch as a padding collator gives it: pads (id 0) after the real tokens, or before them in ``left`` rows;
    labels are the ids with -100 at pads, and at a left-padded row's first token (a prompt token, as completion-only
    collators mask it): with a label there, the padded loss would train the last pad token to predict it."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(lengths), length), generator=g)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, length - n :] = 1 if row in left else 0
        if row not in left:
            mask[row, :n] = 1
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    for row in left:
        labels[row, length - lengths[row]] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def step(model: torch.nn.Module, data: dict, packed: bool):
    """(outputs, gradients) of one forward+backward of ``model``, eager, padded or through the packing; the
    gradients are cleared after."""
    if packed:
        stats = PaddingFreeStats()
        out = PaddingFree(model, model, stats)(model, (), dict(data))
        assert stats.packed == 1 and not stats.declined, stats
    else:
        out = model(**data)
    out.loss.backward()
    found = grads(model)
    model.zero_grad(set_to_none=True)
    return out, found


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_packed_loss_logits_and_gradients_equal_the_padded_run(arch):
    model = tiny(arch)
    for name, (lengths, left) in BATCHES.items():
        data = padded_batch(lengths, left)
        data["num_items_in_batch"] = torch.tensor(int((data["labels"][:, 1:] != -100).sum()) + 5)
        (out, g), (ref, g_ref) = step(model, data, True), step(model, data, False)
        assert rel(out.loss, ref.loss) <= 1e-5, (name, out.loss, ref.loss)
        real = data["attention_mask"].bool()
        assert out.logits.shape == ref.logits.shape
        assert rel(out.logits[real], ref.logits[real]) <= 1e-5, name
        assert not out.logits[~real].any(), "pad positions hold zeros"
        assert g.keys() == g_ref.keys() and len(g) == len(list(model.parameters()))
        for param in g_ref:
            assert rel(g[param], g_ref[param]) <= 1e-5, (name, param)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("precision", ["bf16", "autocast"])
def test_packing_moves_bf16_results_less_than_bf16_is_off_from_fp64(arch, precision):
    """bf16 weights, or fp32 weights under bf16 autocast (``Trainer(bf16=True)``): the packed run's loss and each
    gradient differ from the padded bf16 run's by no more than the padded bf16 run differs from an fp64 run. Both
    compute the same ops on the same tokens; only the matmuls' shapes differ (the packed row has no pad columns), so
    their fp32 accumulation rounds differently and a few bf16 results land one ulp apart, either way: which of the
    two is nearer fp64 is a draw. A document that saw another, or a wrong position, moves results by far more."""
    data = padded_batch(*BATCHES["mixed"])
    reference, ref_grads = step(tiny(arch, torch.float64), data, False)
    model = tiny(arch, torch.bfloat16 if precision == "bf16" else torch.float32)
    with torch.autocast("cpu", torch.bfloat16, enabled=precision == "autocast"):
        (out, g), (padded, g_padded) = step(model, data, True), step(model, data, False)
    assert abs(out.loss - padded.loss) <= abs(padded.loss.double() - reference.loss)
    assert g.keys() == g_padded.keys() == ref_grads.keys()
    for name, expected in ref_grads.items():
        assert rel(g[name], g_padded[name]) <= rel(g_padded[name], expected), name


def test_probe_declines_an_attention_that_lets_packed_documents_see_each_other(monkeypatch):
    """An attention implementation that ignores the mask (plain causal over the whole row) is caught by the probe's
    gradient across documents, even where its name passes the allow-list."""
    import torch.nn.functional as F

    def leaky(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    transformers.AttentionInterface.register("leaky_test", leaky)
    transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS.register("leaky_test", transformers.masking_utils.sdpa_mask)
    monkeypatch.setattr(fuser.padding_free, "PACKED_MASK_ATTENTION", ("sdpa", "eager", "leaky_test"))
    model = tiny("llama")
    model.set_attn_implementation("leaky_test")
    packer = PaddingFree(model, model, PaddingFreeStats())
    with pytest.raises(fuser.padding_free.Decline, match="attend to each other"):
        packer.pack((), padded_batch(*BATCHES["right"]))
    model.set_attn_implementation("sdpa")  # the verdict is per implementation: sdpa keeps documents apart
    assert packer.pack((), padded_batch(*BATCHES["right"])) is not None


def _with(data: dict, **changes) -> dict:
    return {**data, **changes}


def test_batches_and_calls_that_cannot_be_packed_exactly_decline_with_the_reason():
    model = tiny("llama")
    packer = PaddingFree(model, model, PaddingFreeStats())
    right, left = padded_batch(*BATCHES["right"]), padded_batch(*BATCHES["left"])
    holed = right["attention_mask"].clone()
    holed[1, 4] = 0
    copied = left["input_ids"].masked_fill(left["attention_mask"] == 0, -100)  # labels = ids: pads predict
    # right-padded row 0 ends at position 4; row 1, left-padded, starts at position 5 = one document to transformers
    follows = padded_batch((5, 4, 9), (1,))
    reasons = {
        "output_hidden_states": _with(right, output_hidden_states=True),
        "output_attentions": _with(right, output_attentions=True),
        "use_cache=True": _with(right, use_cache=True),
        "inputs_embeds": {
            **{k: v for k, v in right.items() if k != "input_ids"},
            "inputs_embeds": torch.zeros(3, 9, 64),
        },
        "token_type_ids": _with(right, token_type_ids=torch.zeros_like(right["input_ids"])),
        "not one contiguous run": _with(right, attention_mask=holed),
        "reads a pad position's logits": _with(left, labels=copied),
        "would read as one document": follows,
        "do not count up by one": _with(right, position_ids=torch.arange(9).remainder(4).expand(3, 9)),
    }
    for expected, data in reasons.items():
        with pytest.raises(fuser.padding_free.Decline, match=expected):
            packer.pack((), data)
    assert packer.pack((), _with(right, attention_mask=torch.ones(3, 9, dtype=torch.long))) is None  # no padding
    assert packer.pack((), {k: v for k, v in right.items() if k != "attention_mask"}) is None  # no mask
    flash = PaddingFree._static_reason(model, model.config, "flash_attention_2")
    assert "flash_attention_2" in flash and "position_ids" in flash


def test_a_declined_call_runs_padded_and_the_user_is_told_once(caplog):
    """Through fuser.optimize: hidden states asked for: the call runs padded (its outputs are the padded batch's),
    one warning for two calls, and fuser.report names the reason."""
    model = tiny("llama")
    compiled = fuser.optimize(model, fuser.FuserConfig(inner_compiler="eager", padding_free=True))
    data = _with(padded_batch(*BATCHES["right"]), output_hidden_states=True)
    # Dynamo off: what is tested is fuser's wrapper around the compiled call, which runs all the same
    with caplog.at_level(logging.WARNING, logger="fuser"), torch._dynamo.config.patch(disable=True):
        outs = [compiled(**data) for _ in range(2)]
    told = [r.getMessage() for r in caplog.records if "padding_free" in r.getMessage()]
    assert len(told) == 1 and "output_hidden_states" in told[0], told
    assert outs[0].hidden_states[-1].shape[:2] == (3, LENGTH)
    stats = fuser.report(compiled).padding_free
    assert stats.packed == 0 and list(stats.declined.values()) == [2]
    assert "output_hidden_states" in str(fuser.report(compiled))
    assert rel(outs[0].loss, model(**data).loss) <= 1e-5


def _compiled_steps(arch: str, config: fuser.FuserConfig, batches: list[dict]):
    model = tiny(arch)
    reference = copy.deepcopy(model)
    compiled = fuser.optimize(model, config)
    for data in batches:
        (out, g), (ref, g_ref) = step_compiled(compiled, model, data), step(reference, data, False)
        assert rel(out.loss, ref.loss) <= 1e-5
        assert g.keys() == g_ref.keys() and g
        for name in g_ref:
            assert rel(g[name], g_ref[name]) <= 1e-5, name
    return compiled


def step_compiled(compiled, model, data):
    out = compiled(**data)
    out.loss.backward()
    found = grads(model)
    model.zero_grad(set_to_none=True)
    return out, found


def test_three_batches_through_optimize_compile_twice_and_train_like_the_padded_run():
    """Llama through fuser (strict): right-, mixed- and left-padded batches of 17, 20 and 16 real tokens; the second
    length compiles a dynamic graph that serves the third; every block fuses in both graphs. The fused ops run
    their own backward either way; the inner compiler is eager to keep CI short (the Gemma-3 test goes through AOT
    autograd)."""
    config = fuser.FuserConfig(strict=True, inner_compiler="eager", padding_free=True)
    compiled = _compiled_steps("llama", config, [padded_batch(*b) for b in BATCHES.values()])
    report = fuser.report(compiled)
    assert report.graphs == 2 and report.recompiles == 1, str(report)
    assert "size mismatch at index 1" in report.recompile_reasons[0]
    first, again = fuser.backend(config).results
    assert first.counts["linear_cross_entropy"] == 1 and first.counts["causal_attention"] == 2
    # the dynamic graph fuses the same blocks, the packed mask's attention on the block mask among them
    assert again.counts == first.counts
    assert {m.variant for m in again.matches if m.pattern == "causal_attention"} == {"block-sparse mask"}
    assert report.padding_free.packed == 3 and not report.padding_free.declined
    assert report.padding_free.real_tokens == 17 + 20 + 16 and report.padding_free.padded_tokens == 3 * 3 * LENGTH


def test_gemma3_packed_through_block_sparse_masks():
    """Gemma-3 (a window of 4 keys, then global attention) with causal_attention.block_sparse_masks on: the packed
    mask, built from position_ids, goes to the block-sparse attention op (on CPU the masked SDPA)."""
    config = fuser.FuserConfig(
        strict=True, inner_compiler="aot_eager", padding_free=True, causal_attention={"block_sparse_masks": True}
    )
    compiled = _compiled_steps("gemma3", config, [padded_batch(*BATCHES["mixed"])])
    report = fuser.report(compiled)
    assert report.counts.get("causal_attention") == 2, str(report)
    assert report.padding_free.packed == 1


class _RecordLosses(transformers.Trainer):
    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.step_losses.append(loss.detach().float().item())
        return loss


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny vocabulary, built in memory (no downloads); pads on the right."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", bos_token="t2")


def _trainer_losses(model: torch.nn.Module, bf16: bool, out_dir) -> list[float]:
    g = torch.Generator().manual_seed(3)
    # two batches of three rows, padded to 9 by the collator: 17 real tokens of 27 each (one compiled shape)
    rows = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in (5, 9, 3, 9, 4, 4)]
    args = transformers.TrainingArguments(
        output_dir=str(out_dir),
        per_device_train_batch_size=3,
        max_steps=2,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=bf16,
        seed=0,
        train_sampling_strategy="sequential",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    collator = transformers.DataCollatorForLanguageModeling(_tokenizer(), mlm=False)
    trainer = _RecordLosses(model=model, args=args, train_dataset=rows, data_collator=collator)
    trainer.step_losses = []
    trainer.train()
    return trainer.step_losses


def test_trainer_with_a_padding_collator_trains_packed(tmp_path):
    """``fuser.optimize_(model)`` with padding_free, ``Trainer(bf16=True)`` and transformers' padding collator,
    unchanged: every step runs packed, and its loss is the padded run's (bf16: packing moves it less than bf16 is
    off from the fp32 run). Only packing differs from the plain run here (no pattern fuses)."""
    transformers.logging.set_verbosity_error()
    fp32 = _trainer_losses(tiny("llama"), False, tmp_path / "fp32")
    plain = _trainer_losses(tiny("llama"), True, tmp_path / "plain")
    model = fuser.optimize_(tiny("llama"), {"padding_free": True, "patterns": (), "inner_compiler": "eager"})
    packed = _trainer_losses(model, True, tmp_path / "packed")
    for got, want, ref in zip(packed, plain, fp32, strict=True):
        assert abs(got - want) <= abs(want - ref), (got, want, ref)
    report = fuser.report(model)
    assert report.padding_free.packed == 2 and not report.padding_free.declined
    assert report.padding_free.real_tokens == 34 and report.graphs == 1
    assert type(model) is transformers.LlamaForCausalLM


def test_sft_trainer_trains_packed_through_trls_fused_lm_head(tmp_path):
    """TRL's SFTTrainer (fp32): its chunked LM head returns per-token outputs of the shifted length, which come back
    in the batch's shape, and the losses are the padded run's."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    transformers.logging.set_verbosity_error()
    g = torch.Generator().manual_seed(3)
    rows = {"input_ids": [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 3, 9, 4, 4)]}

    def losses(model, out_dir):
        args = trl.SFTConfig(
            output_dir=str(out_dir),
            per_device_train_batch_size=3,
            max_steps=2,
            learning_rate=1e-3,
            lr_scheduler_type="constant",
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            bf16=False,
            seed=0,
            train_sampling_strategy="sequential",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        data = datasets.Dataset.from_dict(rows)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=_tokenizer())
        found = []
        step = trainer.training_step

        def record(*args, **kwargs):
            loss = step(*args, **kwargs)
            found.append(loss.item())
            return loss

        trainer.training_step = record
        trainer.train()
        return found

    plain = losses(tiny("llama"), tmp_path / "plain")
    model = fuser.optimize_(tiny("llama"), {"padding_free": True, "patterns": (), "inner_compiler": "eager"})
    packed = losses(model, tmp_path / "packed")
    assert len(packed) == 2
    for got, want in zip(packed, plain, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    assert fuser.report(model).padding_free.packed == 2


@pytest.mark.gpu
def test_gpu_bf16_packed_runs_flex_block_masks_at_every_length():
    """Llama in bf16 on a CUDA GPU with ``padding_free``, through Inductor: three padded batches of different
    lengths (right, mixed and left padding; up to 400 tokens, several 128-token tiles). The first compiles a static
    graph, the second one for any length, which serves the third; both run the packed mask's attention on
    FlexAttention's block mask. Each step's loss and gradients stay as close to the padded fp64 eager step as
    padded eager bf16 is (the bar of tests/models/test_gpu.py)."""
    from tests.models.harness import assert_no_further_than_eager

    base = tiny("llama", max_position_embeddings=512).cuda()
    config = fuser.FuserConfig(strict=True, padding_free=True)
    model = copy.deepcopy(base).bfloat16()
    compiled = fuser.optimize(model, config)
    eager, reference = copy.deepcopy(base).bfloat16(), copy.deepcopy(base).double()
    batches = [((300, 170, 256), ()), ((150, 333, 90), (1,)), ((400, 211, 388), (0, 1, 2))]
    for lengths, left in batches:
        data = {k: v.cuda() for k, v in padded_batch(lengths, left, length=max(lengths)).items()}
        (out, g), (ref, g_ref), (bf, g_bf) = (
            step_compiled(compiled, model, data),
            step(reference, data, False),
            step(eager, data, False),
        )
        loss = lambda o: o.loss.detach().float()  # noqa: E731
        assert_no_further_than_eager((loss(out), g), (loss(bf), g_bf), (loss(ref), g_ref), 1.5, 4e-3)
    report = fuser.report(compiled)
    assert report.graphs == 2 and report.padding_free.packed == 3, str(report)
    for result in fuser.backend(config).results:
        variants = [m.variant for m in result.matches if m.pattern == "causal_attention"]
        assert variants == ["block-sparse mask"] * 2, str(report)
