"""The post-grad passes of ``fuser.inductor.gated_mlp_inplace`` (the gated backward's gradients written over gate
and up; the down adapter's dx added into the base projection's gradient), on hand-built graphs: they rewrite only
where no one can observe the mutation, and the rewritten graph computes what the original does."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fuser.kernels.gated_activation  # noqa: F401  (registers the ops)
import fuser.kernels.upcast_linear  # noqa: F401
from fuser.inductor.gated_mlp_inplace import accumulate_gated_dx, reinplace_gated_backward

BWD = torch.ops.fuser.gated_activation_backward
ROWS, COLS = 6, 10


def inputs():
    return [torch.randn(ROWS, COLS) for _ in range(3)]


def rewrite(fn, *args):
    """(number rewritten, the graph module after the pass) for ``fn`` traced with fake tensors."""
    gm = make_fx(fn, tracing_mode="fake")(*args)  # every node carries meta["val"]
    n = reinplace_gated_backward(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return n, gm


def in_place_ops(gm) -> int:
    return sum(n.target is torch.ops.fuser.gated_activation_backward_.default for n in gm.graph.nodes)


def intermediates(dout, a, b):
    # gate and up made inside the graph (a checkpointed layer's recompute), last read by the backward
    g, u = a * 2.0, b + 1.0
    dgate, dup, _, _ = BWD(dout, g, u, 1.0, 1.0, True, True, False, False, "silu")
    return dgate * 3.0, dup - 1.0


def test_rewrites_intermediates_read_last_by_the_backward_and_computes_the_same():
    args = inputs()
    n, gm = rewrite(intermediates, *args)
    assert n == 1 and in_place_ops(gm) == 1
    assert not any(node.target is BWD.default for node in gm.graph.nodes)
    expected = intermediates(*args)
    got = gm(*args)
    for e, o in zip(expected, got, strict=True):
        assert torch.equal(e, o)


def _read_after(dout, a, b):
    g, u = a * 2.0, b + 1.0
    dgate, dup, _, _ = BWD(dout, g, u, 1.0, 1.0, True, True, False, False, "silu")
    return dgate, dup, g.sum()


def _view_read_after(dout, a, b):
    base, u = a * 2.0, b + 1.0
    g = base.view(COLS, ROWS).t().contiguous().t().contiguous().view(ROWS, COLS)  # a fresh copy, then views of it
    g2 = (a * 2.0).view(ROWS, COLS)
    dgate, dup, _, _ = BWD(dout, g2, u, 1.0, 1.0, True, True, False, False, "silu")
    return dgate, dup, g, g2.view(-1)[0] + 1  # a view of g2's storage read after


def _graph_inputs(dout, a, b):
    return BWD(dout, a, b, 1.0, 1.0, True, True, False, False, "silu")[:2]


def _view_of_graph_input(dout, a, b):
    g = a.view(COLS, ROWS).view(ROWS, COLS)
    return BWD(dout, g, b + 1.0, 1.0, 1.0, True, True, False, False, "silu")[:2]


def _lora_grads(dout, a, b):
    out = BWD(dout, a * 2.0, b + 1.0, 1.0, 1.0, True, True, True, False, "silu")
    return out[0], out[1], out[2]


def _same_tensor(dout, a, b):
    g = a * 2.0
    return BWD(dout, g, g, 1.0, 1.0, True, True, False, False, "silu")[:2]


def _graph_output(dout, a, b):
    g, u = a * 2.0, b + 1.0
    dgate, dup, _, _ = BWD(dout, g, u, 1.0, 1.0, True, True, False, False, "silu")
    return dgate, dup, u


def _not_contiguous(dout, a, b):
    g = (a * 2.0).t().contiguous().t()
    return BWD(dout, g, b + 1.0, 1.0, 1.0, True, True, False, False, "silu")[:2]


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        (_read_after, "g is read after the backward (by sum"),
        (_view_read_after, "g is read after the backward (by view"),
        (_graph_inputs, "g is (a view of) a graph input"),
        (_view_of_graph_input, "g is (a view of) a graph input"),
        (_lora_grads, "not exactly dgate and dup are asked for"),
        (_same_tensor, "dout, g and u share storage"),
        (_graph_output, "u is read after the backward (by output)"),
        (_not_contiguous, "g is not contiguous"),
    ],
    ids=lambda x: x.__name__.strip("_") if callable(x) else "",
)
def test_declines_where_the_mutation_could_be_seen(fn, reason, caplog):
    args = inputs()
    with caplog.at_level("DEBUG", logger="fuser"):
        n, gm = rewrite(fn, *args)
    assert n == 0 and in_place_ops(gm) == 0
    assert f"stays out of place: {reason}" in caplog.text
    for e, o in zip(fn(*args), gm(*args), strict=True):
        assert torch.equal(e, o)


def test_the_in_place_op_writes_the_out_of_place_gradients():
    dout, g, u = (torch.randn(5, 7, dtype=torch.float64) for _ in range(3))
    expected = BWD(dout, g, u, 1.0, 1.0, True, True, False, False, "gelu_tanh")[:2]
    torch.ops.fuser.gated_activation_backward_(dout, g, u, 1.0, 1.0, "gelu_tanh")
    assert torch.equal(g, expected[0]) and torch.equal(u, expected[1])


# ---------------------------------------------------------------------------------------------------------
# accumulate_gated_dx: the down adapter's dx added into the base projection's gradient
# ---------------------------------------------------------------------------------------------------------

GRADS = torch.ops.fuser.upcast_linear_gated_grads


def acc_inputs():
    dy = torch.randn(ROWS, 4)
    gate, up, y = (torch.randn(ROWS, COLS).half() for _ in range(3))
    return dy, gate, up, 0.1 * torch.randn(4, COLS), y


def _summed(dy, gate, up, w, y):
    base = y * 2.0  # the base projection's gradient, made in the graph and read only by the add
    dx, dw = GRADS(dy, gate, up, w, 1.0, 1.0, "silu", True, True)
    return (dx + base) * 3.0, dw


def rewrite_acc(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    n = accumulate_gated_dx(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return n, gm


def test_dx_added_into_the_base_gradient_computes_the_same():
    args = acc_inputs()
    n, gm = rewrite_acc(_summed, *args)
    assert n == 1
    targets = [node.target for node in gm.graph.nodes]
    assert torch.ops.fuser.upcast_linear_gated_grads_acc_.default in targets and GRADS.default not in targets
    for e, o in zip(_summed(*args), gm(*args), strict=True):
        assert torch.equal(e, o)


def _base_read_after(dy, gate, up, w, y):
    base = y * 2.0
    dx, dw = GRADS(dy, gate, up, w, 1.0, 1.0, "silu", True, True)
    return dx + base, dw, base.sum()


def _base_is_input(dy, gate, up, w, y):
    dx, dw = GRADS(dy, gate, up, w, 1.0, 1.0, "silu", True, True)
    return dx + y, dw


def _dx_read_twice(dy, gate, up, w, y):
    base = y * 2.0
    dx, dw = GRADS(dy, gate, up, w, 1.0, 1.0, "silu", True, True)
    return dx + base, dx * 2.0, dw


def _scaled_add(dy, gate, up, w, y):
    base = y * 2.0
    dx, dw = GRADS(dy, gate, up, w, 1.0, 1.0, "silu", True, True)
    return torch.add(base, dx, alpha=2.0), dw


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        (_base_read_after, "the summand is read after the backward (by sum"),
        (_base_is_input, "the summand is (a view of) a graph input"),
        (_dx_read_twice, "dx is not read by exactly one node"),
        (_scaled_add, "dx is read by aten.add.Tensor, not a plain add"),
    ],
    ids=lambda x: x.__name__.strip("_") if callable(x) else "",
)
def test_dx_stays_separate_where_the_sum_could_be_seen(fn, reason, caplog):
    args = acc_inputs()
    with caplog.at_level("DEBUG", logger="fuser"):
        n, gm = rewrite_acc(fn, *args)
    assert n == 0
    assert f"stays out of place: {reason}" in caplog.text
    for e, o in zip(fn(*args), gm(*args), strict=True):
        assert torch.equal(e, o)
