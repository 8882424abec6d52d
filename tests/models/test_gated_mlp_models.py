"""Tier 3: gated MLPs (SwiGLU, GeGLU) in tiny Hugging Face models — counts, and training steps vs eager."""

from __future__ import annotations

import pytest

import fuser
from tests.models.tiny import (
    GATED_ARCHS,
    assert_training_step_equals_eager,
    batch,
    build_any,
    expected_mlp_counts,
    with_lora,
)

MLP_PATTERNS = ("swiglu", "geglu")
DENSE_LORA = ("llama", "qwen3", "mistral", "phi3", "gemma")
STRICT = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")


def _mlp_counts(counts):
    return {k: v for k, v in counts.items() if k in MLP_PATTERNS}


@pytest.mark.parametrize("arch", list(GATED_ARCHS))
@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_explain_counts_one_gated_activation_per_layer(arch, lora):
    model = build_any(arch)
    if lora:
        model = with_lora(model)
    report = fuser.explain(model, **batch())
    assert _mlp_counts(report.counts) == expected_mlp_counts(arch), str(report)
    if lora and arch in DENSE_LORA:
        # peft's base + lora_B(lora_A(x)) * s sums feeding the activation are absorbed into the op (MoE experts
        # are 3-D parameters: peft adapts those weights, so their activations see no LoRA sum to absorb)
        absorbed = [m for m in report.matches if m.pattern in MLP_PATTERNS]
        assert absorbed and all(any(k.endswith("_lora") for k in m.found.bindings) for m in absorbed), str(report)


@pytest.mark.parametrize("arch", ["llama", "phi3", "qwen3_moe", "gemma"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fp32_training_step_equals_eager(arch, lora):
    model = build_any(arch)
    assert_training_step_equals_eager(with_lora(model) if lora else model, STRICT)
    assert _mlp_counts(fuser.backend(STRICT).counts) == expected_mlp_counts(arch)
