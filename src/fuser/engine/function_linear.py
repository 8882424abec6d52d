"""A custom ``autograd.Function`` that computes a linear layer, read as ``F.linear`` for matching.

DeepSpeed ZeRO-3 (``memory_efficient_linear``, its default) replaces ``torch.nn.functional.linear`` process-wide with
``LinearFunctionForZeroStage3.apply``, so every ``nn.Linear`` of a model it trains calls that Function. Dynamo
records the call as ``autograd_function_apply(fwd_body, bwd_body, *operands)`` followed by ``getitem(…, 0)``, with
the forward and backward as nested graphs, and no pattern would see a linear there. :func:`function_linear` reads
such a ``getitem`` as ``linear(input, weight, bias)`` when both nested graphs say so, whatever the Function is called:

    forward    input.matmul(weight.t())  [+ bias]     or  addmm(bias, input, weight.t())
    backward   grad_output.matmul(weight)  for the input, grad_output (rows)ᵀ.matmul(input (rows)) for the weight,
               a sum of grad_output for the bias; nothing else but reshapes, transposes, grad-mode and autocast
               switches

and when the weight is a whole ``[out, in]`` matrix in the graph (a partitioned ZeRO-3 parameter is a 0-element
tensor: then the call is no linear of that weight, and it is left alone). DeepSpeed's backward gathers a weight that
is partitioned at backward time; Dynamo traced it gathered (the module's hook gathers it before the layer runs, and
before its backward), so the graph's backward is the one above, which is what the fused ops' backward computes too.

For matching only: a call no pattern takes keeps its exact ops. A matched one is replaced by the fused op, and
:func:`erase_dead_function_calls` then removes the Function's call, which nothing reads any more.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from fuser._compat import SET_GRAD_ENABLED

Node = torch.fx.Node

AUTOGRAD_FUNCTION_APPLY = getattr(torch.ops.higher_order, "autograd_function_apply", None)
_CACHE_KEY = "fuser_function_linear"
# what a linear's backward may do besides its matrix products and the bias's sum
_NEUTRAL_FUNCTIONS = (SET_GRAD_ENABLED, torch.amp.autocast_mode._enter_autocast)
_NEUTRAL_FUNCTIONS += (torch.amp.autocast_mode._exit_autocast,)
_RESHAPES = ("reshape", "view", "t", "contiguous")


def _body(apply: Node, index: int) -> torch.fx.GraphModule | None:
    module = apply.graph.owning_module
    attr = apply.args[index] if len(apply.args) > index else None
    if module is None or not isinstance(attr, Node) or attr.op != "get_attr":
        return None
    body = operator.attrgetter(attr.target)(module)
    return body if isinstance(body, torch.fx.GraphModule) else None


def _placeholders(body: torch.fx.GraphModule, n_operands: int) -> list[Node] | None:
    inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(inputs) == n_operands + 1:
        inputs = inputs[1:]  # older torch passes a placeholder ``ctx`` first
    return inputs if len(inputs) == n_operands else None


def _is_call(node: Any, method: str, function: Any = None) -> bool:
    if not isinstance(node, Node):
        return False
    return (node.op == "call_method" and node.target == method) or (
        function is not None and node.op == "call_function" and node.target is function
    )


def _through_reshapes(node: Any) -> Any:
    while _is_call(node, "reshape", torch.reshape) or _is_call(node, "view") or _is_call(node, "contiguous"):
        node = node.args[0]
    return node


def _forward_operands(forward: torch.fx.GraphModule, inputs: list[Node]) -> tuple[Node, Node, Node | None] | None:
    """(input, weight, bias) placeholders of a forward graph that returns ``input @ weight.t() (+ bias)``."""
    output = next(n for n in forward.graph.nodes if n.op == "output")
    returned = output.args[0]
    if not (isinstance(returned, (tuple, list)) and len(returned) == 2 and isinstance(returned[0], (tuple, list))):
        return None
    if len(returned[0]) != 1:
        return None
    out, bias = returned[0][0], None
    if _is_call(out, "add", operator.add) or _is_call(out, "add_", operator.iadd):
        out, bias = out.args
    elif _is_call(out, "addmm", torch.addmm):
        bias, x, wt = out.args[:3]
        if len(out.args) != 3 or out.kwargs or not _is_call(wt, "t", torch.t):
            return None
        return (x, wt.args[0], bias) if x in inputs and wt.args[0] in inputs and bias in inputs else None
    if not (_is_call(out, "matmul", torch.matmul) or _is_call(out, "__matmul__", operator.matmul)):
        return None
    if len(out.args) != 2 or out.kwargs:
        return None
    x, wt = out.args
    if not _is_call(wt, "t", torch.t) or len(wt.args) != 1:
        return None
    weight = wt.args[0]
    if x not in inputs or weight not in inputs or (bias is not None and bias not in inputs):
        return None
    # nothing else computed in the forward: only grad-mode switches besides these nodes
    computed = {n for n in forward.graph.nodes if n.op in ("call_function", "call_method")}
    used = {out, wt} | ({returned[0][0]} if returned[0][0] is not out else set())
    if any(n not in used and not (n.op == "call_function" and n.target in _NEUTRAL_FUNCTIONS) for n in computed):
        return None
    return x, weight, bias


def _backward_is_linear_grads(backward: torch.fx.GraphModule, n_saved: int, grads_for: list[str]) -> bool:
    """Whether ``backward(grad_output, *saved)`` returns, in the forward's operand order named by ``grads_for``
    (``"input"``, ``"weight"``, ``"bias"``), the linear's gradients (module docstring)."""
    inputs = [n for n in backward.graph.nodes if n.op == "placeholder"]
    if len(inputs) != n_saved + 1:
        return False
    grad = inputs[0]
    output = next(n for n in backward.graph.nodes if n.op == "output")
    returned = output.args[0]
    if not isinstance(returned, (tuple, list)) or len(returned) != len(grads_for):
        return False
    for value, what in zip(returned, grads_for, strict=True):
        if value is None:
            continue
        if what == "input":  # grad_output.matmul(weight)
            if not (_is_call(value, "matmul", torch.matmul) and _through_reshapes(value.args[0]) is grad):
                return False
        elif what == "weight":  # grad_output (rows)ᵀ.matmul(input (rows)), or grad_output.t().matmul(input)
            if not _is_call(value, "matmul", torch.matmul):
                return False
            left = value.args[0]
            if not (_is_call(left, "t", torch.t) and _through_reshapes(left.args[0]) is grad):
                return False
        elif what == "bias":  # grad_output summed over its leading dims
            if not (_is_call(value, "sum", torch.sum) and value.args[0] is grad):
                return False
    allowed = ("matmul", "sum", "t", *_RESHAPES)
    for node in backward.graph.nodes:
        if node.op == "call_method" and node.target not in allowed:
            return False
        if node.op == "call_function" and node.target not in _NEUTRAL_FUNCTIONS + (torch.matmul, torch.t, torch.sum):
            return False
    return True


def _read(item: Node) -> tuple[Node, Node, Node | None] | None:
    apply = item.args[0]
    forward, backward = _body(apply, 0), _body(apply, 1)
    if forward is None or backward is None:
        return None
    operands = list(apply.args[2:])
    inputs = _placeholders(forward, len(operands))
    if inputs is None:
        return None
    found = _forward_operands(forward, inputs)
    if found is None:
        return None
    outer = dict(zip(inputs, operands, strict=True))
    x, weight, bias = (outer[p] if p is not None else None for p in found)
    names = {found[0]: "input", found[1]: "weight", found[2]: "bias"}
    saved = next(n for n in forward.graph.nodes if n.op == "output").args[0][1]
    if not _backward_is_linear_grads(backward, len(saved), [names.get(p, "other") for p in inputs]):
        return None
    # the saved values are the forward's operands, in the order the backward takes them
    if any(s not in inputs for s in saved):
        return None
    return x, weight, bias


def function_linear(node: Node) -> tuple[Node, Node, Node | None] | None:
    """``(input, weight, bias)`` if ``node`` is ``getitem(autograd_function_apply(...), 0)`` of a Function that
    computes ``F.linear(input, weight, bias)`` forward and backward, with a whole ``[out, in]`` weight; else None."""
    if AUTOGRAD_FUNCTION_APPLY is None or node.op != "call_function" or node.target is not operator.getitem:
        return None
    if len(node.args) != 2 or node.args[1] != 0 or node.kwargs:
        return None
    apply = node.args[0]
    if not isinstance(apply, Node) or apply.target is not AUTOGRAD_FUNCTION_APPLY:
        return None
    cached = apply.meta.get(_CACHE_KEY)
    if cached is None or cached[0] is not apply.graph:  # a copied graph copies its nodes' meta: read it again
        cached = apply.meta[_CACHE_KEY] = (apply.graph, _read(node))
    found = cached[1]
    if found is None:
        return None
    x, weight, _ = found
    xt, wt, out = (v.meta.get("example_value") if isinstance(v, Node) else None for v in (x, weight, node))
    if not all(isinstance(t, torch.Tensor) for t in (xt, wt, out)):
        return None
    # a whole [out, in] weight (not a 0-element ZeRO-3 partition) that the output's last dim agrees with
    if wt.dim() != 2 or wt.numel() == 0 or xt.shape[-1] != wt.shape[1] or out.shape[-1] != wt.shape[0]:
        return None
    return found


def linear_result(apply: Node) -> Node | None:
    """The ``getitem(apply, 0)`` that :func:`function_linear` reads as a linear, if ``apply`` is such a Function's
    call and that is its only user; else None."""
    if AUTOGRAD_FUNCTION_APPLY is None or apply.target is not AUTOGRAD_FUNCTION_APPLY or len(apply.users) != 1:
        return None
    item = next(iter(apply.users))
    return item if function_linear(item) is not None else None


def erase_dead_function_calls(graph: torch.fx.Graph) -> int:
    """Erase each ``autograd_function_apply`` call that nothing reads any more (a linear Function call whose result
    a fused op took over), with its bodies' ``get_attr`` nodes; returns how many calls."""
    if AUTOGRAD_FUNCTION_APPLY is None:
        return 0
    n = 0
    for node in reversed(list(graph.nodes)):
        if (
            node.target is AUTOGRAD_FUNCTION_APPLY
            and not node.users
            and (node.meta.get(_CACHE_KEY) or (None, None))[1] is not None
        ):
            bodies = [a for a in node.args[:2] if isinstance(a, Node)]
            graph.erase_node(node)
            for body in bodies:
                if not body.users:
                    graph.erase_node(body)
            n += 1
    return n
