"""Tier 1: ``linear(x.to(fp32), W_fp32)`` with a half-precision ``x`` (peft's fp32 LoRA adapters) becomes
``fuser::upcast_linear``: same values and gradients, and the partitioner Inductor uses then saves ``x`` in bf16
instead of its fp32 copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fuser
from fuser.patterns import PATTERNS
from tests.models.tiny import load_saved_activations

STRICT = fuser.FuserConfig(patterns=("upcast_linear",), inner_compiler="aot_eager", strict=True)
N_IN, N_OUT, R = 64, 48, 8


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def lora_linear(x, w, a, b_lora):  # peft: base(x) + lora_B(lora_A(x.to(fp32))) * s, cast back
    base = F.linear(x, w)
    return (base + F.linear(F.linear(x.to(torch.float32), a), b_lora) * 2.0).to(x.dtype)


def inputs(gen, dtype=torch.bfloat16):
    x = torch.randn(4, 6, N_IN, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(N_OUT, N_IN, generator=gen).to(dtype)
    a = (0.1 * torch.randn(R, N_IN, generator=gen)).requires_grad_()
    b = (0.1 * torch.randn(N_OUT, R, generator=gen)).requires_grad_()
    return x, w, a, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_lora_a_is_matched_and_trains_the_same(dtype, gen):
    x, w, a, b = inputs(gen, dtype)
    report = fuser.explain(lora_linear, x, w, a, b, config=STRICT)
    assert report.counts == {"upcast_linear": 1}, str(report)  # lora_A only: lora_B's input is fp32 already
    expected = lora_linear(x, w, a, b)
    expected.float().square().sum().backward()
    ref = [t.grad.clone() for t in (x, a, b)]
    for t in (x, a, b):
        t.grad = None
    out = torch.compile(lora_linear, backend=fuser.backend(STRICT))(x, w, a, b)
    out.float().square().sum().backward()
    assert torch.equal(out, expected)
    for name, t, r in zip(("x", "lora_A", "lora_B"), (x, a, b), ref, strict=True):
        torch.testing.assert_close(t.grad, r, rtol=1e-6, atol=1e-6, msg=f"d{name}")


def saved_activations(fn, args, patterns):
    """What the forward saves for the backward under Inductor's partitioner (benchmarks/saved_activations.py)."""
    return load_saved_activations().saved_for_backward(fn, args, {}, patterns)


def test_the_partitioner_saves_bf16_not_its_fp32_copy(gen):
    x, w, a, b = inputs(gen)
    n_rows = x.numel() // N_IN

    def fp32_copies(saved):
        return [s for s in saved if s[0] == torch.float32 and s[1][-1] == N_IN and torch.Size(s[1]).numel() > N_IN * R]

    def nbytes(saved):
        return sum(torch.Size(shape).numel() * dtype.itemsize for dtype, shape in saved)

    before = saved_activations(lora_linear, (x, w, a, b), [])
    after = saved_activations(lora_linear, (x, w, a, b), [PATTERNS["upcast_linear"]])
    assert [torch.Size(s).numel() for _, s in fp32_copies(before)] == [n_rows * N_IN], before  # eager's choice
    assert fp32_copies(after) == [], after  # fuser saves x itself, a graph input here: no new bytes
    assert nbytes(after) <= nbytes(before) - n_rows * N_IN * 4, (before, after)


def test_declines_what_it_cannot_take(gen):
    x, w, a, b = inputs(gen)

    def fp32_input(x, a):  # nothing to save: the input is fp32 already
        return F.linear(x.float().exp().to(torch.float32), a)

    def fp64_cast(x, a):
        return F.linear(x.to(torch.float64), a.double())

    def under_autocast(x, a):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.linear(x.to(torch.float32), a)

    # an fp32 input: the pattern has nothing to do, a decline that explain lists only when verbose
    cases = ((fp32_input, "not bf16/fp16", False), (fp64_cast, "float64", True), (under_autocast, "autocast", True))
    for fn, reason, applicable in cases:
        report = fuser.explain(fn, x, a, config=STRICT)
        assert report.counts == {}, f"{fn.__name__}: {report}"
        misses = [nm for nm in report.near_misses if nm.pattern == "upcast_linear"]
        assert misses and reason in misses[0].reason, f"{fn.__name__}: {[nm.reason for nm in misses]}"
        assert misses[0].applicable == applicable, f"{fn.__name__}: {misses[0].reason}"
        assert ("upcast_linear" in str(report)) == applicable, str(report)


def test_cast_used_elsewhere_is_left_alone(gen):
    x, w, a, b = inputs(gen)

    def shared(x, a):
        xf = x.to(torch.float32)
        return F.linear(xf, a).sum() + xf.sum()

    report = fuser.explain(shared, x, a, config=STRICT)
    assert report.counts == {}, str(report)
