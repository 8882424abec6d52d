"""Refinements of ``upcast_linear``'s ops (peft's LoRA A of a half-precision model), as ``config`` asks: an input
that a gated MLP's fused product is recomputed in the backward (``fuser::upcast_linear_gated``), upcast linears of
one input grouped into one op, and a norm's output rebuilt in the backward (``fuser::upcast_linear_normed``, the
``rms_norm_linear`` pattern's, with ``rms_norm_linear.lora``). Reads the norms as the norm refinements leave them
(an ``add_rms_norm`` too), so it runs after those."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx

import fuser.kernels.upcast_linear  # noqa: F401  (registers torch.ops.fuser.upcast_linear*)
from fuser.engine.canonical import canonical, tensor_meta
from fuser.engine.protocol import Refinement
from fuser.engine.rewrite import copy_source_meta
from fuser.kernels.upcast_linear import TRITON_MAX_OUT
from fuser.refinements.gated_down_projection import plain_gated_product, swap_in_gated_linear
from fuser.refinements.norm_projections import norm_of, norm_output

if TYPE_CHECKING:
    from fuser.config import FuserConfig


def recompute_gated_inputs(graph: torch.fx.Graph, config: FuserConfig) -> int:
    """``upcast_linear(x, W, b, allow_triton=t)`` with ``x = gated_activation(gate, up, None, None, ...)[0]`` →
    ``upcast_linear_gated(x, gate, up, W, b, ..., allow_triton=t)``, unless
    ``config.upcast_linear.recompute_gated_input`` is off; returns how many."""
    if not config.upcast_linear.recompute_gated_input:
        return 0
    upcast_op = torch.ops.fuser.upcast_linear.default
    n = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not upcast_op or set(node.kwargs) - {"allow_triton"}:
            continue
        product = plain_gated_product(node.args[0])
        if product is None:
            continue
        swap_in_gated_linear(graph, node, torch.ops.fuser.upcast_linear_gated.default, node.args, product, node.kwargs)
        n += 1
    return n


def _groups(nodes: list[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    """``nodes`` (in graph order) in consecutive runs of at most ``TRITON_MAX_OUT`` weight rows in all."""
    groups: list[list[torch.fx.Node]] = []
    rows = 0
    for node in nodes:
        n = tensor_meta(node.args[1]).shape[0]
        if groups and rows + n <= TRITON_MAX_OUT:
            groups[-1].append(node)
            rows += n
        else:
            groups.append([node])
            rows = n
    return [g for g in groups if len(g) > 1]


def _graph_input(node: object) -> bool:
    return isinstance(node, torch.fx.Node) and node.op in ("placeholder", "get_attr")


def _cast_of_graph_input(node: object) -> bool:
    """A dtype cast of a graph input (an adapter rounded as autocast rounds it) that reads graph inputs only."""
    c = canonical(node)
    return c is not None and c.op == "to" and all(_graph_input(n) for n in node.all_input_nodes)


def _groupable(node: torch.fx.Node) -> bool:
    """A plain ``fuser::upcast_linear(x, W, None)``: no bias, a 2-D weight of static rows (≤ 64) with its metadata,
    that can move up to the group's first call: a graph input, or a cast of one."""
    if node.op != "call_function" or node.target is not torch.ops.fuser.upcast_linear.default:
        return False
    if len(node.args) != 3 or node.args[2] is not None or set(node.kwargs) - {"allow_triton"}:
        return False
    weight, example = node.args[1], tensor_meta(node)
    w = tensor_meta(weight)
    if w is None or example is None or w.dim() != 2 or not isinstance(w.shape[0], int):
        return False
    movable = _graph_input(weight) or (_cast_of_graph_input(weight) and len(weight.users) == 1)
    return movable and w.shape[0] <= TRITON_MAX_OUT


def group_shared_inputs(graph: torch.fx.Graph, config: FuserConfig) -> int:
    """``upcast_linear(x, W_i)`` for several ``W_i`` of one ``x`` (and the same options) → ``y =
    upcast_linear(x, cat(W_i))`` and ``narrow(y, -1, …)`` in each one's place, unless
    ``config.experimental.upcast_linear.group_shared_inputs`` is off; returns how many calls were grouped."""
    if not config.experimental.upcast_linear.group_shared_inputs:
        return 0
    by_input: dict[tuple, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if _groupable(node):  # one input, one weight dtype, the same options
            key = (node.args[0], tensor_meta(node.args[1]).dtype, tuple(sorted(node.kwargs.items())))
            by_input.setdefault(key, []).append(node)
    n = 0
    for nodes in by_input.values():
        for group in _groups(nodes):
            _merge(graph, group)
            n += len(group)
    return n


def _merge(graph: torch.fx.Graph, group: list[torch.fx.Node]) -> None:
    first = group[0]
    weights = [node.args[1] for node in group]
    for weight in weights:
        if _cast_of_graph_input(weight):
            first.prepend(weight)  # a later call's cast, made from a graph input: it can move up
    with graph.inserting_before(first):
        cat = graph.call_function(torch.cat, (weights, 0))
        merged = graph.call_function(torch.ops.fuser.upcast_linear.default, (first.args[0], cat, None),
                                     dict(first.kwargs))  # fmt: skip
    cat.meta["example_value"] = torch.cat([tensor_meta(w) for w in weights], 0)
    merged.meta["example_value"] = torch.cat([tensor_meta(node) for node in group], -1)
    copy_source_meta(first, cat, merged)
    start = 0
    for node in group:
        rows = tensor_meta(node.args[1]).shape[0]
        with graph.inserting_after(merged):
            piece = graph.call_function(torch.narrow, (merged, -1, start, rows))
        piece.meta["example_value"] = merged.meta["example_value"].narrow(-1, start, rows)
        copy_source_meta(node, piece)
        node.replace_all_uses_with(piece)
        graph.erase_node(node)
        start += rows


def recompute_normed_inputs(graph: torch.fx.Graph, config: FuserConfig) -> int:
    """``upcast_linear(y, W, b)`` with ``y`` an RMSNorm's output (peft's LoRA A of q/k/v, gate/up) →
    ``upcast_linear_normed(y, h, rstd, norm weight, offset, W, b)``, whose backward rebuilds ``y`` from the norm's
    input and rstd (saved for the norm's own backward) instead of saving it: the ``rms_norm_linear`` pattern's
    refinement, when it is enabled with ``rms_norm_linear.lora``. Returns how many."""
    if not (config.enabled("rms_norm_linear") and config.rms_norm_linear.lora):
        return 0
    n = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.fuser.upcast_linear.default:
            continue
        found = norm_of(node.args[0])
        if found is None:
            continue
        norm, h, (weight, offset) = found
        if h is None:
            h = norm_output(graph, norm, 2)
        rstd = norm_output(graph, norm, 1)
        x, w, bias = node.args[:3]
        with graph.inserting_before(node):
            refined = graph.call_function(torch.ops.fuser.upcast_linear_normed.default,
                                          (x, h, rstd, weight, offset, w, bias), dict(node.kwargs))  # fmt: skip
        refined.meta.update(node.meta)
        node.replace_all_uses_with(refined)
        graph.erase_node(node)
        n += 1
    return n


def refine_upcast_linears(graph: torch.fx.Graph, config: FuserConfig) -> int:
    """The upcast linears' refinements, as ``config`` asks: the gated input recomputed, the shared inputs grouped,
    then a norm's output rebuilt in the backward (``rms_norm_linear``)."""
    return (
        recompute_gated_inputs(graph, config)
        + group_shared_inputs(graph, config)
        + recompute_normed_inputs(graph, config)
    )


REFINEMENT = Refinement(refine_upcast_linears, after=("rms_norm_linear", "rms_norm"))
