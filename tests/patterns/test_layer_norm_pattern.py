"""Tier 1: the LayerNorm pattern on toy graphs — every variant matches once and computes what eager computes
(forward and every gradient, fp32, half precision and under autocast); near-misses do not match and say why."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fuser

EPS = 1e-5
N = 63  # hidden size: not a power of two

STRICT = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")


# --- variants: each as the model code writes it -------------------------------------------------------------


def functional(x, w, b):  # F.layer_norm, also what Dynamo records for nn.LayerNorm
    return F.layer_norm(x, (N,), w, b, EPS)


def functional_no_affine(x, w, b):  # OLMo: F.layer_norm(x.float(), shape, None, None, eps).to(dtype)
    return F.layer_norm(x.float(), (N,), None, None, eps=EPS).to(x.dtype)


def by_hand(x, w, b):  # the BERT-era LayerNorm classes
    u = x.mean(-1, keepdim=True)
    s = (x - u).pow(2).mean(-1, keepdim=True)
    return w * ((x - u) / torch.sqrt(s + EPS)) + b


def cohere(x, w, b):  # Cohere: fp32, rsqrt, the weight in fp32, no bias, cast back
    h = x.to(torch.float32)
    mean = h.mean(-1, keepdim=True)
    variance = (h - mean).pow(2).mean(-1, keepdim=True)
    h = (h - mean) * torch.rsqrt(variance + EPS)
    return (w.to(torch.float32) * h).to(x.dtype)


def biased_var(x, w, b):  # var(unbiased=False), no affine map
    return (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + EPS)


class LayerNormModule(torch.nn.Module):  # nn.LayerNorm without bias (bias=False)
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(N, eps=EPS, bias=False)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.3)

    def forward(self, x, w, b):
        return self.norm(x)


VARIANTS = [functional, functional_no_affine, by_hand, cohere, biased_var]


def _inputs(dtype=torch.float32, param_dtype=None, requires_grad=True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, N, generator=g) * 2 + 1
    w = torch.randn(N, generator=g) * 0.3 + 1
    b = torch.randn(N, generator=g) * 0.3
    p = param_dtype or dtype
    return [t.to(d).requires_grad_(requires_grad) for t, d in ((x, dtype), (w, p), (b, p))]


def _run(fn, inputs):
    out = fn(*inputs)
    dy = torch.ones_like(out).normal_(generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, [t for t in inputs if t.requires_grad], dy, allow_unused=True)
    return out, grads


def _assert_same(fn, dtype, param_dtype=None, tol=1e-5, autocast=False):
    inputs = _inputs(dtype, param_dtype)
    ref_inputs = [t.detach().clone().requires_grad_() for t in inputs]
    compiled = torch.compile(fn, backend=fuser.backend(STRICT))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out, grads = _run(compiled, inputs)
        ref, ref_grads = _run(fn, ref_inputs)
    assert fuser.backend(STRICT).counts.get("layer_norm") == 1, fuser.backend(STRICT).counts
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    for name, g, r in zip("xwb", grads, ref_grads, strict=True):
        if r is None:
            assert g is None or not g.any(), name
            continue
        assert g.dtype == r.dtype, name
        torch.testing.assert_close(g.float(), r.float(), rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("fn", [*VARIANTS, LayerNormModule()], ids=lambda f: getattr(f, "__name__", "module"))
def test_variant_matches_once_and_equals_eager_fp32(fn):
    report = fuser.explain(fn, *_inputs(requires_grad=False))
    assert report.counts == {"layer_norm": 1}, str(report)
    _assert_same(fn, torch.float32)


@pytest.mark.parametrize("fn", [functional, by_hand, cohere])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_equals_eager(fn, dtype):
    # fuser rounds once where eager rounds each op: a few half-precision ulps apart (fp16 2^-10, bf16 2^-7)
    _assert_same(fn, dtype, tol={torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype])


def test_bf16_input_with_fp32_parameters():
    """A bf16 activation with fp32 weight and bias (norms kept in fp32 in a bf16 model): eager's layer_norm returns
    bf16, and so does the op; the fp32 parameters get fp32 gradients."""
    _assert_same(functional, torch.bfloat16, torch.float32, tol=3e-2)


def test_autocast_dtypes_as_eager_and_at_least_as_accurate():
    """Under bf16 autocast the op returns eager's dtypes (autocast's list decides the norm's dtype: fp32 on CUDA,
    bf16 on CPU), and its result and every gradient are at least as close to the fp32 step's as eager's."""

    def fn(x, w, b):
        return functional(x.to(torch.bfloat16), w, b)

    inputs = _inputs()
    fp32_out, fp32_grads = _run(functional, [t.detach().clone().requires_grad_() for t in inputs])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, grads = _run(torch.compile(fn, backend=fuser.backend(STRICT)), inputs)
        ref, ref_grads = _run(fn, [t.detach().clone().requires_grad_() for t in inputs])
    assert fuser.backend(STRICT).counts.get("layer_norm") == 1, fuser.backend(STRICT).counts
    assert out.dtype == ref.dtype
    pairs = [("y", out, ref, fp32_out), *zip("xwb", grads, ref_grads, fp32_grads, strict=True)]
    for name, got, eager, exact in pairs:
        assert got.dtype == eager.dtype, name
        err, err_eager = ((t.double() - exact.double()).norm().item() for t in (got, eager))
        assert err <= err_eager * 1.01 + 1e-6 * exact.double().norm().item(), (name, err, err_eager)


# --- near-misses ----------------------------------------------------------------------------------------------


def unbiased_var(x, w, b):  # var()'s default divides by d - 1: not LayerNorm's variance
    return (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True) + EPS)


def two_dims(x, w, b):  # normalized over the last two dims
    return F.layer_norm(x, x.shape[-2:], None, None, EPS)


def residual_not_bias(x, w, b):  # a full-size tensor added after the norm is a residual, not its bias
    u = x.mean(-1, keepdim=True)
    s = (x - u).pow(2).mean(-1, keepdim=True)
    return w * ((x - u) / torch.sqrt(s + EPS)) + x


def normed_used_twice(x, w, b):
    u = x.mean(-1, keepdim=True)
    n = (x - u) * torch.rsqrt((x - u).pow(2).mean(-1, keepdim=True) + EPS)
    return w * n + b, n.sum()


@pytest.mark.parametrize(
    "fn, reason",
    [
        (unbiased_var, "the variance is var() with correction 1"),
        (two_dims, "normalized_shape"),
    ],
    ids=["unbiased", "two_dims"],
)
def test_near_miss_declines_and_says_why(fn, reason):
    report = fuser.explain(fn, *_inputs(requires_grad=False))
    assert "layer_norm" not in report.counts, str(report)
    assert any(reason in nm.reason for nm in report.near_misses), str(report)
    inputs = _inputs(requires_grad=False)
    out = torch.compile(fn, backend=fuser.backend(STRICT))(*inputs)
    torch.testing.assert_close(out, fn(*inputs), rtol=1e-5, atol=1e-5)


def test_residual_after_the_norm_is_not_taken_as_its_bias():
    """``w * norm(x) + x``: the weight-only form fuses, the residual add stays outside the op."""
    report = fuser.explain(residual_not_bias, *_inputs(requires_grad=False))
    assert report.counts == {"layer_norm": 1}, str(report)
    assert report.matches[0].variant == "no bias"
    _assert_same(residual_not_bias, torch.float32)


def test_hand_written_layer_norm_is_not_an_rms_norm():
    """A LayerNorm whose centred value is computed once reads, from that value on, as an RMSNorm without weight:
    it is taken whole as a LayerNorm, never as an RMSNorm of the centred value."""

    def centred_once(x, w, b):
        d = x - x.mean(-1, keepdim=True)
        return d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + EPS)

    report = fuser.explain(centred_once, *_inputs(requires_grad=False))
    assert report.counts == {"layer_norm": 1}, str(report)


def test_normalised_value_read_elsewhere_keeps_the_affine_map_outside():
    """``n`` read by something else: the whole norm with its weight and bias declines, saying so, and the
    normalisation alone (which computes ``n``) fuses."""
    report = fuser.explain(normed_used_twice, *_inputs(requires_grad=False))
    assert report.counts == {"layer_norm": 1}, str(report)
    assert report.matches[0].variant == "no weight"
    assert any("also used by" in nm.reason for nm in report.near_misses), str(report)
    inputs = _inputs(requires_grad=False)
    out = torch.compile(normed_used_twice, backend=fuser.backend(STRICT))(*inputs)
    for got, want in zip(out, normed_used_twice(*inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
