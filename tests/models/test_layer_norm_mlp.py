"""Tier 3: LayerNorm and un-gated MLPs in tiny GPT-2, GPT-NeoX and OPT models — ``fuser.explain`` counts the blocks
(every LayerNorm, one MLP activation per layer, the loss) and an fp32 training step equals eager's, every
gradient."""

from __future__ import annotations

import copy

import pytest
import torch

import fuser
from tests.models.harness import train_step
from tests.models.tiny import N_LAYERS, batch, from_config, rel

STRICT = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")

# config class, extra fields, LayerNorms (two per layer and the final one)
ARCHS = {
    # Conv1D projections (addmm), gelu_new written as its tanh formula, no RoPE
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_layer": N_LAYERS, "n_head": 4, "n_inner": 96}),
    # nn.Linear with biases, exact GELU, partial RoPE
    "gpt_neox": ("GPTNeoXConfig", {"rotary_pct": 0.25, "hidden_dropout": 0.0, "attention_dropout": 0.0}),
    # ReLU, the MLP's linears in the decoder layer itself
    "opt": ("OPTConfig", {"ffn_dim": 96, "word_embed_proj_dim": 64, "pad_token_id": 0, "dropout": 0.0}),
}
EXPECTED = {"layer_norm": 2 * N_LAYERS + 1, "mlp_activation": N_LAYERS, "linear_cross_entropy": 1}


def build(arch: str) -> torch.nn.Module:
    cls_name, extra = ARCHS[arch]
    model = from_config(cls_name, {"attn_implementation": "sdpa", **extra})
    # random LayerNorm weights and biases, so a kernel that ignored either would be caught
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("arch", ["gpt2", "opt"])
def test_explain_counts_every_layer_norm_and_mlp(arch):
    report = fuser.explain(build(arch), **batch())
    counts = {k: v for k, v in report.counts.items() if k in EXPECTED}
    assert counts == EXPECTED, str(report)
    # the first projection's bias joined the activation's op where it is an nn.Linear's (not GPT-2's Conv1D addmm)
    biased = [m.replacement.args[1] is not None for m in report.matches if m.pattern == "mlp_activation"]
    assert biased == [arch != "gpt2"] * N_LAYERS, str(report)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fp32_training_step_equals_eager(arch):
    """Loss and every gradient within 1e-5 relative of eager's. A key projection's bias shifts every score of a query
    by one number, which softmax cancels: its gradient is zero up to rounding in both runs, and is checked as that
    (below 1e-6 of the whole gradient's norm on both sides), not as a ratio of two rounding noises."""
    model = build(arch)
    loss_ref, g_ref = train_step(copy.deepcopy(model))
    loss, g = train_step(model, STRICT)
    assert rel(loss, loss_ref) <= 1e-5
    assert g.keys() == g_ref.keys() and g
    whole = torch.sqrt(sum(t.double().pow(2).sum() for t in g_ref.values()))
    for name in g_ref:
        if name.endswith("k_proj.bias"):
            assert max(g[name].norm(), g_ref[name].norm()) <= 1e-6 * whole, name
        else:
            assert rel(g[name], g_ref[name]) <= 1e-5, name
    counts = fuser.backend(STRICT).counts
    assert {k: v for k, v in counts.items() if k in EXPECTED} == EXPECTED, counts
