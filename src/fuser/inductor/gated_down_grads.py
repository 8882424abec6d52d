"""The gated MLP's post-grad pass: the down projection's gradients and the gated backward as one op.

Under full fine-tuning the down projection is ``fuser::linear_gated`` (it saves gate and up, not the product), and
Inductor's post-grad backward graph holds

    dx, dW, db = fuser::linear_gated_grads(dy, gate, up, W, …, need_x=True, need_w=True, need_b)
    dgate, dup = fuser::gated_activation_backward(dx, gate, up, …)      (or its in-place form, over gate and up)

where the first recomputes the product ``act(gate) · up`` for dW with the forward kernel (a pass over gate and up)
and the second reads gate and up again. ``fuser::gated_down_grads`` (src/fuser/kernels/linear_gated.py) does both with
one pass: its backward kernel also writes the product, over dx. On Llama-3.2-1B (8192 × 8192 per layer, bf16)
that is two 128 MiB reads and a kernel launch fewer per layer.

A pair is rewritten only when

- the first call asks for dx and dW, and its dx is read by nothing but the gated backward, as its dout;
- the gated backward reads the same gate and up nodes, asks for dgate and dup and no LoRA gradients, with the same
  activation;
- for the in-place gated backward (``fuser.inductor.gated_mlp_inplace`` ran first): nothing but the two calls
  reads gate's or up's storage between them, since the fused op writes over them at the first call's place.

The values are the same as the pair's: the product is formed as the forward kernel forms it. Off with
``options={"experimental.gated_mlp.backward_writes_product": False}``.
"""

from __future__ import annotations

import logging
import operator
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

import fuser.kernels.linear_gated  # noqa: F401  (registers the fuser:: down-projection ops)
from fuser.engine.protocol import PostGradPass, call_args
from fuser.inductor.gated_mlp_inplace import _storage, _storages

if TYPE_CHECKING:
    from fuser.config import FuserConfig

log = logging.getLogger("fuser")

_GATED_BACKWARDS = (
    torch.ops.fuser.gated_activation_backward.default,
    torch.ops.fuser.gated_activation_backward_.default,
)


def _items(node: torch.fx.Node) -> dict[int, torch.fx.Node] | None:
    """The ``getitem`` users of a multi-output call by index, or None where something else reads the call."""
    items = {}
    for user in node.users:
        if user.target is not operator.getitem:
            return None
        items[user.args[1]] = user
    return items


def _judge(node: torch.fx.Node, order, by_storage) -> tuple[Any, str | None]:
    """(the plan's entry, None) where the ``linear_gated_grads`` call ``node`` and the gated backward of its dx can
    be one op, else (None, why not)."""
    args = call_args(node)
    if not (args["need_x"] and args["need_w"]):
        return None, "dx and dW are not both asked for"
    items = _items(node)
    if items is None or 0 not in items:
        return None, "an unexpected use of the result"
    dx = items[0]
    if len(dx.users) != 1:
        return None, "dx is not read by exactly one node"
    backward = next(iter(dx.users))
    if backward.target not in _GATED_BACKWARDS:
        return None, f"dx is read by {backward.target}, not the gated backward"
    theirs = call_args(backward)
    if theirs["dout"] is not dx or dx in (theirs["g"], theirs["u"]):
        return None, "dx is not the gated backward's dout alone"
    if (theirs["g"], theirs["u"], theirs["activation"]) != (args["gate"], args["up"], args["activation"]):
        return None, "the gated backward reads another gate, up or activation"
    in_place = backward.target is torch.ops.fuser.gated_activation_backward_.default
    if in_place:
        for name in ("g", "u"):
            storage = _storage(theirs[name])
            for alias in by_storage.get(storage, ()) if storage is not None else ():
                for user in alias.users:
                    if user not in (node, backward) and order[node] < order[user] < order[backward]:
                        return None, f"{user.name} reads {name} between the two calls"
    else:
        wanted = tuple(theirs[k] for k in ("gate_grad", "up_grad", "gate_lora_grad", "up_lora_grad"))
        if wanted != (True, True, False, False):
            return None, "not exactly dgate and dup are asked for"
        their_items = _items(backward)
        if their_items is None or any(i not in (0, 1) and user.users for i, user in their_items.items()):
            return None, "a LoRA gradient output is used"
    return (node, args, items, backward, in_place), None


def plan_gated_down_grads(graph: torch.fx.Graph) -> list:
    """Each ``linear_gated_grads`` call of ``graph`` that can join the gated backward of its dx, with what the
    rewrite needs; reads the graph only (the declines are logged at debug level)."""
    calls = [
        n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.fuser.linear_gated_grads.default
    ]
    if not calls:
        return []
    order, by_storage = _storages(graph)
    plan = []
    for node in calls:
        entry, reason = _judge(node, order, by_storage)
        if reason is not None:
            log.debug("fuser: %s keeps its own recompute of the product: %s", node.name, reason)
        else:
            plan.append(entry)
    return plan


def apply_gated_down_grads(graph: torch.fx.Graph, plan: list) -> int:
    for node, args, items, backward, in_place in plan:
        inputs = tuple(args[k] for k in ("dy", "gate", "up", "weight", "gate_scale", "up_scale", "activation"))
        op = torch.ops.fuser.gated_down_grads_ if in_place else torch.ops.fuser.gated_down_grads
        with graph.inserting_before(node):
            fused = graph.call_function(op.default, (*inputs, args["need_b"]))
        dw_val, db_val = node.meta["val"][1], node.meta["val"][2]
        grads_val = () if in_place else tuple(backward.meta["val"][:2])
        fused.meta["val"] = (*grads_val, dw_val, db_val)
        # dgate and dup: the fused op's first outputs (the in-place backward's users already read gate and up)
        if not in_place:
            for index, user in (_items(backward) or {}).items():
                if index in (0, 1):
                    with graph.inserting_after(fused):
                        item = graph.call_function(operator.getitem, (fused, index))
                    item.meta.update(user.meta)
                    user.replace_all_uses_with(item)
                graph.erase_node(user)
        graph.erase_node(backward)
        first_grad = 0 if in_place else 2
        for index, user in items.items():
            if index in (1, 2) and user.users:
                with graph.inserting_after(fused):
                    item = graph.call_function(operator.getitem, (fused, first_grad + index - 1))
                item.meta.update(user.meta)
                user.replace_all_uses_with(item)
        for user in list(node.users):
            graph.erase_node(user)
        graph.erase_node(node)
    if plan:
        log.info("fuser: %d down projection(s) take the product from the gated backward", len(plan))
    return len(plan)


def backward_writes_product(config: FuserConfig) -> bool:
    return config.experimental.gated_mlp.backward_writes_product


PASS = PostGradPass("gated_down_grads", plan_gated_down_grads, apply_gated_down_grads, backward_writes_product)
