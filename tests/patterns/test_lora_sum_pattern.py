"""Tier 1: peft's ``(base + lora_B(a) · s).to(base dtype)`` with an fp32 adapter under a half-precision base
becomes ``fuser::lora_sum`` (on by default); what it cannot take, it declines
with the reason in ``fuser.explain``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import fuser

STRICT = fuser.FuserConfig(patterns=("lora_sum",), inner_compiler="aot_eager", strict=True)
N_IN, N_OUT = 64, 48


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def lora_linear(x, w, a, b_lora, scale=2.0):  # peft: base(x) + lora_B(lora_A(x.to(fp32))) * s, cast back
    base = F.linear(x, w)
    return (base + F.linear(F.linear(x.to(a.dtype), a), b_lora) * scale).to(x.dtype)


def inputs(gen, dtype=torch.bfloat16, rank=8):
    x = torch.randn(4, 6, N_IN, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(N_OUT, N_IN, generator=gen).to(dtype).requires_grad_()
    a = (0.1 * torch.randn(rank, N_IN, generator=gen)).requires_grad_()
    b = (0.1 * torch.randn(N_OUT, rank, generator=gen)).requires_grad_()
    return x, w, a, b


def lora_linear_wide(x, w, a, b_lora, scale=2.0):  # the sum of the base's fp32 output, rounded once
    base = F.linear(x.float(), w.float())
    return (base + F.linear(F.linear(x.to(a.dtype), a), b_lora) * scale).to(x.dtype)


@pytest.mark.parametrize("fp32_base", [True, False], ids=["fp32 base", "rounded base"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_lora_b_sum_is_matched_and_trains_the_same(dtype, fp32_base, gen):
    """The sum is the function's output, stored rounded: by default (``fp32_base``) the op adds the term to the
    base's fp32 output and rounds once, bit for bit what that computes in fp32; switched off, peft's graph bit for
    bit. The backward, for the same incoming gradient, is eager's bit for bit either way."""
    config = dataclasses.replace(STRICT, experimental={"lora_sum": {"fp32_base": fp32_base}})
    x, w, a, b = inputs(gen, dtype)
    report = fuser.explain(lora_linear, x, w, a, b, config=config)
    assert report.counts == {"lora_sum": 1}, str(report)
    expected = (lora_linear_wide if fp32_base else lora_linear)(x, w, a, b)
    g = torch.randn(expected.shape, generator=gen).to(dtype)
    lora_linear(x, w, a, b).backward(g)
    ref = [t.grad.clone() for t in (x, w, a, b)]
    for t in (x, w, a, b):
        t.grad = None
    out = torch.compile(lora_linear, backend=fuser.backend(config))(x, w, a, b)
    out.backward(g)
    assert torch.equal(out, expected)
    if fp32_base:  # and the case discriminates: rounding the base first gives another sum
        assert not torch.equal(out, lora_linear(x, w, a, b))
    for name, t, r in zip(("x", "base weight", "lora_A", "lora_B"), (x, w, a, b), ref, strict=True):
        assert torch.equal(t.grad, r), f"d{name}"


def test_on_by_default():
    assert "lora_sum" in fuser.DEFAULT_PATTERNS and fuser.FuserConfig().enabled("lora_sum")
    x, w, a, b = inputs(torch.Generator().manual_seed(0))
    assert fuser.explain(lora_linear, x, w, a, b).counts.get("lora_sum") == 1


@pytest.mark.parametrize(
    "case, reason, applicable",
    [
        # an fp32 model: the op has nothing to do there, so explain lists the decline only when verbose
        ("fp32 model", "the base layer's output is torch.float32, not bf16/fp16", False),
        ("rank 65", "not a LoRA B of rank ≤ 64", True),
        ("bf16 adapter", "adapter of dtype torch.bfloat16", True),
    ],
)
def test_declines_with_a_reason(case, reason, applicable, gen):
    if case == "fp32 model":
        x, w, a, b = inputs(gen, torch.float32)
    elif case == "rank 65":
        x, w, a, b = inputs(gen, rank=65)
    else:
        x, w, a, b = inputs(gen)
        a, b = a.detach().bfloat16(), b.detach().bfloat16()
    report = fuser.explain(lora_linear, x, w, a, b, config=fuser.FuserConfig(patterns=("lora_sum",)))
    assert "lora_sum" not in report.counts
    misses = [m for m in report.near_misses if m.pattern == "lora_sum" and reason in m.reason]
    assert misses, [m.reason for m in report.near_misses]
    assert all(m.applicable == applicable for m in misses), [(m.reason, m.applicable) for m in misses]
    assert (reason in str(report)) == applicable, str(report)


def test_a_broadcast_base_is_not_matched(gen):
    x, w, a, b = inputs(gen)

    def broadcast(x, w, a, b_lora):  # the base is one row: the sum broadcasts, the op does not
        base = F.linear(x[:, :1], w)
        return (base + F.linear(F.linear(x.to(torch.float32), a), b_lora) * 2.0).to(x.dtype)

    report = fuser.explain(broadcast, x, w, a, b, config=fuser.FuserConfig(patterns=("lora_sum",)))
    assert "lora_sum" not in report.counts
    assert any("base of shape" in m.reason for m in report.near_misses), str(report)


def test_dora_is_not_matched(gen):
    """peft's DoRA scales the LoRA term by a per-output magnitude (``base + (m − 1)·base + m · lora_B(a) · s``):
    not ``base + lora_B(a) · s``, so nothing is fused and the output is eager's bit for bit."""
    x, w, a, b = inputs(gen)
    mag = 1.0 + 0.1 * torch.randn(N_OUT, generator=gen)

    def dora_linear(x, w, a, b_lora, mag):
        base = F.linear(x, w).to(torch.float32)
        lora = F.linear(F.linear(x.to(a.dtype), a), b_lora)
        return (base + (mag - 1) * base + mag * lora * 2.0).to(x.dtype)

    report = fuser.explain(dora_linear, x, w, a, b, mag)
    assert "lora_sum" not in report.counts, str(report)
    out = torch.compile(dora_linear, backend=fuser.backend(fuser.FuserConfig(inner_compiler="aot_eager")))
    assert torch.equal(out(x, w, a, b, mag), dora_linear(x, w, a, b, mag))


def qlora_linear(x, w, a, b_lora, scale=2.0):  # peft's bitsandbytes layers: the scaled term cast, then added
    base = F.linear(x, w)
    return base + (F.linear(F.linear(x.to(a.dtype), a), b_lora) * scale).to(x.dtype)


def test_bitsandbytes_order_is_matched_as_its_own_variant_and_trains_the_same(gen):
    x, w, a, b = inputs(gen)
    report = fuser.explain(qlora_linear, x, w, a, b, config=STRICT)
    assert report.counts == {"lora_sum": 1} and [m.variant for m in report.matches] == ["peft bitsandbytes"]
    expected = qlora_linear(x, w, a, b)
    expected.float().square().sum().backward()
    ref = [t.grad.clone() for t in (x, w, a, b)]
    for t in (x, w, a, b):
        t.grad = None
    out = torch.compile(qlora_linear, backend=fuser.backend(STRICT))(x, w, a, b)
    out.float().square().sum().backward()
    assert torch.equal(out, expected)
    for name, t, r in zip(("x", "base weight", "lora_A", "lora_B"), (x, w, a, b), ref, strict=True):
        assert torch.equal(t.grad, r), f"d{name}"
