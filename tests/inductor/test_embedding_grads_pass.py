"""The post-grad pass ``embedding_grads`` (``fuser.inductor.embedding_grads``) on aten graphs written the two ways
Inductor's decomposition of ``embedding_dense_backward`` writes them: torch ≤ 2.11's ``index_put(…, accumulate=True)``
of ``where(ids == padding_idx, 0, g)`` (what the H200's torch 2.11 produced, 2026-12-03), and the newer
``_unsafe_masked_index_put_accumulate`` with a validity mask; each alone, cast to bf16, and with a tied lm_head's
scaled gradient added. The rewritten graph computes what the original computed; the chains that must stay (a buffer
read twice, an add of another shape, no accumulate) stay."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fuser.inductor.embedding_grads import apply_embedding_grads, plan_embedding_grads

aten = torch.ops.aten
V, H, B, T, PAD = 29, 24, 2, 9, 4


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[0, :4] = PAD
    ids[1, :3] = 11
    grad = torch.randn(B, T, H, generator=g)
    head = torch.randn(V, H, generator=g).bfloat16()
    scale = torch.tensor(0.25)
    return ids, grad, head, scale


def zeros():
    return aten.full.default([V, H], 0, dtype=torch.float32, layout=torch.strided, device="cpu", pin_memory=False)


def scatter_old(ids, grad):  # torch ≤ 2.11
    values = aten.where.self((ids == PAD).unsqueeze(-1), torch.tensor(0.0), grad)
    return aten.index_put.default(zeros(), [ids], values, True)


def scatter_masked(ids, grad):  # newer torch
    valid = ((ids >= 0) & (ids < V) & (ids != PAD)).unsqueeze(-1)
    return aten._unsafe_masked_index_put_accumulate.default(zeros(), valid, [ids], grad)


SCATTERS = {"index_put": scatter_old, "masked": scatter_masked}


def cast(t):
    return torch.ops.prims.convert_element_type.default(t, torch.bfloat16)


def alone(scatter):
    return lambda ids, grad, head, scale: cast(scatter(ids, grad))


def tied(scatter):
    return lambda ids, grad, head, scale: aten.add.Tensor(aten.mul.Tensor(head, scale), cast(scatter(ids, grad)))


def tied_unscaled(scatter):
    return lambda ids, grad, head, scale: aten.add.Tensor(cast(scatter(ids, grad)), head)


def fp32_alone(scatter):
    return lambda ids, grad, head, scale: scatter(ids, grad)


# What Inductor's fused kernel computes for each (and the op with it): the same sums in fp32, rounded once at the end
ONE_ROUNDING = {
    alone: alone,
    tied: lambda scatter: lambda ids, grad, head, scale: cast(head.float() * scale + scatter(ids, grad)),
    tied_unscaled: lambda scatter: lambda ids, grad, head, scale: cast(scatter(ids, grad) + head.float()),
    fp32_alone: fp32_alone,
}


def rewrite(fn, args):
    gm = make_fx(fn)(*args)
    plan = plan_embedding_grads(gm.graph)
    taken = apply_embedding_grads(gm.graph, plan)
    gm.graph.lint()
    gm.recompile()
    return gm, taken


@pytest.mark.parametrize("form", SCATTERS)
@pytest.mark.parametrize("shape", [alone, tied, tied_unscaled, fp32_alone])
def test_the_chain_becomes_one_op_computing_the_same(form, shape):
    """Eager rounds the graph's bf16 intermediates (the cast sum, the scaled head); Inductor's fused kernel, and the
    op, sum in fp32 and round once: the rewritten graph equals that bit for bit, and eager within a rounding."""
    args = data()
    fn = shape(SCATTERS[form])
    eager = fn(*args)
    expected = ONE_ROUNDING[shape](SCATTERS[form])(*args)
    gm, taken = rewrite(fn, args)
    assert taken == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.fuser.embedding_grad.default in targets
    for gone in (aten.index_put.default, aten._unsafe_masked_index_put_accumulate.default, aten.full.default):
        assert gone not in targets
    if shape is tied:
        assert aten.mul.Tensor not in targets and aten.add.Tensor not in targets
    got = gm(*args)
    assert got.dtype == eager.dtype and torch.equal(got, expected)
    assert (got.double() - eager.double()).abs().max() <= 2**-7 * eager.double().abs().max()
    assert not got[PAD].any() or shape in (tied, tied_unscaled)  # the padding row receives nothing


def test_a_buffer_read_twice_stays():
    def fn(ids, grad, head, scale):
        buffer = zeros()
        summed = aten.index_put.default(buffer, [ids], grad, True)
        return cast(summed), buffer.sum()

    gm, taken = rewrite(fn, data())
    assert taken == 0


def test_a_plain_index_put_stays():
    gm, taken = rewrite(lambda ids, grad, head, scale: aten.index_put.default(zeros(), [ids], grad, False), data())
    assert taken == 0


def test_an_add_of_another_shape_is_left_outside():
    """A broadcast add is not a tied lm_head's gradient: the op takes the scatter and cast, the add stays."""
    args = data()
    fn = lambda ids, grad, head, scale: aten.add.Tensor(cast(scatter_old(ids, grad)), head[0])  # noqa: E731
    expected = fn(*args)
    gm, taken = rewrite(fn, args)
    assert taken == 1
    assert aten.add.Tensor in [n.target for n in gm.graph.nodes]
    assert torch.equal(gm(*args), expected)
