"""The gated MLP's post-grad passes: its backward writes its gradients over its inputs where nothing reads them after.

``fuser::gated_activation_backward(dout, g, u, ...)`` reads gate and up (``[tokens, intermediate]``, the widest
tensors of a layer) and writes dgate and dup of the same shape: at that moment four such buffers are live, five
with the product's gradient. In a checkpointed layer the backward graph itself recomputes gate and up, and the
gated backward is their last reader; then ``fuser::gated_activation_backward_`` writes dgate over gate and dup
over up, and the peak of the layer's backward holds two of those buffers fewer.

The passes run on Inductor's post-grad graphs (functional, after AOT autograd's partition; fuser installs them as
``post_grad_custom_post_pass``), once per forward and backward graph: swiglu and geglu declare them
(``Pattern.post_grad``), and the backend runs them without knowing what they do. Each rewrites a call only when it
is sure that no one can observe the mutation; otherwise it declines and says why at debug level:

- only dgate and dup are asked for (no LoRA-dtype gradients),
- g and u are distinct tensors, neither shares storage with dout,
- neither is (a view of) a graph input: a saved activation belongs to autograd, which may run the backward again
  with ``retain_graph=True``; this is why an un-checkpointed step (gate and up saved) is left alone,
- no node that shares their storage is read after the call (graph outputs included),
- both are contiguous (the kernel writes a ``[rows, n_cols]`` view of each).

A second rewrite serves the same moment: the down projection's gradient is the base projection's ``mm`` plus
the LoRA A adapter's dx (``fuser::upcast_linear_gated_grads``), summed by an ``add`` into a third buffer. Where
the ``mm``'s result is read by nothing but that ``add``, ``fuser::upcast_linear_gated_grads_acc_`` adds the dx
into it instead (same rounding as the ``add``), at the ``add``'s place: two such buffers fewer.

Inductor orders the earlier reads of a mutated tensor before the mutating kernel (its scheduler tracks mutations
of fallback kernels' arguments), the same mechanism its own re-inplacing of ``auto_functionalized`` relies on.

``options={"experimental.gated_mlp.backward_in_place": False}`` switches both rewrites off: each of :data:`PASSES` is
then not enabled.
"""

from __future__ import annotations

import logging
import operator
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

import fuser.kernels.gated_activation  # noqa: F401  (registers the fuser:: gated ops)
from fuser._compat import has_storage
from fuser.engine.protocol import PostGradPass, call_args

if TYPE_CHECKING:
    from fuser.config import FuserConfig

log = logging.getLogger("fuser")

_META_ONLY = {
    torch.ops.aten.sym_size.int,
    torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_storage_offset.default,
}


def _storage(node: Any) -> int | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or not has_storage(val):
        return None
    return val.untyped_storage()._cdata


def _calls(graph: torch.fx.Graph, target: Any) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is target]


def _storages(graph: torch.fx.Graph) -> tuple[dict[torch.fx.Node, int], dict[int, list]]:
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_storage: dict[int, list] = defaultdict(list)
    for n in graph.nodes:
        storage = _storage(n)
        if storage is not None:
            by_storage[storage].append(n)
    return order, by_storage


def _unobserved_reason(name: str, t: torch.fx.Node, node: torch.fx.Node, order, by_storage) -> str | None:
    """Why overwriting ``t`` at ``node`` could be observed (or None): a graph input shares its storage, or
    something other than ``node`` reads that storage after ``node``, or it is not contiguous."""
    val = t.meta.get("val")
    storage = _storage(t)
    if storage is None:
        return f"{name} has no known storage"
    if not val.is_contiguous():
        return f"{name} is not contiguous"
    for alias in by_storage[storage]:
        if alias.op in ("placeholder", "get_attr"):
            return f"{name} is (a view of) a graph input, e.g. a saved activation"
        for user in alias.users:
            if user is node or user.target in _META_ONLY:
                continue
            if order[user] > order[node]:
                return f"{name} is read after the backward (by {user.name})"
    return None


def _decline_reason(
    node: torch.fx.Node, args: dict[str, Any], order: dict[torch.fx.Node, int], by_storage: dict[int, list]
) -> str | None:
    """Why the call at ``node`` must stay out of place, or None when writing over g and u is safe."""
    if (args["gate_grad"], args["up_grad"], args["gate_lora_grad"], args["up_lora_grad"]) != (True, True, False, False):
        return "not exactly dgate and dup are asked for"
    dout, g, u = args["dout"], args["g"], args["u"]
    if not all(isinstance(t, torch.fx.Node) for t in (dout, g, u)):
        return "an input is not a graph node"
    storages = [_storage(t) for t in (dout, g, u)]
    if None in storages:
        return "an input has no known storage"
    if len(set(storages)) != 3:
        return "dout, g and u share storage"
    for name, t in (("g", g), ("u", u)):
        reason = _unobserved_reason(name, t, node, order, by_storage)
        if reason is not None:
            return reason
    for user in node.users:
        if user.target is not operator.getitem or user.args[1] not in (0, 1, 2, 3):
            return f"an unexpected use of the result ({user.name})"
        if user.args[1] in (2, 3) and user.users:
            return "a LoRA gradient output is used"
    return None


def _plan(graph: torch.fx.Graph, op: Any, judge: Callable[..., tuple[Any, str | None]]) -> list:
    """What ``judge(node, args, order, by_storage)`` returns as its entry, ``(entry, None)``, for each call of
    ``op`` in ``graph`` it accepts; a decline, ``(None, why not)``, is logged. Reads the graph only."""
    candidates = _calls(graph, op)
    if not candidates:
        return []
    order, by_storage = _storages(graph)
    plan = []
    for node in candidates:
        entry, reason = judge(node, call_args(node), order, by_storage)
        if reason is not None:
            log.debug("fuser: %s stays out of place: %s", node.name, reason)
        else:
            plan.append(entry)
    return plan


def _done(plan: list, what: str) -> int:
    if plan:
        log.info("fuser: %d %s", len(plan), what)
    return len(plan)


def plan_gated_backward(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, dict[str, Any]]]:
    """The ``fuser::gated_activation_backward`` calls of ``graph`` that can write over g and u, with their
    arguments; reads the graph only (the declines are logged)."""

    def judge(node, args, order, by_storage):
        return (node, args), _decline_reason(node, args, order, by_storage)

    return _plan(graph, torch.ops.fuser.gated_activation_backward.default, judge)


def apply_gated_backward(graph: torch.fx.Graph, plan: list[tuple[torch.fx.Node, dict[str, Any]]]) -> int:
    for node, args in plan:
        with graph.inserting_before(node):
            inplace = graph.call_function(
                torch.ops.fuser.gated_activation_backward_.default,
                (args["dout"], args["g"], args["u"], args["gate_scale"], args["up_scale"], args["activation"]),
            )
        inplace.meta["val"] = None
        for user in list(node.users):
            index = user.args[1]
            if index in (0, 1):
                user.replace_all_uses_with(args["g"] if index == 0 else args["u"])
            graph.erase_node(user)
        graph.erase_node(node)
    return _done(plan, "gated backward(s) write their gradients over gate and up")


def reinplace_gated_backward(graph: torch.fx.Graph) -> int:
    """Rewrite the safe ``fuser::gated_activation_backward`` calls of ``graph`` in place; the number rewritten."""
    return apply_gated_backward(graph, plan_gated_backward(graph))


def _single_add_of_dx(node: torch.fx.Node) -> tuple[torch.fx.Node | None, torch.fx.Node | None, str | None]:
    """(the ``add`` that sums dx with another tensor, that tensor, None) or (None, None, why not)."""
    dx_items = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
    if len(dx_items) != 1 or len(dx_items[0].users) != 1:
        return None, None, "dx is not read by exactly one node"
    add = next(iter(dx_items[0].users))
    if add.target is not torch.ops.aten.add.Tensor or len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1:
        return None, None, f"dx is read by {add.target}, not a plain add"
    other = add.args[1] if add.args[0] is dx_items[0] else add.args[0]
    if other is dx_items[0] or not isinstance(other, torch.fx.Node):
        return None, None, "dx is added to itself or a number"
    val, out = other.meta.get("val"), add.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(out, torch.Tensor):
        return None, None, "no tensor metadata"
    if val.shape != out.shape or val.dtype != out.dtype:
        return None, None, "the add broadcasts or promotes"
    return add, other, None


def plan_gated_dx(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, dict[str, Any], torch.fx.Node, torch.fx.Node]]:
    """(``upcast_linear_gated_grads`` call, its arguments, the ``add``, the summand) for each call whose dx can be
    added into the summand; reads the graph only (the declines are logged)."""

    def judge(node, args, order, by_storage):
        add, other, reason = _single_add_of_dx(node) if args["need_x"] else (None, None, "dx not asked for")
        if reason is None:
            inputs = [args[k] for k in ("dy", "gate", "up", "weight")]
            if _storage(other) in {_storage(t) for t in inputs if isinstance(t, torch.fx.Node)}:
                reason = "the summand shares storage with an input"
            else:
                reason = _unobserved_reason("the summand", other, add, order, by_storage)
        return (node, args, add, other), reason

    return _plan(graph, torch.ops.fuser.upcast_linear_gated_grads.default, judge)


def apply_gated_dx(graph: torch.fx.Graph, plan: list) -> int:
    for node, args, add, other in plan:
        with graph.inserting_before(add):
            acc = graph.call_function(
                torch.ops.fuser.upcast_linear_gated_grads_acc_.default,
                (other, *[args[k] for k in ("dy", "gate", "up", "weight", "gate_scale", "up_scale", "activation")],
                 args["need_w"], args["allow_triton"]),
            )  # fmt: skip
        acc.meta["val"] = node.meta["val"][1]
        add.replace_all_uses_with(other)
        graph.erase_node(add)
        for user in list(node.users):
            if user.args[1] == 1:
                user.replace_all_uses_with(acc)
            graph.erase_node(user)
        graph.erase_node(node)
    return _done(plan, "down-projection dx(s) added into the base projection's gradient")


def accumulate_gated_dx(graph: torch.fx.Graph) -> int:
    """Rewrite ``add(upcast_linear_gated_grads(...)[0], y)`` into ``upcast_linear_gated_grads_acc_(y, ...)`` where
    ``y`` can be overwritten unobserved; the number rewritten."""
    return apply_gated_dx(graph, plan_gated_dx(graph))


def backward_in_place(config: FuserConfig) -> bool:
    return config.experimental.gated_mlp.backward_in_place


# the post-grad passes of swiglu and geglu, in the order they run. The backend catches a failing plan (which has not
# touched the graph) and leaves the graph as it was; the edits themselves are a few FX calls.
PASSES = (
    PostGradPass("gated_dx_accumulated", plan_gated_dx, apply_gated_dx, backward_in_place),
    PostGradPass("gated_backward_in_place", plan_gated_backward, apply_gated_backward, backward_in_place),
)
