"""The fused norms' post-grad pass: a norm's output gradient, a sum of its projections' input gradients, is summed
inside the norm's backward kernel.

A norm that feeds several projections (q, k and v; gate and up) gets their input gradients added up in the
backward graph before its own backward reads them:

    s = dq @ Wq + dk @ Wk          (aten.add; Inductor's kernel reads both terms and writes s, rounded)
    s = s + dv @ Wv
    dx, dw = fuser::rms_norm_backward(s, x, …)          (or add_rms_norm_backward)

With ``experimental.rms_norm.gradient_sums`` the norm's backward takes the terms instead (``dy2`` to ``dy4``: at most
four terms in all) and adds them in fp32 as it loads them: the sum is never written, read back, or rounded to the
gradient's dtype (bf16 under full fine-tuning) before the norm's backward uses it. A sum is taken only when

- the add chain's only reader is the norm's backward, as its ``dy``, and each add in it adds two tensors of dy's
  dtype and shape (no alpha, no broadcast), and is read by nothing but the next add;
- nothing between the first add and the norm's backward mutates a tensor (the terms are read later than before).

Declines are logged at debug level. On by default (``experimental.rms_norm.gradient_sums``; what it measured:
``docs/defaults.md``, ``experimental.rms_norm.gradient_sums``).

A second pass, ``norm_grad_upcasts`` (the same switch), runs after it: where every term the norm's backward reads is
an exact upcast to fp32 of a half-precision tensor (``convert_element_type(t, fp32)``, t bf16 or fp16, all of one
dtype, each read by this call only), the call reads the half-precision terms and the upcasts go. Under autocast with
fp32 weights (a trainer's ``bf16=True`` on an fp32 model) the projections' input gradients are bf16 matmul outputs
that autocast's casts widen to the fp32 stream's dtype; the kernel widens each value as it loads it, so the fp32
copies (written, then read back: per term two thirds more bytes than the term itself) bought nothing. Same values,
the same sum.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.fx

import fuser.kernels.rms_norm  # noqa: F401  (registers the fuser:: norm ops)
from fuser._compat import statically_same_shape
from fuser.engine.canonical import tensor_meta
from fuser.engine.protocol import PostGradPass, call_args
from fuser.inductor.op_casts import read_unwidened, widened_source

if TYPE_CHECKING:
    from fuser.config import FuserConfig

log = logging.getLogger("fuser")

_BACKWARDS = (torch.ops.fuser.rms_norm_backward.default, torch.ops.fuser.add_rms_norm_backward.default)
_ADD = torch.ops.aten.add.Tensor
MAX_TERMS = 4  # dy, dy2, dy3, dy4


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and statically_same_shape(a.shape, b.shape)


def _plain_add(node, like: torch.Tensor) -> bool:
    """``node`` is ``aten.add.Tensor`` of two graph tensors shaped and typed as ``like``, with no alpha."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is _ADD):
        return False
    if node.kwargs or len(node.args) != 2 or not all(isinstance(a, torch.fx.Node) for a in node.args):
        return False
    vals = [tensor_meta(a) for a in node.args]
    return all(v is not None and _same(v, like) for v in (*vals, tensor_meta(node)))


def _terms(dy: torch.fx.Node, like: torch.Tensor) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """(the terms of the add chain ``dy``, at most MAX_TERMS, left to right; the adds that formed them, the chain's
    head first). A term is taken apart only if it is an add read once, by the add it is a term of."""
    terms, adds = [dy], []
    while len(terms) < MAX_TERMS:
        i = next((i for i, t in enumerate(terms) if terms.count(t) == 1 and len(t.users) == 1 and _plain_add(t, like)),
                 None)  # fmt: skip
        if i is None:
            break
        adds.append(terms[i])
        terms[i : i + 1] = list(terms[i].args)
    return terms, adds


def _mutates(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def plan_norm_grad_sums(graph: torch.fx.Graph) -> list:
    """Each norm backward of ``graph`` whose ``dy`` is a sum it can take apart, with its terms and adds."""
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target in _BACKWARDS]
    if not calls:
        return []
    order = {node: i for i, node in enumerate(graph.nodes)}
    mutations = [order[n] for n in graph.nodes if _mutates(n)]
    plan = []
    for node in calls:
        dy, like = node.args[0], tensor_meta(node.args[0])
        if like is None or not _plain_add(dy, like):
            continue
        if len(dy.users) != 1 or list(node.args).count(dy) + list(node.kwargs.values()).count(dy) != 1:
            log.debug("fuser: %s keeps its gradient sum: `%s` has another reader", node.name, dy.name)
            continue
        if any(node.kwargs.get(k) is not None for k in ("dy2", "dy3", "dy4")):
            continue
        terms, adds = _terms(dy, like)
        first = min(order[a] for a in adds)
        if any(first < m < order[node] for m in mutations):
            log.debug(
                "fuser: %s keeps its gradient sum: an op between the sum and the norm mutates a tensor", node.name
            )
            continue
        plan.append((node, terms, adds))
    return plan


def apply_norm_grad_sums(graph: torch.fx.Graph, plan: list) -> int:
    for node, terms, adds in plan:
        node.args = (terms[0], *node.args[1:])
        node.kwargs = {**node.kwargs, **dict(zip(("dy2", "dy3", "dy4"), terms[1:], strict=False))}
        for add in adds:  # the chain's head first: each add is then unread
            graph.erase_node(add)
    if plan:
        log.info("fuser: %d norm backward(s) sum their output gradient's terms themselves", len(plan))
    return len(plan)


_TERM_KEYS = ("dy2", "dy3", "dy4")


def plan_norm_grad_upcasts(graph: torch.fx.Graph) -> list:
    """Each norm backward of ``graph`` whose every output-gradient term (``dy`` and ``dy2``-``dy4``) is an exact
    upcast of a half-precision tensor, all of one dtype, that only it reads: (call, {argument: its source})."""
    plan = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _BACKWARDS:
            continue
        bound = call_args(node)
        terms = {name: bound[name] for name in ("dy", *_TERM_KEYS) if bound[name] is not None}
        if len(set(terms.values())) != len(terms):
            continue  # one tensor read twice: its upcast has one reader, but two uses
        sources = {name: widened_source(t, node) for name, t in terms.items()}
        if any(v is None for v in sources.values()) or len({tensor_meta(v).dtype for v in sources.values()}) != 1:
            continue
        plan.append((node, sources))
    return plan


def apply_norm_grad_upcasts(graph: torch.fx.Graph, plan: list) -> int:
    for node, sources in plan:
        read_unwidened(graph, node, sources)
    if plan:
        log.info("fuser: %d norm backward(s) read their half-precision gradient terms without upcasts", len(plan))
    return len(plan)


def gradient_sums(config: FuserConfig) -> bool:
    return config.experimental.rms_norm.gradient_sums


PASS = PostGradPass("norm_grad_sums", plan_norm_grad_sums, apply_norm_grad_sums, gradient_sums)
UPCASTS_PASS = PostGradPass("norm_grad_upcasts", plan_norm_grad_upcasts, apply_norm_grad_upcasts, gradient_sums)
