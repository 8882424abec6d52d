"""Post-grad: the gated activation of two wide LoRA sums, in row slices. Where lora_sum's refinements gave a gated
activation the fp32 values of its gate and up sums (``fuser::lora_sum_wide``), one
``fuser::gated_activation_of_lora_sums`` computes both sums and the product row slice by row slice, so the fp32
sums are never written in full (``experimental.lora_sum.gated_in_slices``). The ``lora_sum`` pattern declares it
(``Pattern.post_grad``)."""

from __future__ import annotations

import logging
import operator
from typing import TYPE_CHECKING

import torch
import torch.fx

import fuser.kernels.lora_sum  # noqa: F401  (registers torch.ops.fuser.lora_sum_wide and the gated op of the sums)
from fuser.engine.canonical import tensor_meta
from fuser.engine.protocol import PostGradPass, call_args
from fuser.engine.rewrite import copy_source_meta

if TYPE_CHECKING:
    from fuser.config import FuserConfig

log = logging.getLogger("fuser")


def _contiguous(node: torch.fx.Node) -> bool:
    t = tensor_meta(node)
    return t is not None and t.is_contiguous()


def _wide_pair(narrow: object, wide: object) -> torch.fx.Node | None:
    """The ``fuser::lora_sum_wide`` call whose results are ``narrow`` (its [0], contiguous) and ``wide`` (its [1],
    read by one node), every user of the call one of those two results; None otherwise."""
    if not (isinstance(narrow, torch.fx.Node) and isinstance(wide, torch.fx.Node)):
        return None
    if narrow.target is not operator.getitem or wide.target is not operator.getitem:
        return None
    pair = wide.args[0]
    if narrow.args != (pair, 0) or wide.args != (pair, 1) or len(wide.users) != 1:
        return None
    if not isinstance(pair, torch.fx.Node) or pair.target is not torch.ops.fuser.lora_sum_wide.default:
        return None
    if any(u.target is not operator.getitem or u.args[1] not in (0, 1) for u in pair.users):
        return None
    return pair if _contiguous(narrow) else None


# a planned rewrite: the gated call, its gate's and up's lora_sum_wide calls, and their rounded results it reads
GatedSums = tuple[torch.fx.Node, tuple[torch.fx.Node, torch.fx.Node], tuple[torch.fx.Node, torch.fx.Node]]


def plan_gated_sums(graph: torch.fx.Graph) -> list[GatedSums]:
    """Each ``fuser::gated_activation`` whose gate and up are both rounded ``fuser::lora_sum_wide`` results,
    computed from their fp32 results, whose product (contiguous) is its only result read, and whose rounded sums
    are read only after the later of the two sums; reads the graph only."""
    import fuser.kernels.gated_activation  # noqa: F401  (registers torch.ops.fuser.gated_activation)

    gated_op = torch.ops.fuser.gated_activation.default
    order = {n: i for i, n in enumerate(graph.nodes)}
    plan = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not gated_op:
            continue
        args = call_args(node)
        if args["gate_lora"] is not None or args["up_lora"] is not None:
            continue
        narrows = (args["gate"], args["up"])
        pairs = (_wide_pair(narrows[0], args["gate_wide"]), _wide_pair(narrows[1], args["up_wide"]))
        if None in pairs or pairs[0] is pairs[1]:
            continue
        # the product, contiguous, is the one result read (a dead getitem of another goes with the call)
        if any(
            u.target is not operator.getitem or (u.args[1] == 0 and not _contiguous(u)) or (u.args[1] != 0 and u.users)
            for u in node.users
        ):
            continue
        later = max(order[pairs[0]], order[pairs[1]])
        if any(order[user] <= later for narrow in narrows for user in narrow.users):
            continue
        plan.append((node, pairs, narrows))
    return plan


def apply_gated_sums(graph: torch.fx.Graph, plan: list[GatedSums]) -> int:
    """Put one ``fuser::gated_activation_of_lora_sums`` in place of each planned pair of wide sums and their gated
    activation, right after the later sum; returns how many."""
    fused_op = torch.ops.fuser.gated_activation_of_lora_sums.default
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node, pairs, narrows in plan:
        terms = [call_args(pair)[k] for pair in pairs for k in ("base", "a", "weight", "scale", "allow_triton")]
        product = next((r for r in node.users if r.args[1] == 0), None)
        with graph.inserting_after(max(pairs, key=order.get)):
            fused = graph.call_function(fused_op, (*terms, call_args(node)["activation"]))
        with graph.inserting_after(fused):
            results = [graph.call_function(operator.getitem, (fused, i)) for i in (2, 1, 0)][::-1]
        copy_source_meta(node, fused, *results)
        # the product has the rounded gate sum's shape and dtype (its val stands in where no node read it)
        olds = (product, *narrows)
        fused.meta["val"] = tuple((old if old is not None else narrows[0]).meta["val"] for old in olds)
        for old, new, val in zip(olds, results, fused.meta["val"], strict=True):
            new.meta["val"] = val
            if old is not None:
                old.replace_all_uses_with(new)
        for old in (*node.users, node, *pairs[0].users, pairs[0], *pairs[1].users, pairs[1]):
            if not old.users:
                graph.erase_node(old)
    if plan:
        log.info("fuser: %d gated activation(s) of wide LoRA sums computed in row slices", len(plan))
    return len(plan)


def gated_in_slices(config: FuserConfig) -> bool:
    return config.experimental.lora_sum.gated_in_slices


PASS = PostGradPass("gated_sums_in_slices", plan_gated_sums, apply_gated_sums, gated_in_slices)
