"""Tier 3: peft's fp32 LoRA adapters on a bf16 tiny Llama: every ``lora_A(x.float())`` becomes ``upcast_linear``
(7 per layer), and a training step equals eager's — bit for bit with that rewrite alone (the same cast and the
same fp32 matmuls), and with every pattern on as close to an fp32 reference as eager bf16 is."""

from __future__ import annotations

import pytest
import torch

import fuser
from tests.models.tiny import N_LAYERS, assert_step_as_close_to_fp32_as_eager, batch, lora_model, lora_step

peft = pytest.importorskip("peft")


def test_explain_counts_one_upcast_linear_per_adapter():
    report = fuser.explain(lora_model(), **batch())
    assert report.counts.get("upcast_linear") == 7 * N_LAYERS, str(report)


def test_alone_it_is_bit_for_bit_eager():
    config = fuser.FuserConfig(patterns=("upcast_linear",), strict=True, inner_compiler="aot_eager")
    loss_ref, grads_ref = lora_step(lora_model())
    loss, grads = lora_step(lora_model(), config)
    assert fuser.backend(config).counts == {"upcast_linear": 7 * N_LAYERS}
    assert torch.equal(loss, loss_ref)
    for name, g in grads.items():
        assert g.dtype == torch.float32 and torch.equal(g, grads_ref[name]), name


def test_with_every_pattern_as_close_to_fp32_as_eager_bf16():
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
    assert_step_as_close_to_fp32_as_eager(torch.bfloat16, config)
    assert fuser.backend(config).counts.get("upcast_linear") == 7 * N_LAYERS
