"""A post-grad pass: an embedding's weight gradient, and a tied lm_head's gradient added to it, as one op
(``fuser::embedding_grad``, :mod:`fuser.kernels.embedding_grad`).

After Inductor's decompositions the backward graph of ``embedding(ids, W)`` scatters the output gradient into a
zero-filled fp32 ``[V, H]`` buffer, casts it to ``W``'s dtype, and, where ``W`` is tied to the lm_head, adds the
lm_head's gradient (scaled by the loss's gradient: fuser's fused loss computes its share in the forward):

    acc  = full([V, H], 0, fp32)
    acc  = index_put(acc, [ids], where(ids == padding_idx, 0, g), accumulate=True)   (torch ≤ 2.11)
         | _unsafe_masked_index_put_accumulate(acc, valid, [ids], g)                 (newer)
    grad = acc.to(W.dtype)                         (absent for an fp32 W)
    grad = dW_head * s + grad                      (a tied lm_head; the scale optional)

The op computes the same values (the scattered sum cast as the graph casts it, the lm_head's term in fp32, one
rounding) in one pass that writes ``[V, H]`` once, instead of a zero fill, a scatter and a pass that reads the fp32
buffer (what that saves: ``docs/defaults.md``, ``experimental.embedding_grads``).

A chain is taken only when the zero buffer and each intermediate are read by the next step alone, the buffer is
2-D, the ids are one integer index tensor, and the values are shaped ``ids.shape + [H]``; the lm_head term is an
add of one tensor of the gradient's shape and dtype (no alpha), optionally a product of such a tensor with a
0-dim tensor read by that add alone. Declines are logged at debug level. ``FuserConfig.experimental.embedding_grads``
switches it (on).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.fx

import fuser.kernels.embedding_grad  # noqa: F401  (registers fuser::embedding_grad)
from fuser._compat import statically_same_shape
from fuser.engine.canonical import tensor_meta
from fuser.engine.protocol import PostGradPass

if TYPE_CHECKING:
    from fuser.config import FuserConfig

log = logging.getLogger("fuser")

aten = torch.ops.aten
_INDEX_PUT = aten.index_put.default
_MASKED_INDEX_PUT = getattr(aten, "_unsafe_masked_index_put_accumulate", None)
_MASKED_INDEX_PUT = _MASKED_INDEX_PUT.default if _MASKED_INDEX_PUT is not None else None
_CONVERT = torch.ops.prims.convert_element_type.default


@dataclass
class _Chain:
    values: torch.fx.Node
    ids: torch.fx.Node
    valid: torch.fx.Node | None
    num_weights: int
    out_dtype: torch.dtype
    base: torch.fx.Node | None
    scale: torch.fx.Node | None
    erased: list[torch.fx.Node]  # the chain's nodes, the last first


def _call(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _zero_buffer(node) -> tuple[int, int] | None:
    """``node`` is ``full([V, H], 0)`` of fp32 (or fp64): its (V, H)."""
    if not _call(node, aten.full.default) or len(node.args) != 2 or node.args[1] != 0:
        return None
    meta = tensor_meta(node)
    if meta is None or meta.dim() != 2 or meta.dtype not in (torch.float32, torch.float64):
        return None
    v, h = meta.shape
    return (v, h) if isinstance(v, int) and isinstance(h, int) else None


def _scatter(node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node | None] | None:
    """``node`` scatter-adds into a zero buffer: (buffer, ids, values, valid) or None."""
    if _call(node, _INDEX_PUT):
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        if len(node.args) < 3 or accumulate is not True:
            return None
        buffer, indices, values = node.args[:3]
        valid = None
    elif _MASKED_INDEX_PUT is not None and _call(node, _MASKED_INDEX_PUT) and len(node.args) == 4:
        buffer, valid, indices, values = node.args
    else:
        return None
    if not isinstance(indices, (list, tuple)) or len(indices) != 1 or not isinstance(indices[0], torch.fx.Node):
        return None
    return buffer, indices[0], values, valid


def _judge(node: torch.fx.Node) -> tuple[_Chain | None, str | None]:
    """The chain that starts at the scatter ``node``, or why it stays as it is."""
    buffer, ids, values, valid = _scatter(node)
    size = _zero_buffer(buffer)
    if size is None or len(buffer.users) != 1:
        return None, "its buffer is not a zero fp32 [V, H] tensor read by the scatter alone"
    num_weights, n_cols = size
    ids_meta, values_meta = tensor_meta(ids), tensor_meta(values)
    if ids_meta is None or ids_meta.dtype not in (torch.int64, torch.int32):
        return None, "its index is not one integer tensor"
    if values_meta is None or not values_meta.is_floating_point():
        return None, "its values are not a floating-point tensor"
    if not statically_same_shape(values_meta.shape, (*ids_meta.shape, n_cols)):
        return None, "its values are not shaped ids.shape + [H]"
    if valid is not None:
        valid_meta = tensor_meta(valid)
        shape = tuple(valid_meta.shape) if valid_meta is not None else ()
        if shape[-1:] == (1,):
            shape = shape[:-1]  # the decomposition's unsqueeze(-1)
        if valid_meta is None or valid_meta.dtype != torch.bool or not statically_same_shape(shape, ids_meta.shape):
            return None, "its mask is not one bool per id"
    erased, last = [node, buffer], node
    out_dtype = tensor_meta(buffer).dtype
    user = _only_user(node)
    if user is None:
        return None, "the scattered sum has several readers"
    if _call(user, _CONVERT) and user.args[0] is node:
        erased.insert(0, user)
        last, out_dtype = user, user.args[1]
        user = _only_user(user)
    base = scale = None
    grad_meta = tensor_meta(last)
    if user is not None and _call(user, aten.add.Tensor) and not user.kwargs and len(user.args) == 2:
        other = user.args[1] if user.args[0] is last else user.args[0]
        other_meta = tensor_meta(other)
        if (
            other is not last
            and other_meta is not None
            and other_meta.dtype == out_dtype
            and statically_same_shape(other_meta.shape, grad_meta.shape)
            and tensor_meta(user) is not None
            and tensor_meta(user).dtype == out_dtype
        ):
            erased.insert(0, user)
            base = other
            scale_of = _scaled(other, out_dtype, grad_meta)
            if scale_of is not None:
                erased.insert(1, other)
                base, scale = scale_of
    return _Chain(values, ids, valid, num_weights, out_dtype, base, scale, erased), None


def _scaled(node, dtype: torch.dtype, like: torch.Tensor) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``node`` is ``mul(x, s)`` (either order) of an ``x`` shaped and typed as ``like`` and a 0-dim float tensor
    ``s``, read once: (x, s)."""
    if not _call(node, aten.mul.Tensor) or node.kwargs or len(node.args) != 2 or len(node.users) != 1:
        return None
    for x, s in (node.args, node.args[::-1]):
        x_meta, s_meta = tensor_meta(x), tensor_meta(s)
        if (
            x_meta is not None
            and s_meta is not None
            and x_meta.dtype == dtype
            and statically_same_shape(x_meta.shape, like.shape)
            and s_meta.dim() == 0
            and s_meta.is_floating_point()
        ):
            return x, s
    return None


def plan_embedding_grads(graph: torch.fx.Graph) -> list[_Chain]:
    plan = []
    for node in graph.nodes:
        if node.op != "call_function" or _scatter(node) is None:
            continue
        chain, reason = _judge(node)
        if reason is not None:
            log.debug("fuser: %s keeps its scatter-add: %s", node.name, reason)
        else:
            plan.append(chain)
    return plan


def apply_embedding_grads(graph: torch.fx.Graph, plan: list[_Chain]) -> int:
    for chain in plan:
        last = chain.erased[0]
        args = (chain.values, chain.ids, chain.valid, chain.num_weights, chain.out_dtype, chain.base, chain.scale)
        with graph.inserting_before(last):
            fused = graph.call_function(torch.ops.fuser.embedding_grad.default, args)
        fused.meta.update(last.meta)
        last.replace_all_uses_with(fused)
        for node in chain.erased:  # the last first: each is then unread
            graph.erase_node(node)
    if plan:
        log.info("fuser: %d embedding gradient(s) written in one pass", len(plan))
    return len(plan)


def embedding_grads(config: FuserConfig) -> bool:
    return config.experimental.embedding_grads


PASS = PostGradPass("embedding_grads", plan_embedding_grads, apply_embedding_grads, embedding_grads)
