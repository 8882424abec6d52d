"""Tier 2: ``fuser::upcast_linear`` — the values and gradients of ``F.linear(x.to(W.dtype), W, b)``, with ``x``
(not its fp32 copy) saved for the backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fuser.kernels.upcast_linear import upcast_linear


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def leaves(gen, lead, n_in, n_out, dtype, bias, requires):
    x = torch.randn(*lead, n_in, generator=gen).to(dtype).requires_grad_(requires[0])
    w = (0.1 * torch.randn(n_out, n_in, generator=gen)).requires_grad_(requires[1])
    b = torch.randn(n_out, generator=gen).requires_grad_(requires[2]) if bias else None
    return x, w, b


def grads(ts):
    return [None if t is None or t.grad is None else t.grad.clone() for t in ts]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("lead", [(7,), (2, 5)], ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("requires", [(True, True, True), (True, False, False), (False, True, True)], ids=str)
def test_same_values_and_gradients_as_the_upcast_linear(dtype, lead, bias, requires, gen):
    x, w, b = leaves(gen, lead, 24, 16, dtype, bias, requires)
    dy = torch.randn(*lead, 16, generator=gen)
    expected = F.linear(x.to(torch.float32), w, b)
    expected.backward(dy)
    ref = grads((x, w, b))
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    out = upcast_linear(x, w, b)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    assert torch.equal(out, expected), "forward is not the same fp32 linear of the same upcast values"
    out.backward(dy)
    for name, g, r, t in zip(("x", "weight", "bias"), grads((x, w, b)), ref, (x, w, b), strict=True):
        if r is None:
            assert g is None, f"d{name} formed but not asked for"
            continue
        assert g.dtype == t.dtype, f"d{name} of dtype {g.dtype}"
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6, msg=f"d{name}")
    # and against fp64 (the fp32 path is as accurate as eager's: x is exact in fp32)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    F.linear(x64, w64, None if b is None else b.detach().double()).backward(dy.double())
    if requires[1]:
        torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)


def test_saves_the_half_precision_input_not_its_upcast_copy(gen):
    x, w, b = leaves(gen, (2, 5), 24, 16, torch.bfloat16, False, (True, True, False))
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        upcast_linear(x, w).sum().backward()
    assert (torch.bfloat16, (2, 5, 24)) in saved, saved
    assert (torch.float32, (2, 5, 24)) not in saved and (torch.float32, (10, 24)) not in saved, saved
    # what eager keeps, for contrast: the fp32 copy
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.linear(x.float(), w).sum().backward()
    assert any(dt == torch.float32 and shape[-1] == 24 for dt, shape in saved), saved


def test_rejects_bad_arguments():
    x = torch.randn(3, 8).bfloat16()
    with pytest.raises(ValueError, match=r"weight \[out, in\] with in = x.shape\[-1\] = 8, got \(4, 7\)"):
        upcast_linear(x, torch.randn(4, 7))
    with pytest.raises(ValueError, match=r"bias \[4\] of the weight's dtype torch.float32, got \(5,\)"):
        upcast_linear(x, torch.randn(4, 8), torch.randn(5))
    with pytest.raises(ValueError, match="floating-point"):
        upcast_linear(torch.ones(3, 8, dtype=torch.long), torch.randn(4, 8))
