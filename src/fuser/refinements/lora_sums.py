"""Refinements of ``lora_sum``'s ops: keep a LoRA sum's fp32 value where its consumer would (a gated activation, a
residual add and the norm after it, RoPE, a norm), since a bf16 rounding of ``base + s · lora`` erases a LoRA term
below half the base's ulp and Inductor, which fuses peft's cast into the consumer, does not round there; then, for
the sums that stay rounded, the base's fp32 value (``experimental.lora_sum.fp32_base``). Runs after the norms'
refinements, which leave the adds of LoRA sums to it."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
import torch.fx

import fuser.kernels.lora_sum  # noqa: F401  (registers torch.ops.fuser.lora_sum)
import fuser.kernels.rms_norm  # noqa: F401  (registers torch.ops.fuser.rms_norm and add_rms_norm)
from fuser._compat import statically_same_shape
from fuser.engine.canonical import canonical, dtype_of, tensor_meta, value_readers
from fuser.engine.match import is_symbolic_scalar
from fuser.engine.protocol import Refinement
from fuser.engine.rewrite import copy_source_meta

if TYPE_CHECKING:
    from fuser.config import FuserConfig


def _rounded_sums(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The ``fuser::lora_sum`` calls that still round their sum to the base dtype (no refinement has touched them),
    and that something uses. QLoRA's order is not among them: it rounds the term itself, nothing to keep."""
    return [
        node
        for node in graph.nodes
        if node.op == "call_function"
        and node.target is torch.ops.fuser.lora_sum.default
        and len(node.args) in (4, 5)
        and not (len(node.args) == 5 and node.args[4])
        and node.users
    ]


def _keep_fp32(node: torch.fx.Node, views: tuple[torch.fx.Node, ...] = ()) -> None:
    """Make ``node`` (a rounded LoRA sum) return its fp32 sum; ``views`` of it carry fp32 too."""
    base, a, w, scale = node.args[:4]
    node.args = (base, a, w, scale, False, torch.float32)
    for changed in (node, *views):
        example = changed.meta.get("example_value")
        if example is not None:
            changed.meta["example_value"] = example.to(torch.float32)


def _split_wide(graph: torch.fx.Graph, node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    """Replace ``node`` (a rounded LoRA sum) by ``fuser::lora_sum_wide``: returns its (rounded, fp32) results; the
    rounded one takes every use of ``node``."""
    base, a, w, scale = node.args[:4]
    with graph.inserting_before(node):
        pair = graph.call_function(torch.ops.fuser.lora_sum_wide.default, (base, a, w, scale), dict(node.kwargs))
        narrow = graph.call_function(operator.getitem, (pair, 0))
        wide = graph.call_function(operator.getitem, (pair, 1))
    example = node.meta.get("example_value")
    if example is not None:
        pair.meta["example_value"] = (example, example.to(torch.float32))
        narrow.meta["example_value"] = example
        wide.meta["example_value"] = pair.meta["example_value"][1]
    copy_source_meta(node, pair, narrow, wide)
    node.replace_all_uses_with(narrow)
    graph.erase_node(node)
    return narrow, wide


def keep_wide_sums_for_gated_ops(graph: torch.fx.Graph) -> int:
    """A LoRA sum that feeds a gated activation as its gate or up → ``fuser::lora_sum_wide``: the gated op computes
    its product from the unrounded fp32 sum and saves the rounded one (rounding ``base + s · lora`` to
    bf16 erases a LoRA term smaller than half the base's ulp, and Inductor, which fuses peft's cast into the
    consumer, does not round there); returns how many sums."""
    import fuser.kernels.gated_activation  # noqa: F401  (registers torch.ops.fuser.gated_activation)

    gated_op = torch.ops.fuser.gated_activation.default
    n = 0
    for node in _rounded_sums(graph):
        slots = [
            (user, index)
            for user in node.users
            if user.op == "call_function" and user.target is gated_op and user.args[2] is None and user.args[3] is None
            for index, arg in enumerate(user.args[:2])
            if arg is node
        ]
        if not slots:
            continue
        _, wide = _split_wide(graph, node)
        for user, index in slots:
            user.kwargs = {**user.kwargs, ("gate_wide", "up_wide")[index]: wide}
        n += 1
    return n


_ADDS = (operator.add, torch.add)


def _residual_add(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    """``h + node`` (either order) of two tensors of node's dtype and shape, with no alpha: a residual add."""
    if user.op != "call_function" or user.target not in _ADDS or user.kwargs or len(user.args) != 2:
        return False
    other = user.args[1] if user.args[0] is node else user.args[0]
    if other is node or not isinstance(other, torch.fx.Node):
        return False
    mine, theirs, out = (tensor_meta(v) for v in (node, other, user))
    if mine is None or theirs is None or out is None:
        return False
    same_shape = statically_same_shape(theirs.shape, mine.shape) and statically_same_shape(mine.shape, out.shape)
    return theirs.dtype == mine.dtype == out.dtype and same_shape


def sum_into_residual_adds(graph: torch.fx.Graph) -> int:
    """A LoRA sum whose only users are residual adds (o_proj, down_proj: ``h = h + sum``) stays fp32 and each add
    rounds once, ``(h + sum).to(bf16)``: what Inductor computes from peft's graph, where the sum's own rounding
    would erase a LoRA term below half the base's ulp. Where the new residual feeds an RMSNorm (the
    next norm of every decoder layer), the add and the norm become one ``fuser::add_rms_norm``, which normalises
    the unrounded sum; elsewhere a norm of it gets the fp32 add as ``x_wide``. Returns how many sums."""
    n = 0
    order = {node: i for i, node in enumerate(graph.nodes)}  # the adds and the norms' arguments keep their order
    for node in _rounded_sums(graph):
        adds = value_readers(node)  # a query of the sum's shape reads the fp32 sum's as well
        if not adds or not all(_residual_add(user, node) for user in adds):
            continue
        half = tensor_meta(node).dtype
        _keep_fp32(node)
        for add in adds:
            with graph.inserting_after(add):
                rounded = graph.call_method("to", (add, half))
            add.replace_all_uses_with(rounded, delete_user_cb=lambda user, keep=rounded: user is not keep)
            example = add.meta.get("example_value")
            rounded.meta.update({k: v for k, v in add.meta.items() if k != "example_value"})
            if example is not None:
                rounded.meta["example_value"] = example
                add.meta["example_value"] = example.to(torch.float32)
            norms = _norms_of(rounded)  # the next norm reads the new residual: from the fp32 add
            if len(norms) == 1 and _absorb_add(graph, add, node, rounded, norms[0], order):
                continue
            for norm in norms:
                norm.kwargs = {**norm.kwargs, "x_wide": add}
        n += 1
    return n


def _absorb_add(
    graph: torch.fx.Graph,
    add: torch.fx.Node,
    node: torch.fx.Node,
    rounded: torch.fx.Node,
    norm: torch.fx.Node,
    order: dict[torch.fx.Node, int],
) -> bool:
    """``norm((h + sum).to(half))`` → ``fuser::add_rms_norm(h, sum, …)``, which computes the fp32 add, stores its
    rounding (the residual stream's next value: ``rounded``'s other users read it) and normalises the unrounded
    sum, in one kernel each way; the fp32 sum is never written. False (nothing changed) where the norm's
    arguments are not all defined before the add (``rounded`` follows it; ``order``: the graph's node positions
    before the refinement, a node new since then counts as after)."""
    if any(isinstance(arg, torch.fx.Node) and order.get(arg, len(order)) > order[add] for arg in norm.args[1:]):
        return False
    h = add.args[1] if add.args[0] is node else add.args[0]
    with graph.inserting_after(rounded):
        fused = graph.call_function(torch.ops.fuser.add_rms_norm.default, (h, node, *norm.args[1:6]))
    with graph.inserting_after(fused):
        total = graph.call_function(operator.getitem, (fused, 2))
    copy_source_meta(norm, fused, total)
    # the residual stream's next value keeps the metadata the other refinements read (its shape and dtype)
    total.meta.update({k: v for k, v in rounded.meta.items() if k not in fused.meta})
    norm.replace_all_uses_with(fused)  # its getitem 0 / 1 (y, rstd) are the fused op's
    rounded.replace_all_uses_with(total)
    for dead in (norm, rounded, add):
        graph.erase_node(dead)
    return True


def _norms_of(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The ``fuser::rms_norm`` calls that normalise ``node`` (as their x) and have no fp32 value for it yet."""
    return [
        user
        for user in node.users
        if user.op == "call_function"
        and user.target is torch.ops.fuser.rms_norm.default
        and user.args[0] is node
        and node not in user.args[1:]
        and user.kwargs.get("x_wide") is None
    ]


_VIEWS = ("view", "reshape", "transpose", "contiguous", "permute")


def _chain_to_rope(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The views from ``node`` to a ``fuser::rope`` that rotates it (as q or k), if every path leads there; else
    None."""
    chain: list[torch.fx.Node] = []
    for user in value_readers(node):
        if user.op == "call_function" and user.target is torch.ops.fuser.rope.default:
            if node not in user.args[:2] or node in user.args[2:]:
                return None
            continue
        if user.op != "call_method" or user.target not in _VIEWS or user.args[0] is not node:
            return None
        rest = _chain_to_rope(user)
        if rest is None:
            return None
        chain += [user, *rest]
    return chain


def sum_into_rope(graph: torch.fx.Graph) -> int:
    """A LoRA sum that only RoPE reads (q_proj, k_proj, through views) stays fp32: the rope op reads the fp32 q or
    k and rounds its rotated result once, as Inductor computes peft's cast fused into the rotation.
    Returns how many sums."""
    n = 0
    for node in _rounded_sums(graph):
        chain = _chain_to_rope(node)
        if chain is None:
            continue
        _keep_fp32(node, tuple(chain))
        n += 1
    return n


def _chain_to_norms(node: torch.fx.Node) -> list[tuple[torch.fx.Node, torch.fx.Node]] | None:
    """``(node's view or node itself, the norm that reads it)`` for every path from ``node`` through views, if
    every path ends at a ``fuser::rms_norm`` that normalises it (q/k norms, Gemma's post-projection norms); else
    None."""
    found: list[tuple[torch.fx.Node, torch.fx.Node]] = []
    norms = _norms_of(node)
    for user in value_readers(node):
        if user in norms:
            found.append((node, user))
            continue
        if user.op != "call_method" or user.target not in _VIEWS or user.args[0] is not node:
            return None
        # a view whose shape is computed from tensors in the graph is not copied onto the fp32 value; a symbolic
        # size (a dynamic-shape graph's sequence length) is a number defined before the view, which the copy reads
        if any(arg is not node and not is_symbolic_scalar(arg) for arg in user.all_input_nodes):
            return None
        rest = _chain_to_norms(user)
        if rest is None:
            return None
        found += rest
    return found


def sum_into_norms(graph: torch.fx.Graph) -> int:
    """A LoRA sum that only RMSNorms read (through views) → ``fuser::lora_sum_wide``: each norm is computed from the
    fp32 sum (its ``x_wide``, the same views applied) and saves the rounded one, as Inductor computes a norm fused
    with peft's cast. Returns how many sums."""
    n = 0
    for node in _rounded_sums(graph):
        uses = _chain_to_norms(node)
        if not uses:
            continue
        narrow, wide = _split_wide(graph, node)
        copies: dict[torch.fx.Node, torch.fx.Node] = {node: wide, narrow: wide}  # node: erased, read by a norm
        for view, norm in uses:
            wide_view = _copy_views(graph, view, narrow, copies)
            norm.kwargs = {**norm.kwargs, "x_wide": wide_view}
        n += 1
    return n


def _copy_views(
    graph: torch.fx.Graph, view: torch.fx.Node, narrow: torch.fx.Node, copies: dict[torch.fx.Node, torch.fx.Node]
) -> torch.fx.Node:
    """The fp32 counterpart of ``view`` (a chain of views from ``narrow``), built once per view."""
    if view not in copies:
        source = _copy_views(graph, view.args[0], narrow, copies)
        with graph.inserting_after(view):
            copy = graph.call_method(view.target, (source, *view.args[1:]), dict(view.kwargs))
        example = view.meta.get("example_value")
        if example is not None:
            copy.meta["example_value"] = example.to(torch.float32)
        copies[view] = copy
    return copies[view]


def _drop_dead_casts(graph: torch.fx.Graph) -> None:
    """Erase the casts and views nothing uses: the rewrite leaves a replaced block's input upcast (a norm's
    ``x.to(fp32)``) until Inductor compiles the graph, and a sum must not look used by it. Only these: a full
    dead-code pass would also take unused in-place calls (``x.mul_(…)`` as a call_method), which fx calls pure."""
    for node in reversed(graph.nodes):
        if node.op == "call_method" and node.target in ("to", "float", *_VIEWS) and not node.users:
            graph.erase_node(node)


def _plain_linear(node: torch.fx.Node, dtype: torch.dtype) -> tuple[torch.fx.Node, ...] | None:
    """``(x, weight[, bias])`` of a linear call (its arguments bound by name) whose inputs are all ``dtype``; else
    None."""
    c = canonical(node)
    if c is None or c.op != "linear":
        return None
    args = c.args if c.args[2] is not None else c.args[:2]
    if any(dtype_of(v) != dtype for v in args):
        return None
    return args


def sum_from_fp32_bases(graph: torch.fx.Graph) -> int:
    """A LoRA sum still rounded (no consumer took its fp32 value: v_proj's, read by attention) whose base is a
    linear read by nothing else → the base becomes ``fuser::linear_wide`` (its fp32 output, not rounded) and the
    sum rounds once: a LoRA term below half the base's ulp moves the rounded sum as often as it would move an
    fp32 model's, instead of never (``experimental.lora_sum.fp32_base``). Returns how many sums."""
    n = 0
    for node in _rounded_sums(graph):
        base = node.args[0]
        half = tensor_meta(node).dtype
        one_reader = isinstance(base, torch.fx.Node) and len(value_readers(base)) == 1
        operands = _plain_linear(base, half) if one_reader else None
        if operands is None:
            continue
        with graph.inserting_before(base):
            wide = graph.call_function(torch.ops.fuser.linear_wide.default, operands)
        example = base.meta.get("example_value")
        wide.meta.update({k: v for k, v in base.meta.items() if k != "example_value"})
        if example is not None:
            wide.meta["example_value"] = example.to(torch.float32)
        node.args = (wide, *node.args[1:4], False, half)
        base.replace_all_uses_with(wide)  # its shape queries: the fp32 output has its shape
        graph.erase_node(base)
        n += 1
    return n


def refine_lora_sums(graph: torch.fx.Graph, config: FuserConfig | None = None) -> int:
    """The refinements that keep a LoRA sum's fp32 value where its consumer would (a bf16 rounding of the sum
    erases a LoRA term below half the base's ulp), then, for the sums
    that stay rounded, the base's fp32 value (``experimental.lora_sum.fp32_base``)."""
    _drop_dead_casts(graph)
    n = (
        keep_wide_sums_for_gated_ops(graph)
        + sum_into_residual_adds(graph)
        + sum_into_rope(graph)
        + sum_into_norms(graph)
    )
    if config is None or config.experimental.lora_sum.fp32_base:
        n += sum_from_fp32_bases(graph)
    return n


REFINEMENT = Refinement(refine_lora_sums, after=("rms_norm_linear", "rms_norm"))
