"""Tier 3: RoPE in tiny Hugging Face models — one fused op per attention layer, and training steps vs eager."""

from __future__ import annotations

import copy

import pytest

import fuser
from tests.models.tiny import (
    N_LAYERS,
    ROPE_ARCHS,
    VISION_TOWERS,
    VL_ARCHS,
    assert_training_step_equals_eager,
    batch,
    build_rope_arch,
    build_vision_tower,
    build_vl,
    grads,
    mrope_batch,
    rel,
    vision_loss,
    with_lora,
)

STRICT = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")


@pytest.mark.parametrize("arch", list(ROPE_ARCHS))
def test_explain_counts_one_rope_per_attention_layer(arch):
    report = fuser.explain(build_rope_arch(arch), **batch())
    assert report.counts.get("rope", 0) == ROPE_ARCHS[arch][2], str(report)


def test_explain_counts_rope_under_lora():
    report = fuser.explain(with_lora(build_rope_arch("phi3")), **batch())
    assert report.counts.get("rope", 0) == ROPE_ARCHS["phi3"][2], str(report)


@pytest.mark.parametrize("arch", ["llama", "phi3", "glm4", "gpt_neox", "deepseek_v3", "llama4_text"])
def test_fp32_training_step_equals_eager(arch):
    assert_training_step_equals_eager(build_rope_arch(arch), STRICT)
    assert fuser.backend(STRICT).counts["rope"] == ROPE_ARCHS[arch][2]


# Vision-language models: the text decoder's M-RoPE rotates as the Llama form once its cos/sin are recomposed by
# sections (in the rotary embedding, before the layers); the vision tower rotates q/k [T, H, D] of all patches by
# the 2-D (h, w) rotary embedding, in fp32, cast back to q's dtype.


@pytest.mark.parametrize("arch", list(VL_ARCHS))
def test_vl_text_decoder_counts_one_rope_per_layer(arch):
    report = fuser.explain(build_vl(arch), **mrope_batch())
    assert report.counts.get("rope", 0) == N_LAYERS, str(report)
    assert not [nm for nm in report.near_misses if nm.pattern == "rope"], str(report)


@pytest.mark.parametrize("arch", list(VL_ARCHS))
def test_vl_text_decoder_fp32_training_step_equals_eager(arch):
    """Loss and every gradient within 1e-5 of eager's, with (t, h, w) positions that differ per axis."""
    assert_training_step_equals_eager(build_vl(arch), STRICT, mrope_batch(), grad_tol=1e-5)
    assert fuser.backend(STRICT).counts["rope"] == N_LAYERS


@pytest.mark.parametrize("arch", VISION_TOWERS)
def test_vision_tower_counts_one_rope_per_block(arch):
    """The blocks of a tower whose attention breaks the graph after its rotation (Qwen's ``cu_seqlens.tolist()``)
    are one compiled graph run once per block: the rotations the forward runs are counted, one per block."""
    tower, args, kwargs = build_vision_tower(arch)
    report = fuser.explain(tower, *args, **kwargs)
    assert report.counts.get("rope", 0) >= 1 and report.executed.get("rope", 0) == N_LAYERS, str(report)
    assert not [nm for nm in report.near_misses if nm.pattern == "rope"], str(report)


@pytest.mark.parametrize("arch", VISION_TOWERS)
def test_vision_tower_fp32_training_step_equals_eager(arch):
    tower, args, kwargs = build_vision_tower(arch)
    reference = copy.deepcopy(tower)
    loss_ref = vision_loss(reference, args, kwargs)
    loss_ref.backward()
    loss = vision_loss(fuser.optimize(tower, STRICT), args, kwargs)
    loss.backward()
    assert fuser.backend(STRICT).counts.get("rope", 0) >= 1
    assert rel(loss, loss_ref) <= 1e-5
    g, g_ref = grads(tower), grads(reference)
    assert g.keys() == g_ref.keys() and g
    for name in g_ref:
        assert rel(g[name], g_ref[name]) <= 1e-5, (name, rel(g[name], g_ref[name]))
