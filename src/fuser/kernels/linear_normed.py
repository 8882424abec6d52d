"""``fuser::linear_normed``: a trainable projection of an RMSNorm's output that does not save that output.

``F.linear(y, W, b)`` with ``y`` the output of ``fuser::rms_norm`` (or ``add_rms_norm``): the q/k/v or gate/up
projections under full fine-tuning. Autograd saves ``y`` ([tokens, hidden]) for ``dW = dyᵀ @ y``; the norm's own
backward already saves its input ``h`` and ``rstd``, so this op saves those instead, and its backward rebuilds ``y``
from them (``h · rstd · (w + offset)`` in fp32, rounded to ``y``'s dtype: what the norm's kernel computes) just
before the weight-gradient matmul:

    dx = dy @ W          dW = dyᵀ @ y(h, rstd, w)          db = Σ_rows dy

The backward is written in aten ops, so AOT autograd traces it into the backward graph: the projections of one norm
(q, k and v; gate and up) rebuild ``y`` with the same ops from the same inputs, which common-subexpression
elimination merges into one rebuild, and Inductor fuses it into one pointwise kernel whose output lives from the
first of those matmuls to the last. The matmuls are PyTorch's, as eager's.

``dtype`` is the dtype the projection computes in: ``y``'s, or autocast's (fp32 master weights, an fp32 ``y`` and a
bf16 matmul). The op casts ``y``, the weight and the bias to it, as autocast does; the gradients come back in each
input's own dtype. The rewrite (``fuser.refinements.norm_projections.rebuild_in_projections``) hands it ``y``, the
weight and the bias already cast by the graph, so that under autocast these casts are Inductor's kernels, shared
where they can be, and the op's own casts do nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fuser.kernels.upcast_linear import normed_reference

_ARGS = (
    "Tensor y, Tensor h, Tensor rstd, Tensor? norm_weight, float offset, Tensor weight, Tensor? bias, ScalarType dtype"
)


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


@torch.library.custom_op("fuser::linear_normed", mutates_args=(), schema=f"({_ARGS}) -> Tensor")
def linear_normed_op(y, h, rstd, norm_weight, offset, weight, bias, dtype):
    """``F.linear(y, weight, bias)`` computed in ``dtype`` (each cast to it), ``y`` being an RMSNorm's output, ``h``
    its input and ``rstd`` the statistic its forward computed."""
    return F.linear(y.to(dtype), weight.to(dtype), _cast(bias, dtype))


@linear_normed_op.register_fake
def _(y, h, rstd, norm_weight, offset, weight, bias, dtype):
    return y.new_empty((*y.shape[:-1], weight.shape[0]), dtype=dtype)


def _setup_context(ctx, inputs, output):
    y, h, rstd, norm_weight, offset, weight, bias, dtype = inputs
    ctx.save_for_backward(h, rstd, norm_weight, weight)
    ctx.offset = offset
    ctx.dtypes = (y.dtype, None if bias is None else bias.dtype, dtype)


def _backward(ctx, dy):
    h, rstd, norm_weight, weight = ctx.saved_tensors
    y_dtype, bias_dtype, dtype = ctx.dtypes
    need_y, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[5], ctx.needs_input_grad[6]
    rows = dy.reshape(-1, dy.shape[-1])
    dx = dw = db = None
    if need_y:
        dx = (rows @ weight.to(dtype)).to(y_dtype).view(*dy.shape[:-1], weight.shape[1])
    if need_w:
        y = normed_reference(h, rstd, norm_weight, ctx.offset).to(dtype)
        dw = (rows.t() @ y.reshape(-1, y.shape[-1])).to(weight.dtype)
    if need_b and bias_dtype is not None:
        db = rows.sum(0).to(bias_dtype)
    return dx, None, None, None, None, dw, db, None


linear_normed_op.register_autograd(_backward, setup_context=_setup_context)
