"""Tier 3: RoPE in tiny Hugging Face models: one fused rotation per attention layer (Llama's rotate_half, partial and
interleaved rotations, MLA, Llama-4's complex form; vision-language models' M-RoPE and their vision towers' 2-D
rotary embedding), fp32 training steps equal to eager's, and under CPU bf16 autocast over fp32 weights steps as
close to an fp64 run as eager's.
"""

from __future__ import annotations

import copy

import pytest
import torch

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


# ---------------------------------------------------------------------------------------------------------
# One fused op per attention layer, and fp32 training steps equal to eager's
# ---------------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------------
# RoPE under CPU bf16 autocast with fp32 master weights (what HF Trainer bf16=True runs). There the projections give
# bf16 q/k and the rotary embedding fp32 cos/sin, so eager's rotation promotes to an fp32 result (Llama); Qwen3's q/k
# norms multiply by an fp32 weight and hand the rotation fp32 q/k. Either way one fused op per attention layer, and a
# training step equal to eager under autocast.
# ---------------------------------------------------------------------------------------------------------


AUTOCAST_ARCHS = ["llama", "qwen3"]
# only the rotation fused: every other op runs as eager runs it, so the step must equal eager's but for the
# rotation's own rounding (below)
ROPE_ONLY = fuser.FuserConfig(strict=True, inner_compiler="aot_eager", patterns=("rope",))
# test_rms_norm.py's bf16/autocast rule: fuser's error against an fp64 run may exceed
# eager's by a factor 1.5 plus half a bf16 eps. At this width a whole step's error is summation order: Inductor's
# own loss error is 0.6-9.6x eager's across seeds, and fuser's follows Inductor's within 5%
# (autocast_step_error_spread_cpu_2026-12-06.md); the rotation's own rounding is held to eager's error with no
# slack in tests/patterns/test_rope_pattern.py
BF16_FACTOR, BF16_FLOOR = 1.5, 4e-3


def _autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _train_step(model, data, autocast=True):
    with _autocast() if autocast else torch.autocast("cpu", enabled=False):
        out = model(**data)
    out.loss.backward()
    return out.loss.detach()


@pytest.mark.parametrize("arch", AUTOCAST_ARCHS)
def test_explain_counts_one_rope_per_attention_layer_under_autocast(arch):
    model = build_rope_arch(arch)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with _autocast():
        report = fuser.explain(model, **batch())
    assert report.counts.get("rope", 0) == ROPE_ARCHS[arch][2], str(report)
    assert not any(nm.pattern == "rope" for nm in report.near_misses), str(report)


@pytest.mark.parametrize("arch", AUTOCAST_ARCHS)
def test_autocast_training_step_with_rope_alone_equals_eager(arch):
    """Loss to fp32 rounding; each gradient within one bf16 eps (7.8e-3) over the tensor: eager rounds the
    gradient of each of q*cos and rotate_half(q)*sin to bf16 before summing, fuser rounds the sum once
    (measured: Llama ≤ 3.4e-3, Qwen3 0, its rotation being fp32 throughout)."""
    base, data = build_rope_arch(arch), batch()
    eager, fused = copy.deepcopy(base), copy.deepcopy(base)
    loss_ref = _train_step(eager, data)
    loss = _train_step(fuser.optimize(fused, ROPE_ONLY), data)
    assert fuser.backend(ROPE_ONLY).counts == {"rope": ROPE_ARCHS[arch][2]}
    assert loss.dtype == loss_ref.dtype and rel(loss, loss_ref) <= 1e-5
    g, g_ref = grads(fused), grads(eager)
    assert g.keys() == g_ref.keys() and g
    for name in g_ref:
        assert g[name].dtype == g_ref[name].dtype == torch.float32, name
        assert rel(g[name], g_ref[name]) <= 7.8e-3, (name, rel(g[name], g_ref[name]))


@pytest.mark.parametrize("arch", AUTOCAST_ARCHS)
def test_autocast_training_step_no_less_accurate_than_eager(arch):
    """Every default pattern on (RoPE among them): loss and every gradient as close to an fp64 run as eager
    under autocast is, by the rms_norm tier's rule; logits and gradients of eager's dtypes."""
    base, data = build_rope_arch(arch), batch()
    reference64 = copy.deepcopy(base).double()
    loss64 = _train_step(reference64, data, autocast=False)
    g64 = grads(reference64)
    eager, fused = copy.deepcopy(base), copy.deepcopy(base)
    eager_loss = _train_step(eager, data)
    optimized = fuser.optimize(fused, STRICT)
    fused_loss = _train_step(optimized, data)
    assert fuser.backend(STRICT).counts["rope"] == ROPE_ARCHS[arch][2]
    assert rel(fused_loss, loss64) <= BF16_FACTOR * rel(eager_loss, loss64) + BF16_FLOOR
    g_eager, g_fused = grads(eager), grads(fused)
    assert g_fused.keys() == g_eager.keys() == g64.keys()
    for name in g64:
        eager_err, fused_err = rel(g_eager[name], g64[name]), rel(g_fused[name], g64[name])
        assert fused_err <= BF16_FACTOR * eager_err + BF16_FLOOR, (name, fused_err, eager_err)
        assert g_fused[name].dtype == g_eager[name].dtype == torch.float32, name
    with _autocast(), torch.no_grad():
        assert optimized(**data).logits.dtype == eager(**data).logits.dtype
