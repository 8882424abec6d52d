"""Refinement of ``rms_norm``'s (and ``rms_norm_linear``'s) norms: the residual add a norm reads joins the norm's
op (``fuser::add_rms_norm``, ``experimental.rms_norm.residual_add``), so that a decoder layer's residual add costs
no kernel of its own. Runs after ``rms_norm_linear``'s refinement, and before ``lora_sum``'s, which takes the adds
of LoRA sums itself (in fp32)."""

from __future__ import annotations

import logging
import operator
from typing import TYPE_CHECKING

import torch
import torch.fx

import fuser.kernels.lora_sum  # noqa: F401  (registers torch.ops.fuser.lora_sum, whose sums the refinement leaves)
import fuser.kernels.rms_norm  # noqa: F401  (registers torch.ops.fuser.rms_norm and add_rms_norm)
from fuser._compat import statically_same_shape
from fuser._dtypes import FLOAT_DTYPES, HALF_DTYPES
from fuser.engine.canonical import canonical, tensor_meta, value_readers
from fuser.engine.protocol import Decline, Refinement
from fuser.engine.rewrite import copy_source_meta

if TYPE_CHECKING:
    from fuser.config import FuserConfig

log = logging.getLogger("fuser")


def _lora_sum_kept_wide(node: object) -> bool:
    """A ``fuser::lora_sum`` that rounds its sum (peft's order): lora_sum's refinements, which run after this one,
    add such a sum to the residual in fp32 before the norm (so that its rounding does not erase a small LoRA term),
    and take the add themselves."""
    return (
        isinstance(node, torch.fx.Node)
        and node.target is torch.ops.fuser.lora_sum.default
        and not (len(node.args) > 4 and node.args[4])
    )


def _residual_operands(norm: torch.fx.Node, order: dict[torch.fx.Node, int]) -> tuple[torch.fx.Node, torch.fx.Node]:
    """``(a, b)`` for ``norm`` (a ``fuser::rms_norm`` call) that normalises a residual add ``a + b`` it can absorb
    into an op in the add's place; raises ``Decline`` otherwise."""
    add = norm.args[0]
    c = canonical(add)
    if c is None or c.op != "add" or len(c.args) != 2:
        raise Decline(f"its input `{getattr(add, 'name', add)}` is not an add (nothing to absorb)")
    a, b = add.args[:2]
    metas = [tensor_meta(v) for v in (a, b, add)]
    if None in metas or not all(isinstance(v, torch.fx.Node) for v in (a, b)):
        raise Decline(f"`{add.name}` adds a value that is not a tensor of the graph")
    dtypes, out = (metas[0].dtype, metas[1].dtype), metas[2].dtype
    # two tensors of one dtype; or, under autocast with fp32 weights, a half-precision projection added into the fp32
    # residual stream (an fp32 sum): the op takes the fp32 one as x, whose dtype its sum keeps
    promoted = out == torch.float32 and sorted(d == out for d in dtypes) == [False, True]
    if out not in FLOAT_DTYPES or not (dtypes == (out, out) or (promoted and set(dtypes) - {out} <= set(HALF_DTYPES))):
        raise Decline(
            f"`{add.name}` adds {dtypes[0]} and {dtypes[1]} into {out}: not two tensors of one fp16/bf16/fp32 dtype, "
            "nor an fp32 and a half-precision one summed in fp32"
        )
    if dtypes[1] == out and dtypes[0] != out:
        a, b = b, a
    if not all(statically_same_shape(t.shape, metas[2].shape) for t in metas[:2]):
        raise Decline(
            f"`{add.name}` broadcasts: {tuple(metas[0].shape)} + {tuple(metas[1].shape)} (the op adds tensors of one "
            "shape)"
        )
    if metas[0].device != metas[1].device:
        raise Decline(f"`{add.name}` adds tensors on different devices")
    wide = [v.name for v in (a, b) if _lora_sum_kept_wide(v)]
    if wide:
        raise Decline(
            f"`{wide[0]}` is a LoRA sum: lora_sum's refinement adds it to the residual in fp32, so that rounding "
            "does not erase a LoRA term smaller than half the residual's ulp"
        )
    norms = [u for u in add.users if u.op == "call_function" and u.target in _NORM_OPS]
    if norms != [norm]:
        raise Decline(f"`{add.name}` feeds {len(norms)} norms: the op absorbs an add into one")
    if add in norm.args[1:]:
        raise Decline(f"`{norm.name}` reads `{add.name}` as another argument too")
    if any(u.target is not operator.getitem for u in norm.users):
        raise Decline(f"`{norm.name}`'s results are read other than by index")
    late = [v.name for v in norm.args[1:] if isinstance(v, torch.fx.Node) and order[v] > order[add]]
    if late:
        raise Decline(f"`{late[0]}`, an argument of the norm, is computed after `{add.name}`")
    # the op takes the add's place: nothing may read (and so perhaps modify in place) the sum before the norm does,
    # but for the replaced norm's own upcast of it, left without users until Inductor drops it
    early = [u.name for u in value_readers(add) if order[u] < order[norm] and not _dead_cast(u)]
    if early:
        raise Decline(f"`{early[0]}` reads `{add.name}` before the norm does")
    return a, b


def _dead_cast(node: torch.fx.Node) -> bool:
    c = canonical(node)
    return c is not None and c.op == "to" and not node.users


def add_residuals_into_norms(graph: torch.fx.Graph, config: FuserConfig) -> int:
    """``y, rstd = rms_norm(a + b, …)`` → ``y, rstd, h = add_rms_norm(a, b, …)``
    (``experimental.rms_norm.residual_add``), where the add (``operator.add``, ``torch.add`` or ``Tensor.add``, no
    alpha) sums two tensors of one fp16/bf16/fp32 dtype and one shape (or, under autocast with fp32 weights, an
    fp32 and a half-precision one into an fp32 sum, which the op computes as eager does), and this norm is the only
    one that reads it: its other readers (the residual stream) read ``h``, the same sum rounded once as the add
    rounds it. The op normalises the sum before that rounding, as Inductor computes an add fused with a norm, and
    its backward adds ``h``'s own gradient to the norm's input gradient in fp32 with one rounding
    (``src/fuser/kernels/rms_norm.py``), so that a decoder layer's residual add costs no kernel of its own either way.
    Covers the norms of ``rms_norm`` and ``rms_norm_linear`` alike (``linear_normed``'s rebuild then reads ``h``); a
    norm given an fp32 ``x_wide``, or whose add sums a LoRA sum (lora_sum's refinements take those), is left as it
    is. Returns how many norms; a declined one is logged at debug level with the reason."""
    if not config.experimental.rms_norm.residual_add:
        return 0
    n = 0
    order = {node: i for i, node in enumerate(graph.nodes)}
    rms_norm = torch.ops.fuser.rms_norm.default
    for norm in [node for node in graph.nodes if node.op == "call_function" and node.target is rms_norm]:
        if norm.kwargs.get("x_wide") is not None or len(norm.args) != 6:
            continue  # the fp32 value a LoRA sum's refinement gave it
        try:
            a, b = _residual_operands(norm, order)
        except Decline as reason:
            log.debug("fuser: rms_norm: `%s` keeps its input apart: %s", norm.name, reason)
            continue
        add = norm.args[0]
        with graph.inserting_after(add):
            fused = graph.call_function(torch.ops.fuser.add_rms_norm.default, (a, b, *norm.args[1:6]))
        with graph.inserting_after(fused):
            total = graph.call_function(operator.getitem, (fused, 2))
        copy_source_meta(norm, fused)
        total.meta.update(add.meta)  # the residual stream's next value: the add's shape, dtype and source line
        example = norm.meta.get("example_value")
        if isinstance(example, (tuple, list)) and "example_value" in add.meta:
            fused.meta["example_value"] = (*example[:2], add.meta["example_value"])
        add.replace_all_uses_with(total, delete_user_cb=lambda user, norm=norm: user is not norm)
        norm.replace_all_uses_with(fused)  # its getitem 0 / 1 (y, rstd) are the fused op's
        graph.erase_node(norm)
        graph.erase_node(add)
        order = {node: i for i, node in enumerate(graph.nodes)}
        n += 1
    return n


_NORM_OPS = (torch.ops.fuser.rms_norm.default, torch.ops.fuser.add_rms_norm.default)


REFINEMENT = Refinement(add_residuals_into_norms, after=("rms_norm_linear",))
