"""Tier 3: RoPE in tiny Hugging Face models — one fused op per attention layer, and training steps vs eager."""

from __future__ import annotations

import pytest

import fuser
from tests.models.tiny import ROPE_ARCHS, assert_training_step_equals_eager, batch, build_rope_arch, with_lora

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
