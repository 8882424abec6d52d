"""Tier 3: SwiGLU under QLoRA, where the down projection is a custom autograd.Function (bitsandbytes' 4-bit
``MatMul4Bit``, recorded by Dynamo as ``autograd_function_apply``) — and the same rule on toy autograd.Functions.

The QLoRA tests need bitsandbytes (not a CI dependency: they skip there); the toy tests need nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fuser
from tests.models.tiny import N_LAYERS, assert_training_step_equals_eager, batch, from_config

STRICT = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
AUTOGRAD_FUNCTION_APPLY = torch.ops.higher_order.autograd_function_apply


def _feeds_autograd_function(node: torch.fx.Node, depth: int = 0) -> bool:
    """Whether ``node`` reaches an ``autograd_function_apply`` call, directly or through a cast (proof that the
    test exercises that path, not a plain linear Dynamo inlined)."""
    return any(
        u.target is AUTOGRAD_FUNCTION_APPLY or (u.op == "call_method" and depth < 2 and _feeds_autograd_function(u, 1))
        for u in node.users
    )


# --- toy graphs: the product consumed by a custom autograd.Function -------------------------------------------

INTER, H = 24, 16


class LinearFunction(torch.autograd.Function):
    """A hand-written linear: ``x @ w.T`` (what bitsandbytes' MatMul4Bit is, with w dequantised)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w, grad.flatten(0, -2).t() @ x.flatten(0, -2)


class RowSumScale(torch.autograd.Function):
    """``x.sum(-1, keepdim=True) * w``: shaped like a projection to ``w``'s size, but no matrix product of x."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x.sum(-1, keepdim=True) * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return (grad * w).sum(-1, keepdim=True).expand_as(x), (grad * x.sum(-1, keepdim=True)).flatten(0, -2).sum(0)


class Scale(torch.autograd.Function):
    """Elementwise ``x * w``."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).flatten(0, -2).sum(0)


def _toy_mlp(down: type[torch.autograd.Function]):
    def mlp(x, wg, wu, wd):
        return down.apply(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)

    mlp.__name__ = f"mlp_into_{down.__name__}"
    return mlp


def _toy_inputs(down_shape: tuple[int, ...]):
    torch.manual_seed(0)
    x = torch.randn(2, 5, H)
    wg, wu = torch.randn(INTER, H) / 4, torch.randn(INTER, H) / 4
    wd = torch.randn(*down_shape) / 5
    # gradients required, or Dynamo inlines the Function's forward instead of recording autograd_function_apply
    return [t.requires_grad_(True) for t in (x, wg, wu, wd)]


def test_autograd_function_multiplying_the_product_by_a_matrix_is_a_projection():
    fn, inputs = _toy_mlp(LinearFunction), _toy_inputs((H, INTER))
    report = fuser.explain(fn, *inputs)
    assert report.counts == {"swiglu": 1}, str(report)
    assert _feeds_autograd_function(report.matches[0].found.root), str(report)
    ref_inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = torch.compile(fn, backend=fuser.backend(STRICT))(*inputs)
    assert fuser.backend(STRICT).counts == {"swiglu": 1}
    ref = fn(*ref_inputs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(ref)
    out.backward(dy)
    ref.backward(dy)
    for t, r in zip(inputs, ref_inputs, strict=True):
        torch.testing.assert_close(t.grad, r.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "down, down_shape, use", [(RowSumScale, (H,), "sum"), (Scale, (INTER,), "mul")], ids=["row_sum", "elementwise"]
)
def test_autograd_function_without_a_matrix_product_is_a_near_miss(down, down_shape, use):
    fn, inputs = _toy_mlp(down), _toy_inputs(down_shape)
    report = fuser.explain(fn, *inputs)
    assert report.counts == {}, str(report)
    reasons = [nm.reason for nm in report.near_misses if nm.pattern == "swiglu"]
    assert any(
        "custom autograd.Function" in r and "not as the input of a matrix product" in r and use in r for r in reasons
    ), str(report)
    out = torch.compile(fn, backend=fuser.backend(STRICT))(*inputs)
    torch.testing.assert_close(out, fn(*inputs), rtol=1e-5, atol=1e-5)


# --- QLoRA: bitsandbytes NF4 base linears + peft LoRA -----------------------------------------------------------


@pytest.fixture
def bnb():
    return pytest.importorskip("bitsandbytes")


def build_qlora_llama(bnb, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny Llama (2 layers, hidden 64) built as ``benchmarks/train_step.py`` builds its QLoRA job: every decoder
    ``nn.Linear`` replaced by an NF4 ``bnb.nn.Linear4bit`` computing in ``dtype`` (the model's), marked as a 4-bit
    load so that peft wraps them with its bitsandbytes LoRA layer, then LoRA on all linears (fp32 adapters)."""
    import peft

    model = from_config("LlamaConfig", {"attn_implementation": "sdpa"}).to(dtype)
    for layer in model.model.layers:
        for name, linear in list(layer.named_modules()):
            if type(linear) is not torch.nn.Linear:
                continue
            quantized = bnb.nn.Linear4bit(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                compute_dtype=dtype,
                quant_type="nf4",
                device="meta",
            )
            weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4", module=quantized)
            quantized.weight = weight.to("cpu")  # Params4bit quantises on its first move to a device
            parent, _, child = name.rpartition(".")
            setattr(layer.get_submodule(parent) if parent else layer, child, quantized)
    model.is_loaded_in_4bit = True
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    return peft.get_peft_model(model, config)


def test_qlora_llama_fuses_one_swiglu_per_layer(bnb):
    model = build_qlora_llama(bnb)
    assert isinstance(model.base_model.model.model.layers[0].mlp.down_proj.base_layer, bnb.nn.Linear4bit)
    report = fuser.explain(model, **batch())
    assert report.counts.get("swiglu") == N_LAYERS, str(report)
    swiglus = [m for m in report.matches if m.pattern == "swiglu"]
    # the down projection is bitsandbytes' MatMul4Bit, and peft's LoRA sums on gate and up are absorbed
    assert all(_feeds_autograd_function(m.found.root) for m in swiglus), str(report)
    assert all({"gate_lora", "up_lora"} <= set(m.found.bindings) for m in swiglus), str(report)


def test_qlora_llama_training_step_equals_eager(bnb):
    model = build_qlora_llama(bnb)
    # bitsandbytes computes in fp32 here (compute_dtype), from the same NF4 weights in both runs: the only
    # difference from eager is the fused activation, so fp32 tolerances hold
    out, _ = assert_training_step_equals_eager(model, STRICT)
    assert fuser.backend(STRICT).counts.get("swiglu") == N_LAYERS
    assert torch.isfinite(out.loss)


def test_qlora_llama_dynamic_shape_recompile_still_fuses(bnb):
    """Once the sequence length is dynamic, Dynamo keeps bitsandbytes' ``A.numel() == 0`` check in MatMul4Bit's
    forward graph: a read of the product's shape, which must not make it look like a non-projection."""
    model = build_qlora_llama(bnb)
    compiled = fuser.optimize(model, STRICT)
    for seq in (8, 12, 20):
        compiled(**batch(seq=seq)).loss.backward()
    results = fuser.backend(STRICT).results
    assert len(results) == 2  # the static compile and the dynamic-shape one
    assert [r.counts.get("swiglu") for r in results] == [N_LAYERS, N_LAYERS]


def test_qlora_bf16_lora_sums_take_the_bitsandbytes_order_bit_for_bit(bnb):
    """A bf16 QLoRA model: peft's bitsandbytes layers cast the scaled LoRA term to bf16 before adding it, and
    ``lora_sum`` (on by default) matches each as its "peft bitsandbytes" variant; alone, the step is eager's bit
    for bit."""
    model = build_qlora_llama(bnb, torch.bfloat16)
    report = fuser.explain(model, **batch())
    assert report.counts.get("lora_sum") == 7 * N_LAYERS and report.counts.get("swiglu") == N_LAYERS, str(report)
    assert {m.variant for m in report.matches if m.pattern == "lora_sum"} == {"peft bitsandbytes"}
    reference = copy.deepcopy(model)
    out_ref = reference(**batch())
    out_ref.loss.backward()
    alone = fuser.FuserConfig(patterns=("lora_sum",), strict=True, inner_compiler="aot_eager")
    out = fuser.optimize(model, alone)(**batch())
    out.loss.backward()
    assert fuser.backend(alone).counts == {"lora_sum": 7 * N_LAYERS}
    assert torch.equal(out.loss, out_ref.loss)
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert grads and all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters() if p.grad is not None)
