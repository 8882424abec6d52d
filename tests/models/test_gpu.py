"""Tier 3 on a CUDA GPU: the Triton kernels inside a compiled tiny model (Inductor) against eager, fp32 and bf16, and
Gemma-3's sliding windows through fuser's FlashAttention window op. (Each block's own GPU tests are in its file, marked
``gpu`` as these are; without a GPU all are skipped.)"""

from __future__ import annotations

import copy

import pytest

import fuser
from tests.models.harness import assert_no_further_than_eager, train_step
from tests.models.tiny import ARCHS, batch, build, expected_norms, fused_norms, grads, rel


@pytest.mark.gpu
@pytest.mark.parametrize("arch", list(ARCHS))
def test_gpu_fp32_training_step_equals_eager(arch):
    model = build(arch).cuda()
    reference = copy.deepcopy(model)
    data = {k: v.cuda() for k, v in batch(seq=64).items()}
    reference(**data).loss.backward()
    loss_ref = reference(**data).loss
    config = fuser.FuserConfig(strict=True)
    optimized = fuser.optimize(model, config)
    optimized(**data).loss.backward()
    loss = optimized(**data).loss
    assert fused_norms(fuser.backend(config).counts) == expected_norms(arch)
    assert rel(loss, loss_ref) <= 1e-5
    g, g_ref = grads(model), grads(reference)
    for name in g_ref:
        assert rel(g[name], g_ref[name]) <= 1e-4, name


def assert_bf16_step_as_close_as_eager(base, data, config):
    """One training step of ``base`` in bf16 through fuser: its loss and gradients must stay within 1.5x eager bf16's
    error against an fp64 model (+ half a bf16 eps)."""
    reference64 = train_step(copy.deepcopy(base).double(), data=data)
    eager = train_step(copy.deepcopy(base).bfloat16(), data=data)
    fused = train_step(copy.deepcopy(base).bfloat16(), config, data=data)
    assert_no_further_than_eager(fused, eager, reference64, 1.5, 4e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "gemma", "olmo2"])
def test_gpu_bf16_training_step_no_less_accurate_than_eager(arch):
    """bf16 model: fuser's error against an fp64 model must stay within 1.5x eager bf16's (+ half a bf16 eps)."""
    data = {k: v.cuda() for k, v in batch(seq=64).items()}
    config = fuser.FuserConfig(strict=True)
    assert_bf16_step_as_close_as_eager(build(arch).cuda(), data, config)
    assert fused_norms(fuser.backend(config).counts) == expected_norms(arch)


@pytest.mark.gpu
def test_gpu_gemma3_sliding_window_bf16_step_no_less_accurate_than_eager():
    """A tiny Gemma-3 (two sliding layers of window 16, one global, head_dim 32) in bf16 at 64 tokens: its sliding
    layers run fuser's FlashAttention window op (the probe passed, so the kernels are used, not the masked
    fallback), and the step's loss and gradients stay as close to an fp64 model's as eager bf16's, by the bar of
    the test above."""
    import torch

    from fuser.kernels import window_attention as W
    from tests.models.tiny import from_config

    extra = {
        "attn_implementation": "sdpa", "sliding_window": 16, "head_dim": 32,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"], "num_hidden_layers": 3,
    }  # fmt: skip
    base = from_config("Gemma3TextConfig", extra).cuda()
    data = {k: v.cuda() for k, v in batch(seq=64).items()}
    config = fuser.FuserConfig(strict=True)
    report = fuser.explain(copy.deepcopy(base).bfloat16(), **data, config=config)
    windows = [m.module for m in report.matches if m.variant == "window 16"]
    assert len(windows) == 2, str(report)  # the two sliding layers (the global one may be a plain causal rewrite)
    assert_bf16_step_as_close_as_eager(base, data, config)
    assert fuser.backend(config).counts.get("causal_attention", 0) >= 2  # the compiled model rewrote them too
    assert W._probe(torch.cuda.current_device(), torch.bfloat16, 32) is None
