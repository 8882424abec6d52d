"""A linear layer fed an upcast copy of its input: ``linear(x.to(fp32), W)`` with ``x`` in bf16/fp16.

peft writes every LoRA adapter of a half-precision model this way (adapters kept in fp32, ``lora_A(x.float())``);
so do fp32 routers and heads. Inductor saves the fp32 copy for the weight gradient; the fused op saves ``x``
(half the bytes) and casts it again in the backward. The values are the same: the same cast and the same fp32
matmul (``fuser/kernels/upcast_linear.py``).
"""

from __future__ import annotations

import torch

from fuser.engine.canonical import tensor_meta
from fuser.engine.match import C, Found, OneOf, Op, V
from fuser.kernels.upcast_linear import HALF_DTYPES  # importing it registers torch.ops.fuser.upcast_linear
from fuser.patterns.base import Decline, Pattern, Replacement, Variant

VARIANTS = [Variant("upcast input", Op("linear", Op("to", V("x"), C("dtype")), V("w"), OneOf(V("b"), None)))]


def check_upcast_linear(found: Found, variant: Variant) -> Replacement:
    b = found.bindings
    xt, wt, out = tensor_meta(b["x"]), tensor_meta(b["w"]), tensor_meta(found.root)
    if xt.dtype not in HALF_DTYPES:
        raise Decline(f"the input is {xt.dtype} before the cast, not bf16/fp16: nothing to save")
    if b["dtype"] != torch.float32 or wt.dtype != torch.float32:
        raise Decline(f"cast to {b['dtype']} for a {wt.dtype} weight (the op handles an fp32 weight and cast)")
    if out is None or out.dtype != wt.dtype:
        raise Decline(f"the linear returns {None if out is None else out.dtype} (autocast?), not the weight's dtype")
    if wt.dim() != 2:
        raise Decline(f"weight of rank {wt.dim()}")
    if xt.device != wt.device:
        raise Decline("input and weight on different devices")
    bias = b.get("b")
    if bias is not None and tensor_meta(bias).dtype != wt.dtype:
        raise Decline(f"bias of dtype {tensor_meta(bias).dtype}, not the weight's {wt.dtype}")
    return Replacement(torch.ops.fuser.upcast_linear.default, (b["x"], b["w"], bias))


UPCAST_LINEAR = Pattern("upcast_linear", VARIANTS, check_upcast_linear)
