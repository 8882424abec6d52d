"""Post-grad passes for the casts around fused ops that the ops' kernels can do as they load or store.

Under autocast with fp32 weights (a trainer's ``bf16=True`` on an fp32 model) the residual stream, the norms'
outputs and the rotation's result are fp32 (eager's type promotion: an fp32 weight, fp32 cos/sin), and autocast casts
them to bf16 for each matmul and for attention; the bf16 gradients coming back are widened to fp32 again. fuser's
ops are user Triton kernels, so Inductor cannot fuse those casts into them: each is a kernel of its own, writing a
copy that the next kernel reads back (at Llama-3.2-1B's step, 8192 × 2048 values for each norm output and each q).

- ``output_casts`` (any post-grad graph): a ``rope``, ``rms_norm`` or ``add_rms_norm`` call whose result (rope: both
  results) only casts to one half-precision dtype read gets that dtype as its ``out_dtype``, and the casts go. The
  kernels compute in fp32 and round once to their output's dtype, as the cast did; the layout is checked to be the
  casts' own.
- ``rope_grad_upcasts`` (backward graphs): a ``rope_backward`` input that is an exact upcast to fp32 of a
  half-precision tensor, read only there, is replaced by that tensor; the kernel widens each value as it loads it.
  (The norms' backwards get theirs from ``norm_grad_upcasts``, :mod:`fuser.inductor.norm_grad_sums`.)

Both compute the same values. Always on (they only remove copies).
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx

import fuser.kernels.rms_norm  # noqa: F401  (registers torch.ops.fuser.rms_norm and add_rms_norm)
import fuser.kernels.rope  # noqa: F401  (registers torch.ops.fuser.rope and rope_backward)
from fuser._compat import python_dispatcher, statically_same_shape
from fuser._dtypes import HALF_DTYPES
from fuser.engine.canonical import tensor_meta
from fuser.engine.protocol import PostGradPass, call_args, with_args

log = logging.getLogger("fuser")

_CONVERT = torch.ops.prims.convert_element_type.default
# op -> the results its ``out_dtype`` argument sets
_OUT_DTYPE_RESULTS = {
    torch.ops.fuser.rope.default: (0, 1),
    torch.ops.fuser.rms_norm.default: (0,),
    torch.ops.fuser.add_rms_norm.default: (0,),
}


def widened_source(term: object, call: torch.fx.Node) -> torch.fx.Node | None:
    """The half-precision tensor ``term`` widens exactly to fp32 (``convert_element_type(t, fp32)``) where ``call``
    is its only reader; else None."""
    if not (isinstance(term, torch.fx.Node) and term.op == "call_function" and term.target is _CONVERT):
        return None
    source = term.args[0]
    before, after = tensor_meta(source), tensor_meta(term)
    if before is None or after is None or before.dtype not in HALF_DTYPES or after.dtype != torch.float32:
        return None
    return source if set(term.users) == {call} else None


def _narrowing_to(user: torch.fx.Node) -> torch.dtype | None:
    """The half dtype ``user`` casts its fp32 input to, where it is such a cast; else None."""
    if user.op != "call_function" or user.target is not _CONVERT or user.kwargs:
        return None
    dtype = user.args[1] if len(user.args) > 1 else None
    before = tensor_meta(user.args[0])
    if dtype not in HALF_DTYPES or before is None or before.dtype != torch.float32:
        return None
    return dtype


def _fake_results(node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
    """What ``node``'s op returns for ``args``/``kwargs``, on the graph's fake values."""
    values = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    fake_mode = next(v.fake_mode for v in torch.utils._pytree.tree_leaves(values) if hasattr(v, "fake_mode"))
    with fake_mode, python_dispatcher():
        return node.target(*values[0], **values[1])


def _same_layout(a: torch.Tensor, b: Any) -> bool:
    """One dtype, shape and strides, compared without guarding on symbolic sizes (a dynamic-shape graph)."""
    return (
        isinstance(b, torch.Tensor)
        and a.dtype == b.dtype
        and statically_same_shape(a.shape, b.shape)
        and statically_same_shape(a.stride(), b.stride())
    )


def plan_output_casts(graph: torch.fx.Graph) -> list:
    """(call, its new args, kwargs and fake results, the casts that go) for each call whose ``out_dtype`` results
    only casts to one half dtype read, where the op then returns them in the casts' own layout."""
    plan = []
    for node in graph.nodes:
        results = _OUT_DTYPE_RESULTS.get(node.target) if node.op == "call_function" else None
        if results is None:
            continue
        items = list(node.users)
        if not items or any(u.op != "call_function" or u.target is not operator.getitem for u in items):
            continue
        governed = [u for u in items if u.args[1] in results and u.users]
        casts = [c for item in governed for c in item.users]
        dtypes = {_narrowing_to(c) for c in casts}
        if not casts or len(dtypes) != 1 or None in dtypes:
            continue
        args, kwargs = with_args(node, {"out_dtype": dtypes.pop()})
        new = _fake_results(node, args, kwargs)
        if not all(_same_layout(new[item.args[1]], c.meta.get("val")) for item in governed for c in item.users):
            continue
        plan.append((node, args, kwargs, new, casts))
    return plan


def apply_output_casts(graph: torch.fx.Graph, plan: list) -> int:
    for node, args, kwargs, new, casts in plan:
        node.args, node.kwargs = args, kwargs
        node.meta["val"] = new
        node.meta.pop("tensor_meta", None)
        for item in node.users:
            item.meta["val"] = new[item.args[1]]
            item.meta.pop("tensor_meta", None)
        for cast in casts:
            cast.replace_all_uses_with(cast.args[0])
            graph.erase_node(cast)
    if plan:
        log.info("fuser: %d fused call(s) write their half-precision results themselves", len(plan))
    return len(plan)


def read_unwidened(graph: torch.fx.Graph, node: torch.fx.Node, sources: dict[str, torch.fx.Node]) -> None:
    """``node`` reads each argument ``sources`` names as the half-precision tensor given there, not its upcast
    (:func:`widened_source`), and the upcasts, then unread, go."""
    upcasts = [call_args(node)[name] for name in sources]
    node.args, node.kwargs = with_args(node, sources)
    for upcast in upcasts:
        graph.erase_node(upcast)


def plan_rope_grad_upcasts(graph: torch.fx.Graph) -> list:
    """(rope_backward call, {argument: the half-precision tensor its upcast widens}) for each call given one."""
    plan = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.fuser.rope_backward.default:
            continue
        grads = {name: call_args(node)[name] for name in ("dq_out", "dk_out")}
        if grads["dq_out"] is grads["dk_out"]:
            continue  # one upcast read twice
        sources = {name: widened_source(g, node) for name, g in grads.items()}
        sources = {name: s for name, s in sources.items() if s is not None}
        if sources:
            plan.append((node, sources))
    return plan


def apply_rope_grad_upcasts(graph: torch.fx.Graph, plan: list) -> int:
    for node, sources in plan:
        read_unwidened(graph, node, sources)
    if plan:
        log.info("fuser: %d rope backward(s) read their half-precision gradients without upcasts", len(plan))
    return len(plan)


OUTPUT_CASTS_PASS = PostGradPass("output_casts", plan_output_casts, apply_output_casts)
ROPE_GRAD_UPCASTS_PASS = PostGradPass("rope_grad_upcasts", plan_rope_grad_upcasts, apply_rope_grad_upcasts)
