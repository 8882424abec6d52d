"""Refinement of ``rms_norm_linear``'s norms: a trainable projection of a norm's output becomes
``fuser::linear_normed`` (``src/fuser/kernels/linear_normed.py``), whose backward rebuilds the normalised value from the
norm's input and rstd, which the norm's own backward saves anyway, instead of saving it. The pattern's check asks
:func:`why_not_rebuilt` whether a projection it accepts leaves nothing of the value saved once refined;
``upcast_linear``'s refinement reads a norm's op through :func:`norm_of` for peft's LoRA A.

Runs before ``rms_norm``'s refinement (:mod:`fuser.refinements.residual_norms`), which then takes the residual add of
these norms too; when the ``rms_norm`` pattern is off, this one does that itself."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
import torch.fx

import fuser.kernels.linear_normed  # noqa: F401  (registers torch.ops.fuser.linear_normed)
import fuser.kernels.rms_norm  # noqa: F401  (registers torch.ops.fuser.rms_norm and add_rms_norm)
import fuser.kernels.upcast_linear  # noqa: F401  (registers torch.ops.fuser.upcast_linear and upcast_linear_normed)
from fuser._dtypes import FLOAT_DTYPES
from fuser.engine.canonical import canonical, tensor_meta, value_readers
from fuser.engine.protocol import CastTo, Refinement
from fuser.engine.rewrite import copy_source_meta
from fuser.refinements.residual_norms import add_residuals_into_norms

if TYPE_CHECKING:
    from fuser.config import FuserConfig


def norm_of(x: object) -> tuple[torch.fx.Node, torch.fx.Node, tuple] | None:
    """``(norm call, its input h, (norm weight, offset))`` when ``x`` is ``fuser::rms_norm(h, …)[0]`` or
    ``fuser::add_rms_norm(…)[0]`` (h: its rounded sum, output 2) and the norm's output is what its kernel computes
    from h, rstd and the weight (no intermediate rounding, h's dtype); None otherwise."""
    if not (isinstance(x, torch.fx.Node) and x.target is operator.getitem and x.args[1] == 0):
        return None
    norm = x.args[0]
    if not isinstance(norm, torch.fx.Node):
        return None
    if norm.target is torch.ops.fuser.rms_norm.default:
        h, (weight, _, offset, norm_dtype, out_dtype) = norm.args[0], norm.args[1:6]
    elif norm.target is torch.ops.fuser.add_rms_norm.default:
        h, (weight, _, offset, norm_dtype, out_dtype) = None, norm.args[2:7]
    else:
        return None
    if norm_dtype is not None or isinstance(offset, torch.fx.Node):
        return None
    h_dtype = tensor_meta(norm.args[0] if h is None else h).dtype
    if out_dtype not in (None, h_dtype) or tensor_meta(x).dtype != h_dtype:
        return None
    return norm, h, (weight, float(offset))


def norm_output(graph: torch.fx.Graph, node: torch.fx.Node, index: int) -> torch.fx.Node:
    """``node[index]`` (a multi-output op's), reusing a getitem the graph has."""
    for user in node.users:
        if user.target is operator.getitem and user.args[1] == index:
            return user
    with graph.inserting_after(node):
        item = graph.call_function(operator.getitem, (node, index))
    example = node.meta.get("example_value")
    if isinstance(example, (tuple, list)):
        item.meta["example_value"] = example[index]
    copy_source_meta(node, item)
    return item


def why_not_rebuilt(linear: torch.fx.Node, weight: object, bias: object, y: torch.fx.Node) -> str | None:
    """None when ``linear(y, weight, bias)`` leaves nothing of ``y`` saved once it is ``fuser::linear_normed`` (or
    is frozen: then it saves nothing of ``y`` as it is); else why not."""
    w, out = tensor_meta(weight), tensor_meta(linear)
    if w is None or not w.requires_grad:
        return None
    name = f"`{linear.name}`"
    if w.dim() != 2 or w.dtype not in FLOAT_DTYPES:
        return f"{name} trains a weight of rank {w.dim()} and dtype {w.dtype}, not a 2-D fp16/bf16/fp32 one"
    if out is None or out.dtype not in FLOAT_DTYPES:
        return f"{name} returns {None if out is None else out.dtype}, not fp16/bf16/fp32"
    b = tensor_meta(bias) if bias is not None else None
    if bias is not None and (b is None or b.dtype not in FLOAT_DTYPES):
        return f"{name} adds a bias that is not an fp16/bf16/fp32 tensor"
    return None


def trainable_projections(y: torch.fx.Node, config: FuserConfig) -> list[torch.fx.Node] | None:
    """The linears of a trainable weight that read ``y`` (an RMSNorm's output) when every reader of ``y`` is a
    projection that leaves nothing of it saved (a frozen linear, a trainable one that can rebuild it, a LoRA A that
    rebuilds it: ``fuser::upcast_linear`` with ``rms_norm_linear.lora``); None when anything else reads it (then
    ``y`` is saved anyway, and a rebuild would only add work)."""
    trainable = []
    for user in value_readers(y):
        if user.op == "call_function" and user.target in _LORA_A_OPS and user.args[0] is y:
            if not config.rms_norm_linear.lora:
                return None
            continue
        c = canonical(user)
        if c is None or c.op != "linear" or c.args[0] is not y or y in c.args[1:]:
            return None
        bias = c.args[2] if len(c.args) > 2 else None
        if why_not_rebuilt(user, c.args[1], bias, y) is not None:
            return None
        if tensor_meta(c.args[1]).requires_grad:
            trainable.append(user)
    return trainable


_LORA_A_OPS = (torch.ops.fuser.upcast_linear.default, torch.ops.fuser.upcast_linear_normed.default)


def _cast_for(graph: torch.fx.Graph, value: object, dtype: torch.dtype, before: torch.fx.Node) -> object:
    """``value`` as ``dtype``: itself where it already is (or is not a tensor), else a ``value.to(dtype)`` inserted
    before ``before``."""
    t = tensor_meta(value)
    if t is None or t.dtype == dtype:
        return value
    with graph.inserting_before(before):
        cast = CastTo(value, dtype).build(graph)
    copy_source_meta(before, cast)
    cast.meta["example_value"] = t.to(dtype)
    return cast


def rebuild_in_projections(graph: torch.fx.Graph, config: FuserConfig) -> int:
    """``linear(y, W, b)`` with ``y`` an RMSNorm's output that only projections read and ``W`` trainable →
    ``linear_normed(y, h, rstd, norm weight, offset, W, b, dtype)`` (``src/fuser/kernels/linear_normed.py``), whose
    backward rebuilds ``y`` from the norm's input and rstd instead of saving it. Returns how many.

    Under autocast (fp32 ``y`` and weights, a bf16 matmul) the casts to the matmul's dtype are the graph's, one
    ``.to`` per projection as autocast's own, not the op body's: Inductor then casts the norm's output once for all
    its projections (their forward casts are one expression) and each weight once, for the forward and the saved
    copy the backward reads, where the op's body cast ``y`` once per projection and each weight a second time, in
    eager kernels, a cast per projection and layer that took measurable time in an autocast step
    (``docs/notes/kernels.md``, autocast casts). The gradients are the same
    values: the op's bf16 dx and dW, cast to fp32 by each ``.to``'s backward, each projection's dx its own term
    of the fp32 sum, as eager autocast sums them."""
    n = 0
    for node in list(graph.nodes):
        found = norm_of(node) if node.op == "call_function" else None
        if found is None:
            continue
        projections = trainable_projections(node, config)
        if not projections:
            continue
        norm, h, (weight, offset) = found
        h = norm_output(graph, norm, 2) if h is None else h
        rstd = norm_output(graph, norm, 1)
        for linear in projections:
            c = canonical(linear)
            bias = c.args[2] if len(c.args) > 2 else None
            dtype = tensor_meta(linear).dtype
            y, w, b = (_cast_for(graph, v, dtype, linear) for v in (node, c.args[1], bias))
            args = (y, h, rstd, weight, offset, w, b, dtype)
            with graph.inserting_before(linear):
                fused = graph.call_function(torch.ops.fuser.linear_normed.default, args)
            fused.meta.update(linear.meta)
            linear.replace_all_uses_with(fused)
            graph.erase_node(linear)
            n += 1
    return n


def rebuild_and_add_residuals(graph: torch.fx.Graph, config: FuserConfig) -> int:
    """``rms_norm_linear``'s refinements: :func:`rebuild_in_projections`, then, when the ``rms_norm`` pattern (whose
    refinement it is, run after this one) is off, :func:`add_residuals_into_norms` for these norms."""
    n = rebuild_in_projections(graph, config)
    if not config.enabled("rms_norm"):
        n += add_residuals_into_norms(graph, config)
    return n


REFINEMENT = Refinement(rebuild_and_add_residuals)
