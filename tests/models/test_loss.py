"""Tier 3: the two ends of a tiny causal LM, which share a weight when tied: the lm_head + cross-entropy
(``linear_cross_entropy``: counts, fp32 training steps equal to eager's with tied embeddings, softcapping,
``num_items_in_batch`` and LoRA, what ``outputs.logits`` holds, an all-ignored batch) and the embedding's weight
gradient (the post-grad pass ``embedding_grads``: one ``fuser::embedding_grad`` per embedding, tied lm_head gradient
added, the step bit for bit the step without it).
"""

from __future__ import annotations

import copy

import pytest
import torch

import fuser
from tests.models.harness import post_grad_step, train_step
from tests.models.tiny import (
    LCE_ARCHS,
    VOCAB,
    assert_same_step,
    assert_training_step_equals_eager,
    batch,
    build_lce_arch,
    from_config,
    grads,
    lm_batch,
    rel,
    with_lora,
)

# ---------------------------------------------------------------------------------------------------------
# lm_head + cross-entropy: counts, training steps vs eager (tied embeddings, softcapping, num_items_in_batch, LoRA),
# what outputs.logits holds, and an all-ignored batch
# ---------------------------------------------------------------------------------------------------------


AOT = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
INDUCTOR = fuser.FuserConfig(strict=True, inner_compiler="inductor")


def _model(arch, lora):
    model = build_lce_arch(arch)
    return with_lora(model) if lora else model


@pytest.mark.parametrize("arch", list(LCE_ARCHS))
def test_explain_counts_one_linear_cross_entropy(arch):
    """With LoRA and num_items_in_batch here; without either in the training steps below (which count too)."""
    report = fuser.explain(_model(arch, lora=True), **lm_batch(num_items_in_batch=True))
    assert report.counts.get("linear_cross_entropy") == 1, str(report)


def test_tied_archs_are_tied():
    for arch in ("gemma", "gemma2"):
        model = build_lce_arch(arch)
        assert model.lm_head.weight is model.model.embed_tokens.weight, arch


# each architecture once through aot_eager, covering every combination of with/without num_items_in_batch and
# LoRA between them; Gemma-2 (tied, softcapped) also through Inductor (the None logits output included)
STEPS = [
    ("llama", False, False, AOT),
    ("qwen3", False, True, AOT),
    ("mistral", True, False, AOT),
    ("gemma", True, True, AOT),
    ("gemma2", False, True, AOT),
    ("gemma2", False, False, INDUCTOR),
]


@pytest.mark.parametrize(
    "arch, lora, num_items, config",
    STEPS,
    ids=[f"{a}-{'lora' if lo else 'full'}-{'num_items' if n else 'mean'}-{c.inner_compiler}" for a, lo, n, c in STEPS],
)
def test_fp32_training_step_equals_eager(arch, lora, num_items, config):
    """Loss and every parameter gradient (the tied embedding, lm_head, LoRA adapters) within 1e-5 relative;
    in training the fused graph never computes the logits: ``outputs.logits`` is None."""
    out, out_ref = assert_training_step_equals_eager(
        _model(arch, lora), config, lm_batch(num_items_in_batch=num_items), grad_tol=1e-5
    )
    assert fuser.backend(config).counts.get("linear_cross_entropy") == 1
    assert out.logits is None and out_ref.logits is not None


def test_keep_logits_returns_full_logits_and_leaves_the_loss_unfused():
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager", keep_logits=True)
    model = build_lce_arch("gemma2")
    data = lm_batch()
    out, out_ref = assert_training_step_equals_eager(model, config, data, grad_tol=1e-5)
    assert fuser.backend(config).counts.get("linear_cross_entropy") is None
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-5, atol=1e-6)


def test_evaluation_returns_full_logits():
    """Under no_grad the graph returns the logits and computes the loss from them as written."""
    model = build_lce_arch("llama")
    data = lm_batch(num_items_in_batch=True)
    with torch.no_grad():
        report = fuser.explain(model, **data)
        assert "linear_cross_entropy" not in report.counts, str(report)
        evaluation = [nm for nm in report.near_misses if "no gradient is wanted" in nm.reason]
        assert evaluation and not any(nm.applicable for nm in evaluation), str(report)  # nothing to spare there
        assert "no gradient is wanted" not in str(report), str(report)
        out = fuser.optimize(model, AOT)(**data)
        ref = model(**data)
    assert fuser.backend(AOT).counts.get("linear_cross_entropy") is None
    assert out.logits.shape == ref.logits.shape == (2, 16, VOCAB)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-6)
    assert rel(out.loss, ref.loss) <= 1e-5


def test_all_ignored_batch_behaves_like_eager():
    """Every label -100: the mean loss is NaN and every gradient zero, as in eager."""
    model = build_lce_arch("gemma")
    reference = copy.deepcopy(model)
    data = lm_batch()
    data["labels"] = torch.full_like(data["labels"], -100)
    ref = reference(**data)
    ref.loss.backward()
    out = fuser.optimize(model, AOT)(**data)
    out.loss.backward()
    assert fuser.backend(AOT).counts.get("linear_cross_entropy") == 1
    assert torch.isnan(out.loss) and torch.isnan(ref.loss)
    g, g_ref = grads(model), grads(reference)
    assert g.keys() == g_ref.keys() and g
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=0, atol=0, equal_nan=True, msg=name)


# ---------------------------------------------------------------------------------------------------------
# FuserConfig.experimental.embedding_grads (the post-grad pass embedding_grads, on by default): the embedding's weight
# gradient, with a tied lm_head's gradient added, is one op (fuser::embedding_grad). Through Inductor on CPU (caches
# off, so the post-grad passes run): one rewrite per embedding with a gradient, and the training step equal bit for
# bit to the step without it: fp32, tied and untied, a padding row, GPT-2's two embeddings; bf16 tied (Inductor's
# fused kernel rounds once, as the op does). Checked the same way by hand on Gemma, Qwen2, OPT, Phi, GPT-NeoX and
# Bloom (2026-12-03): all equal.
# ---------------------------------------------------------------------------------------------------------


EMBEDDING_GRADS_OFF = fuser.FuserConfig(strict=True, experimental={"embedding_grads": False})
PAD = 5


def embedding_step(model, config, data=None):
    """(loss, gradients) of one training step through fuser, and how many embedding gradients the op wrote."""
    step, counts = post_grad_step(model, config, data)
    return step, counts.get("embedding_grads", 0)


# one decoder layer, as for the lm_head tests above: the embedding's gradient is formed outside the layers, whose
# count only lengthens each Inductor compile
EMBEDDING_LAYERS = 1


def llama(tied: bool, dtype=torch.float32, pad: int | None = None):
    extra = {"attn_implementation": "sdpa", "tie_word_embeddings": tied, "pad_token_id": pad}
    extra["num_hidden_layers"] = EMBEDDING_LAYERS
    return from_config("LlamaConfig", extra).to(dtype).train()


@pytest.mark.usefixtures("inductor_caches_off")
@pytest.mark.parametrize(("tied", "pad"), [(True, None), (False, PAD)])
def test_fp32_step_is_unchanged(tied, pad):
    """Tied, and untied with a padding_idx, whose row then gets no gradient although the batch holds it."""
    model = llama(tied, pad=pad)
    data = batch()
    data["input_ids"][:, :3] = PAD  # padding tokens in the batch (counted in the loss: labels are the ids)
    on, taken = embedding_step(copy.deepcopy(model), INDUCTOR, data)
    off, taken_off = embedding_step(copy.deepcopy(model), EMBEDDING_GRADS_OFF, data)
    assert taken == 1 and taken_off == 0
    assert_same_step(on, off)
    if pad is not None:
        grad = on[1]["model.embed_tokens.weight"]
        assert not grad[PAD].any() and grad[data["input_ids"][0, -1]].any()


@pytest.mark.usefixtures("inductor_caches_off")
def test_gpt2_token_and_position_embeddings_both_take_the_op():
    """GPT-2: a tied token embedding and a learned position embedding (ids: the positions), two rewrites."""
    extra = {"n_embd": 64, "n_layer": EMBEDDING_LAYERS, "n_head": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
             "attn_pdrop": 0.0, "num_hidden_layers": EMBEDDING_LAYERS}  # fmt: skip
    model = from_config("GPT2Config", extra).train()
    on, taken = embedding_step(copy.deepcopy(model), INDUCTOR)
    off, _ = embedding_step(copy.deepcopy(model), EMBEDDING_GRADS_OFF)
    assert taken == 2
    assert_same_step(on, off)


@pytest.mark.usefixtures("inductor_caches_off")
def test_bf16_tied_step_is_unchanged_and_as_close_to_fp32():
    model = llama(True, torch.bfloat16)
    on, taken = embedding_step(copy.deepcopy(model), INDUCTOR)
    off, _ = embedding_step(copy.deepcopy(model), EMBEDDING_GRADS_OFF)
    _, grads32 = train_step(copy.deepcopy(model).float())  # the fp32 reference: eager's step
    assert taken == 1
    assert_same_step(on, off)
    name = "model.embed_tokens.weight"
    assert rel(on[1][name], grads32[name]) < 2**-7


@pytest.mark.usefixtures("inductor_caches_off")
@pytest.mark.gpu
def test_gpu_bf16_tied_step_as_close_to_fp32_as_without_it():
    """On the GPU the scatter's atomics sum in another order than the op: each gradient as close to an fp32 copy's
    step as without the op, within one bf16 rounding."""
    model = from_config(
        "LlamaConfig",
        {
            "attn_implementation": "sdpa",
            "tie_word_embeddings": True,
            "vocab_size": 4096,
            "hidden_size": 256,
            "intermediate_size": 512,
            "head_dim": 64,
        },  # fmt: skip
    ).cuda()
    ids = torch.randint(0, 4096, (2, 256), device="cuda")
    data = {"input_ids": ids, "labels": ids}
    (_, grads32), _ = embedding_step(copy.deepcopy(model).train(), EMBEDDING_GRADS_OFF, data)
    on, taken = embedding_step(copy.deepcopy(model).bfloat16().train(), INDUCTOR, data)
    off, _ = embedding_step(copy.deepcopy(model).bfloat16().train(), EMBEDDING_GRADS_OFF, data)
    assert taken == 1
    for name, g in on[1].items():
        assert rel(g, grads32[name]) <= rel(off[1][name], grads32[name]) + 2**-8, name
