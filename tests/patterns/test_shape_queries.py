"""Tier 1: a query of a block's shape (``x.size()``, ``x.shape``, ``x.numel()``) is no read of its values.

A graph with a symbolic sequence length keeps such queries in a checkpointed layer's body (``size = y.size()``, its
result unused), where a static graph has none. They must not make a block decline; the rewrite erases the unused
ones with the block and points a used one at a node of the same shape that survives it.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import fuser
from fuser.engine.rewrite import rewrite, subgraph_modules
from fuser.patterns import PATTERNS

NORMS = ("rms_norm", "rms_norm_linear")
STRICT = fuser.FuserConfig(patterns=NORMS, inner_compiler="aot_eager", strict=True)
PATTERNS_ON = [pattern for name, pattern in PATTERNS.items() if STRICT.enabled(name)]  # the backend's order


def block(x, w, wq, wk):  # Llama's norm, measured inside and out, read by two projections (q and k)
    h = x.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    b, t, _ = normed.shape  # a query of an intermediate of the norm
    y = w * normed.to(x.dtype)
    bb, tt, _ = y.shape  # a query of the norm's output
    return F.linear(y, wq).view(bb, tt, -1, 4) + F.linear(y, wk).view(b, t, -1, 4)


def checkpointed(x, w, wq, wk):
    return torch.utils.checkpoint.checkpoint(block, x, w, wq, wk, use_reentrant=False)


def inputs(t=5):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, t, 16, generator=gen)
    w = torch.randn(16, generator=gen)
    wq, wk = (torch.randn(8, 16, generator=gen).requires_grad_() for _ in range(2))
    torch._dynamo.mark_dynamic(x, 1)  # a symbolic sequence length from the first compile
    return x, w, wq, wk


def capture(fn, *args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=backend)(*args)
    assert len(graphs) == 1
    return graphs[0]


def graph_inputs(gm, args):
    """What ``gm`` (a captured graph) takes for ``args``: the sequence length for its symbolic size, then the
    tensors."""
    tensors = iter(a.detach() for a in args)
    values = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
    return [args[0].shape[1] if isinstance(value, torch.SymInt) else next(tensors) for value in values]


def body(gm):
    (_, module), *rest = [(n, m) for n, m in subgraph_modules(gm) if n]
    assert not rest
    return module


def node(graph, name):
    return next(n for n in graph.nodes if n.name == name)


def test_the_graph_queries_the_norm_shape():
    """What the other tests rely on: the checkpointed body measures ``normed`` and ``y`` with unused ``size`` calls."""
    graph = body(capture(checkpointed, *inputs())).graph
    measured = {q.args[0].name for q in graph.nodes if q.op == "call_method" and q.target == "size"}
    assert measured == {"normed", "y"}, graph


def test_unused_shape_queries_do_not_decline_the_norm():
    torch._dynamo.reset()
    report = fuser.explain(checkpointed, *inputs(), config=STRICT)
    assert report.counts == {"rms_norm_linear": 1}, str(report)
    assert report.near_misses == [], str(report)
    args = inputs()
    expected = checkpointed(*args)
    expected.square().sum().backward()
    want = [t.grad.clone() for t in args[2:]]
    for t in args[2:]:
        t.grad = None
    backend = fuser.backend(STRICT)
    backend.results.clear()
    torch._dynamo.reset()
    out = torch.compile(checkpointed, backend=backend)(*args)
    assert backend.counts == {"rms_norm_linear": 1}
    out.square().sum().backward()
    torch.testing.assert_close(out, expected)
    for t, g in zip(args[2:], want, strict=True):
        torch.testing.assert_close(t.grad, g)


def _use_query(graph, of, dim):
    """Make the first view read the token count from ``of.size()[dim]`` (a query the graph uses), not from the
    symbolic size it was given."""
    view = next(n for n in graph.nodes if n.op == "call_method" and n.target == "view")
    with graph.inserting_before(view):
        size = graph.call_method("size", (of,))
        length = graph.call_function(operator.getitem, (size, dim))
    size.meta["example_value"] = of.meta["example_value"].size()
    length.meta["example_value"] = size.meta["example_value"][dim]
    view.args = (view.args[0], view.args[1], length, *view.args[3:])
    return size


@pytest.mark.parametrize("queried", ["normed", "y"])
def test_a_used_shape_query_reads_a_node_that_survives(queried):
    """A query whose result the graph uses is pointed at a node of the same shape left after the rewrite: the
    norm's input for an intermediate, the fused value for the norm's output."""
    torch._dynamo.reset()
    args = inputs()
    gm = capture(checkpointed, *args)
    graph = body(gm).graph
    size = _use_query(graph, node(graph, queried), 1)
    body(gm).recompile()
    new_gm, result = rewrite(gm, PATTERNS_ON, STRICT)
    assert result.counts == {"rms_norm_linear": 1}, result.near_misses
    source = node(body(new_gm).graph, size.name).args[0]
    if queried == "normed":  # the norm's input, or its upcast (an input of the match, left for Inductor to drop)
        assert source.name in ("l_x_", "h"), source.format_node()
    else:
        assert source.args[0].target is torch.ops.fuser.rms_norm.default, source.format_node()
    torch.testing.assert_close(new_gm(*graph_inputs(gm, args)), gm(*graph_inputs(gm, args)))


def test_a_used_query_of_a_shape_nothing_else_has_declines():
    """``rsqrt`` is ``[b, t, 1]``: no input of the norm has that shape, so a used query of it keeps the norm unfused,
    and the reason says why."""
    torch._dynamo.reset()
    gm = capture(checkpointed, *inputs())
    graph = body(gm).graph
    _use_query(graph, node(graph, "rsqrt"), 1)
    body(gm).recompile()
    _, result = rewrite(gm, PATTERNS_ON, STRICT)
    assert result.counts == {}
    assert any("reads the shape of intermediate `rsqrt`" in nm.reason for nm in result.near_misses), [
        nm.reason for nm in result.near_misses
    ]
