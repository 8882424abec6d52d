"""The rotary embedding's post-grad passes: casts around ``fuser::rope`` that its kernel can do as it loads or stores.

Under autocast with fp32 weights (a trainer's ``bf16=True`` on an fp32 model) the projections give bf16 q and k, the
rotary embedding fp32 cos and sin, and the rotation an fp32 result (eager's type promotion, the op's ``out_dtype``),
which autocast then casts to bf16 for attention; attention's bf16 gradients come back widened to fp32 for the
rotation's backward. The op is a user Triton kernel, so Inductor cannot fuse those casts into it: each is a kernel
of its own, writing a copy the next kernel reads back (per q of Llama-3.2-1B's step, 8192 × 2048 values).

- ``rope_output_casts`` (forward graphs): a rope call whose every used output is read only by casts to one half
  precision dtype gets that dtype as its ``out_dtype``, and the casts go. The kernel computes in fp32 and rounds
  once to its output's dtype, as the cast did.
- ``rope_grad_upcasts`` (backward graphs): a ``rope_backward`` input that is an exact upcast to fp32 of a half
  precision tensor, read only there, is replaced by that tensor; the kernel widens each value as it loads it.

Both compute the same values. Always on (they only remove copies).
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx

import fuser.kernels.rope  # noqa: F401  (registers torch.ops.fuser.rope and rope_backward)
from fuser.engine.canonical import tensor_meta
from fuser.patterns.base import PostGradPass
from fuser.patterns.norm_grad_sums import widened_source

log = logging.getLogger("fuser")

_CONVERT = torch.ops.prims.convert_element_type.default
_HALF = (torch.bfloat16, torch.float16)
_OUT_DTYPE = 6  # rope's out_dtype argument


def _narrowing_to(user: torch.fx.Node) -> torch.dtype | None:
    """The half dtype ``user`` casts its fp32 input to, where it is such a cast; else None."""
    if user.op != "call_function" or user.target is not _CONVERT or user.kwargs:
        return None
    dtype = user.args[1] if len(user.args) > 1 else None
    before = tensor_meta(user.args[0])
    if dtype not in _HALF or before is None or before.dtype != torch.float32:
        return None
    return dtype


def plan_rope_output_casts(graph: torch.fx.Graph) -> list:
    """(rope call, the half dtype, its outputs' casts) for each call whose used outputs only casts read."""
    plan = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.fuser.rope.default:
            continue
        if len(node.args) != _OUT_DTYPE + 1 or node.kwargs:
            continue
        items = list(node.users)
        if not items or any(u.op != "call_function" or u.target is not operator.getitem for u in items):
            continue
        casts = [c for item in items for c in item.users]
        dtypes = {_narrowing_to(c) for c in casts}
        if not casts or len(dtypes) != 1 or None in dtypes:
            continue
        plan.append((node, dtypes.pop(), casts))
    return plan


def apply_rope_output_casts(graph: torch.fx.Graph, plan: list) -> int:
    from torch._dispatch.python import enable_python_dispatcher

    for node, dtype, casts in plan:
        node.args = (*node.args[:_OUT_DTYPE], dtype)
        args = torch.fx.node.map_arg(node.args, lambda n: n.meta["val"])
        fake_mode = next(v.fake_mode for v in args if hasattr(v, "fake_mode"))
        with fake_mode, enable_python_dispatcher():
            node.meta["val"] = node.target(*args)
        for item in node.users:
            item.meta["val"] = node.meta["val"][item.args[1]]
            item.meta.pop("tensor_meta", None)
        node.meta.pop("tensor_meta", None)
        for cast in casts:
            cast.replace_all_uses_with(cast.args[0])
            graph.erase_node(cast)
    if plan:
        log.info("fuser: %d rope call(s) write their half-precision results themselves", len(plan))
    return len(plan)


def plan_rope_grad_upcasts(graph: torch.fx.Graph) -> list:
    """(rope_backward call, {argument index: the half-precision tensor its upcast widens}) for each call given one."""
    plan = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.fuser.rope_backward.default:
            continue
        sources = {i: widened_source(node.args[i], node) for i in (0, 1) if len(node.args) > i}
        sources = {i: s for i, s in sources.items() if s is not None}
        if len(node.args) > 1 and node.args[0] is node.args[1]:
            continue  # one upcast read twice
        if sources:
            plan.append((node, sources))
    return plan


def apply_rope_grad_upcasts(graph: torch.fx.Graph, plan: list) -> int:
    for node, sources in plan:
        args = list(node.args)
        upcasts = [args[i] for i in sources]
        for i, source in sources.items():
            args[i] = source
        node.args = tuple(args)
        for upcast in upcasts:
            graph.erase_node(upcast)
    if plan:
        log.info("fuser: %d rope backward(s) read their half-precision gradients without upcasts", len(plan))
    return len(plan)


OUTPUT_CASTS_PASS = PostGradPass("rope_output_casts", plan_rope_output_casts, apply_rope_output_casts)
GRAD_UPCASTS_PASS = PostGradPass("rope_grad_upcasts", plan_rope_grad_upcasts, apply_rope_grad_upcasts)
