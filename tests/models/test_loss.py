"""Tier 3: lm_head + cross-entropy in tiny Hugging Face models — counts, training steps vs eager (tied embeddings,
softcapping, num_items_in_batch, LoRA), what ``outputs.logits`` holds, and an all-ignored batch."""

from __future__ import annotations

import copy

import pytest
import torch

import fuser
from tests.models.tiny import (
    LCE_ARCHS,
    VOCAB,
    assert_training_step_equals_eager,
    build_lce_arch,
    grads,
    lm_batch,
    rel,
    with_lora,
)

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
