"""Tier 3: under full fine-tuning the down projection fed a gated MLP's fused product becomes
``fuser::linear_gated``, whose backward recomputes the product for the weight gradient instead of saving it. On
tiny models: one per layer (swiglu and geglu), none for a frozen base (LoRA), the training step bit for bit what
it is without the refinement, and the partitioner saves one ``[tokens, intermediate]`` tensor per layer fewer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fuser
import fuser.kernels.linear_gated  # noqa: F401  (registers the ops)
import fuser.patterns.gated_mlp as gated_pattern
from tests.models.tiny import N_LAYERS, batch, build_any, grads, lora_model, lora_step

AOT = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")


def refined(config, since: int = 0) -> dict[str, int]:
    total: dict[str, int] = {}
    for result in fuser.backend(config).results[since:]:
        for name, n in result.refined.items():
            total[name] = total.get(name, 0) + n
    return total


def full_step(arch, dtype, config):
    model = build_any(arch, dtype)
    out = fuser.optimize(model, config)(**batch())
    out.loss.backward()
    return out.loss.detach(), grads(model)


@pytest.mark.parametrize(("arch", "pattern"), [("llama", "swiglu"), ("gemma", "geglu")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_per_layer_and_the_step_is_unchanged_bit_for_bit(arch, pattern, dtype, monkeypatch):
    since = len(fuser.backend(AOT).results)
    loss, g = full_step(arch, dtype, AOT)
    assert refined(AOT, since) == {pattern: N_LAYERS}
    torch._dynamo.reset()
    monkeypatch.setattr(gated_pattern, "RECOMPUTE_FOR_DOWN_WEIGHT", False)
    since = len(fuser.backend(AOT).results)
    loss_off, g_off = full_step(arch, dtype, AOT)
    assert refined(AOT, since) == {}
    assert torch.equal(loss, loss_off) and g.keys() == g_off.keys()
    for name in g:
        assert torch.equal(g[name], g_off[name]), name


def test_not_for_a_frozen_down_projection():
    # LoRA's base weight needs no gradient: nothing saves the product for it
    since = len(fuser.backend(AOT).results)
    lora_step(lora_model(), AOT)
    assert "swiglu" not in refined(AOT, since)


def test_op_gradients_are_linears_with_bias():
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(2, 5, 24, generator=gen, dtype=torch.float64) for _ in range(2))
    w = torch.randn(16, 24, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(16, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64)
    x = torch.ops.fuser.gated_activation(gate, up, None, None, 1.0, 1.0, "silu")[0].requires_grad_()
    F.linear(x, w, b).backward(dy)
    expected = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    out = torch.ops.fuser.linear_gated(x, gate, up, w, b, 1.0, 1.0, "silu")
    assert torch.equal(out, F.linear(x, w, b))
    out.backward(dy)
    for name, t, e in zip(("x", "weight", "bias"), (x, w, b), expected, strict=True):
        torch.testing.assert_close(t.grad, e, rtol=1e-12, atol=1e-12, msg=f"d{name}")


def test_opcheck():
    gen = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(3, 24, generator=gen) for _ in range(2))
    x = torch.ops.fuser.gated_activation(gate, up, None, None, 1.0, 1.0, "gelu_tanh")[0]
    w, b = torch.randn(8, 24, generator=gen), torch.randn(8, generator=gen)
    torch.library.opcheck(torch.ops.fuser.linear_gated.default, (x, gate, up, w, b, 1.0, 1.0, "gelu_tanh"))
    dy = torch.randn(3, 8, generator=gen)
    args = (dy, gate, up, w, 1.0, 1.0, "gelu_tanh", True, True, True)
    torch.library.opcheck(torch.ops.fuser.linear_gated_grads.default, args)


def _saved_activations_module():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "saved_activations.py"
    spec = importlib.util.spec_from_file_location("saved_activations", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("recompute", [True, False], ids=["refined", "not refined"])
def test_the_product_is_no_longer_saved(recompute, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    saved_activations = _saved_activations_module()
    monkeypatch.setattr(gated_pattern, "RECOMPUTE_FOR_DOWN_WEIGHT", recompute)
    torch.manual_seed(0)
    inter = 96
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=inter, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa")  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16).train()
    ids = torch.randint(0, 128, (2, 8))
    patterns = [fuser.patterns.PATTERNS[name] for name in fuser.DEFAULT_PATTERNS]
    saved = saved_activations.saved_for_backward(model, (), {"input_ids": ids, "labels": ids}, patterns)
    wide = [shape for dtype, shape in saved if dtype == torch.bfloat16 and shape[-1] == inter]
    # gate and up (for the gated op's backward), and without the refinement the product too
    assert len(wide) == (2 if recompute else 3) * 2, saved
