"""Tier 3: under full fine-tuning the down projection fed a gated MLP's fused product becomes
``fuser::linear_gated``, whose backward recomputes the product for the weight gradient instead of saving it. On
tiny models: one per layer (swiglu and geglu), none for a frozen base (LoRA), the training step bit for bit what
it is without the refinement, and the partitioner saves one ``[tokens, intermediate]`` tensor per layer fewer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fuser
import fuser.kernels.linear_gated  # noqa: F401  (registers the ops)
from tests.models.tiny import N_LAYERS, batch, build_any, grads, lora_model, lora_step, saved_wide_tensors, small_llama

AOT = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
NO_RECOMPUTE = {"gated_mlp": {"recompute_for_down_weight": False}}
AOT_NO_RECOMPUTE = fuser.FuserConfig.from_options({"strict": True, "inner_compiler": "aot_eager", **NO_RECOMPUTE})


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
def test_one_per_layer_and_the_step_is_unchanged_bit_for_bit(arch, pattern, dtype):
    since = len(fuser.backend(AOT).results)
    loss, g = full_step(arch, dtype, AOT)
    assert refined(AOT, since)[pattern] == N_LAYERS  # (rms_norm_linear refines the q/k/v and gate/up projections)
    torch._dynamo.reset()
    loss_off, g_off = full_step(arch, dtype, AOT_NO_RECOMPUTE)
    assert fuser.backend(AOT_NO_RECOMPUTE).results and pattern not in refined(AOT_NO_RECOMPUTE)
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


@pytest.mark.parametrize("recompute", [True, False], ids=["refined", "not refined"])
def test_the_product_is_no_longer_saved(recompute):
    config = fuser.FuserConfig(gated_mlp={"recompute_for_down_weight": recompute})
    wide = saved_wide_tensors(small_llama(96).train(), 96, config)
    # gate and up (for the gated op's backward), and without the refinement the product too
    assert len(wide) == (2 if recompute else 3) * 2, wide


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("need_b", [True, False])
def test_gated_down_grads_is_the_two_ops_it_replaces(activation, need_b):
    """``fuser::gated_down_grads`` (and its in-place form) gives what ``linear_gated_grads`` and the gated backward
    of its dx give, bit for bit: the product comes from the backward's own formula, not a recompute."""
    gen = torch.Generator().manual_seed(2)
    gate, up = (torch.randn(2, 5, 24, generator=gen) for _ in range(2))
    w, dy = torch.randn(16, 24, generator=gen), torch.randn(2, 5, 16, generator=gen)
    scales = (1.0, 1.0, activation)
    dx, dw, db = torch.ops.fuser.linear_gated_grads(dy, gate, up, w, *scales, True, True, need_b)
    dgate, dup, *_ = torch.ops.fuser.gated_activation_backward(
        dx, gate, up, 1.0, 1.0, True, True, False, False, activation
    )
    fused = torch.ops.fuser.gated_down_grads(dy, gate, up, w, *scales, need_b)
    for name, a, b in zip(("dgate", "dup", "dW", "db"), fused, (dgate, dup, dw, db), strict=True):
        assert torch.equal(a, b), name
    g, u = gate.clone(), up.clone()
    dw_, db_ = torch.ops.fuser.gated_down_grads_(dy, g, u, w, *scales, need_b)
    for name, a, b in (("dgate", g, dgate), ("dup", u, dup), ("dW", dw_, dw), ("db", db_, db)):
        assert torch.equal(a, b), name
    torch.library.opcheck(torch.ops.fuser.gated_down_grads.default, (dy, gate, up, w, *scales, need_b))
    torch.library.opcheck(torch.ops.fuser.gated_down_grads_.default, (dy, gate.clone(), up.clone(), w, *scales, need_b))
