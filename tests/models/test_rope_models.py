"""Tier 3: RoPE in tiny Hugging Face models — one fused op per attention layer, and training steps vs eager."""

from __future__ import annotations

import copy

import pytest

import fuser
from tests.models.tiny import ROPE_ARCHS, batch, build_rope_arch, grads, rel, with_lora

STRICT = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")


@pytest.mark.parametrize("arch", list(ROPE_ARCHS))
def test_explain_counts_one_rope_per_attention_layer(arch):
    report = fuser.explain(build_rope_arch(arch), **batch())
    assert report.counts.get("rope", 0) == ROPE_ARCHS[arch][2], str(report)


def test_explain_counts_rope_under_lora():
    report = fuser.explain(with_lora(build_rope_arch("phi3")), **batch())
    assert report.counts.get("rope", 0) == ROPE_ARCHS["phi3"][2], str(report)


@pytest.mark.parametrize("arch", ["llama", "phi3", "glm4", "gpt_neox"])
def test_fp32_training_step_equals_eager(arch):
    model = build_rope_arch(arch)
    reference = copy.deepcopy(model)
    data = batch()
    loss_ref = reference(**data).loss
    loss_ref.backward()
    loss = fuser.optimize(model, STRICT)(**data).loss
    loss.backward()
    assert fuser.backend(STRICT).counts["rope"] == ROPE_ARCHS[arch][2]
    assert rel(loss, loss_ref) <= 1e-5
    g, g_ref = grads(model), grads(reference)
    assert g.keys() == g_ref.keys() and g
    for name in g_ref:
        assert rel(g[name], g_ref[name]) <= 1e-4, name
