"""``linear(x.to(weight.dtype), weight, bias)`` that keeps ``x`` in its own (half) precision for the backward.

peft keeps LoRA adapters in fp32 under a bf16 base model and casts each adapter's input up: ``lora_A(x.float())``.
The weight gradient of ``lora_A`` needs that input in the backward, and Inductor's partitioner saves the fp32 copy
(a tensor consumed by a matmul in the backward is never recomputed), twice the bytes of the bf16 ``x`` it came
from. For a Llama-3-8B layer at 8192 tokens that is 0.87 GB of fp32 copies where 0.44 GB of bf16 would do.

This op computes exactly what the graph computed (the same cast, the same fp32 matmul) but saves ``x`` itself;
the backward casts it again, transiently:

    y      = x.to(W.dtype) @ Wᵀ + b
    dx     = (dy @ W).to(x.dtype)          the cast's backward rounds the fp32 gradient once, as eager's does
    dW     = dyᵀ @ x.to(W.dtype)           (rows of all leading dims flattened)
    db     = Σ dy
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fuser: upcast_linear expects weight [out, in] with in = x.shape[-1] = {x.shape[-1]}, "
            f"got {tuple(weight.shape)}"
        )
    if not weight.is_floating_point() or not x.is_floating_point():
        raise ValueError(f"fuser: upcast_linear expects floating-point x and weight, got {x.dtype} and {weight.dtype}")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.dtype != weight.dtype):
        raise ValueError(
            f"fuser: upcast_linear expects bias [{weight.shape[0]}] of the weight's dtype {weight.dtype}, "
            f"got {tuple(bias.shape)} {bias.dtype}"
        )


@torch.library.custom_op("fuser::upcast_linear", mutates_args=())
def upcast_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    _check(x, weight, bias)
    return F.linear(x.to(weight.dtype), weight, bias)


@upcast_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=weight.dtype)


def _setup_context(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad
    dx = dw = db = None
    if need_x:
        dx = (dy @ weight).to(x.dtype)
    rows = dy.reshape(-1, dy.shape[-1])
    if need_w:
        dw = rows.t() @ x.reshape(-1, x.shape[-1]).to(weight.dtype)
    if need_b and ctx.has_bias:
        db = rows.sum(0)
    return dx, dw, db


upcast_linear_op.register_autograd(_backward, setup_context=_setup_context)


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x.to(weight.dtype), weight, bias)``, saving ``x`` (not its upcast copy) for the backward."""
    return torch.ops.fuser.upcast_linear(x, weight, bias)
