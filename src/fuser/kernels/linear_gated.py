"""``fuser::linear_gated``: the down projection of a gated MLP under full fine-tuning, without saving its input.

``F.linear(x, W, b)`` with ``x = act(gate) * up`` the gated op's product ([tokens, intermediate], the widest
activation of a layer). Autograd saves ``x`` for ``dW = dyᵀ @ x``; the gated op already saves gate and up for its
own backward, so this op saves those instead and recomputes ``x`` in the backward with the gated op's own forward
(the same kernel, so the same values): one ``[tokens, intermediate]`` tensor per layer fewer between the forward
and the backward, for one gated forward more in the backward. Inductor would recompute the product itself were it
plain pointwise code; as the output of a fused op it cannot.

    dx = dy @ W          dW = dyᵀ @ x(gate, up)          db = Σ_rows dy

The matmuls are PyTorch's (``torch.mm``), as eager's; the result is bit for bit eager's ``F.linear`` backward
given the same product. ``fuser.patterns.gated_mlp`` puts the op in place of such a linear after the rewrite
(unless ``FuserConfig.gated_mlp.recompute_for_down_weight`` is off).

In the backward, dx (the product's gradient) is read by nothing but the gated op's backward, which reads gate and
up as the recompute does. ``fuser::gated_down_grads`` is the two in one, for a post-grad pass to put in their place
(``fuser.inductor.gated_down_grads``): dx = dy @ W, then the gated backward kernel writes dgate, dup and, over dx
(each element read before it is written), the product, then dW = dyᵀ @ product. That is one pass over gate and up
fewer than the recompute's (two ``[tokens, intermediate]`` reads and a write, for one write); the values are the
same: the backward kernel forms the product as the forward kernel does. ``fuser::gated_down_grads_`` writes dgate
and dup over gate and up, where the gated backward had been rewritten in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fuser.kernels import _triton as tt
from fuser.kernels.gated_activation import (
    BASE_GRADS,
    Lora,
    LoraGrads,
    gated_activation_backward,
    gated_activation_forward,
)

# The argument lists of the gated down projections (this op's, and ``fuser::upcast_linear_gated``'s in
# upcast_linear.py, which adds ``allow_triton``) and of their backward ops (which add what each computes): the
# projection's input x, weight and bias, and the gated op's own arguments, from which the backward recomputes x. The
# ops' schemas are written from these pieces, the same schemas torch would infer from typed signatures.
GATED_LINEAR_ARGS = (
    "Tensor x, Tensor gate, Tensor up, Tensor weight, Tensor? bias, float gate_scale, float up_scale, str activation"
)
GATED_GRADS_ARGS = "Tensor dy, Tensor gate, Tensor up, Tensor weight, float gate_scale, float up_scale, str activation"


@torch.library.custom_op("fuser::linear_gated", mutates_args=(), schema=f"({GATED_LINEAR_ARGS}) -> Tensor")
def linear_gated_op(x, gate, up, weight, bias, gate_scale, up_scale, activation):
    """``F.linear(x, weight, bias)``, ``x`` being ``fuser::gated_activation(gate, up, None, None, gate_scale,
    up_scale, activation)[0]``."""
    return F.linear(x, weight, bias)


@linear_gated_op.register_fake
def _(x, gate, up, weight, bias, gate_scale, up_scale, activation):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op(
    "fuser::linear_gated_grads",
    mutates_args=(),
    schema=f"({GATED_GRADS_ARGS}, bool need_x, bool need_w, bool need_b) -> (Tensor, Tensor, Tensor)",
)
def linear_gated_grads(dy, gate, up, weight, gate_scale, up_scale, activation, need_x, need_w, need_b):
    """(dx, dW, db), each 0-element where not asked for. One op that reads ``dy``: the recompute belongs to the
    backward (a separate gated call would be merged with the forward's by common-subexpression elimination)."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    empty = dy.new_empty(0)
    dx = (dy2 @ weight).view(*dy.shape[:-1], weight.shape[1]) if need_x else empty
    dw, db = weight.new_empty(0), empty
    if need_w:
        x = gated_activation_forward(gate, up, activation, Lora(None, None, gate_scale, up_scale))[0]
        dw = dy2.t() @ x.reshape(-1, x.shape[-1])
    if need_b:
        db = dy2.sum(0)
    return dx, dw, db


@linear_gated_grads.register_fake
def _(dy, gate, up, weight, gate_scale, up_scale, activation, need_x, need_w, need_b):
    dx = dy.new_empty((*dy.shape[:-1], weight.shape[1])) if need_x else dy.new_empty(0)
    dw = weight.new_empty(weight.shape) if need_w else weight.new_empty(0)
    return dx, dw, dy.new_empty(dy.shape[-1]) if need_b else dy.new_empty(0)


def _gated_down_grads(dy, gate, up, weight, gate_scale, up_scale, activation, need_b, out, impl="auto"):
    """(dgate, dup, dW, db): ``linear_gated_grads(dy, …, need_x=True, need_w=True, need_b)`` and the gated op's
    backward of its dx (dgate and dup into ``out``'s buffers where given), with the product written over dx by
    the backward kernel instead of recomputed."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    dx = (dy2 @ weight).view(*dy.shape[:-1], weight.shape[1])
    lora = LoraGrads(gate_scale, up_scale)
    dgate, dup, _, _ = gated_activation_backward(
        dx, gate, up, activation, BASE_GRADS, lora, impl=impl, out=(*out, None, None), product_out=dx
    )
    dw = dy2.t() @ dx.view(-1, dx.shape[-1])
    return dgate, dup, dw, (dy2.sum(0) if need_b else dy.new_empty(0))


@torch.library.custom_op(
    "fuser::gated_down_grads",
    mutates_args=(),
    schema=f"({GATED_GRADS_ARGS}, bool need_b) -> (Tensor, Tensor, Tensor, Tensor)",
)
def gated_down_grads(dy, gate, up, weight, gate_scale, up_scale, activation, need_b):
    """(dgate, dup, dW, db or an empty tensor): ``fuser::linear_gated_grads(dy, gate, up, weight, …, True, True,
    need_b)`` whose dx only ``fuser::gated_activation_backward(dx, gate, up, …)`` reads, as one op (see the module
    docstring). Never called by autograd: a post-grad pass puts it in place of the two."""
    return _gated_down_grads(dy, gate, up, weight, gate_scale, up_scale, activation, need_b, (None, None))


@gated_down_grads.register_fake
def _(dy, gate, up, weight, gate_scale, up_scale, activation, need_b):
    db = dy.new_empty(dy.shape[-1] if need_b else 0)
    return gate.new_empty(gate.shape), up.new_empty(up.shape), weight.new_empty(weight.shape), db


@torch.library.custom_op(
    "fuser::gated_down_grads_",
    mutates_args=("gate", "up"),
    schema=(
        "(Tensor dy, Tensor(a!) gate, Tensor(b!) up, Tensor weight, float gate_scale, float up_scale, str activation,"
        " bool need_b) -> (Tensor, Tensor)"
    ),
)
def gated_down_grads_inplace(dy, gate, up, weight, gate_scale, up_scale, activation, need_b):
    """(dW, db or an empty tensor), with dgate written over ``gate`` and dup over ``up``: ``fuser::gated_down_grads``
    where the gated backward had been rewritten in place (``fuser::gated_activation_backward_``: nothing reads
    gate and up after it)."""
    # the kernels write rows of unit last stride; the reference computes both gradients before it writes either
    impl = "triton" if tt.triton_runs(gate) and gate.is_contiguous() and up.is_contiguous() else "reference"
    _, _, dw, db = _gated_down_grads(dy, gate, up, weight, gate_scale, up_scale, activation, need_b, (gate, up), impl)
    return dw, db


@gated_down_grads_inplace.register_fake
def _(dy, gate, up, weight, gate_scale, up_scale, activation, need_b):
    return weight.new_empty(weight.shape), dy.new_empty(dy.shape[-1] if need_b else 0)


def _setup_context(ctx, inputs, output):
    x, gate, up, weight, bias, gate_scale, up_scale, activation = inputs
    ctx.save_for_backward(gate, up, weight)
    ctx.gated = (gate_scale, up_scale, activation)


def _backward(ctx, dy):
    gate, up, weight = ctx.saved_tensors
    need_x, _, _, need_w, need_b = ctx.needs_input_grad[:5]
    dx = dw = db = None
    if need_x or need_w or need_b:
        dx, dw, db = torch.ops.fuser.linear_gated_grads(dy, gate, up, weight, *ctx.gated, need_x, need_w, need_b)
    return (dx if need_x else None), None, None, (dw if need_w else None), (db if need_b else None), None, None, None


linear_gated_op.register_autograd(_backward, setup_context=_setup_context)
