"""Tier 1: the RMSNorm pattern on toy graphs — every variant matches and computes the same; near-misses don't."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fuser

EPS = 1e-5
N = 48


# --- variants: each as the model code writes it -------------------------------------------------------------


def llama(x, w):  # Llama: cast back to the input dtype, then the weight multiply
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return w * h.to(x.dtype)


def olmo2(x, w):  # OLMo-2: weight multiplied in fp32, then the cast
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return (w * h).to(x.dtype)


def gemma(x, w):  # Gemma: (1 + weight), all fp32, cast at the end
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return (h * (1.0 + w.float())).type_as(x)


def gemma3n(x, w):  # Gemma-3n: pow(var + eps, -0.5)
    h = x.float()
    return (h * torch.pow(h.pow(2).mean(-1, keepdim=True) + EPS, -0.5) * w.float()).type_as(x)


def divide_by_sqrt(x, w):  # h / sqrt(var + eps), method spellings
    h = x.float()
    return w * (h / (h * h).mean(dim=-1, keepdim=True).add(EPS).sqrt()).to(x.dtype)


def sum_over_size(x, w):  # sum of squares divided by the hidden size
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) / N + EPS)).to(x.dtype)


def no_weight(x, w):  # nanochat: no weight at all
    h = x.float()
    return (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + EPS)).type_as(x)


def deepseek_v4_unweighted(x, w):  # DeepSeek-V4, GLM-5-Next: rstd in fp32, cast to x's dtype, then multiplied
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + EPS).to(x.dtype)


def functional(x, w):  # torch.nn.functional.rms_norm
    return F.rms_norm(x, (N,), w, EPS)


def qwen3_per_head(x, w):  # Qwen3 q/k norm: over head_dim of a 4-D [b, s, heads, head_dim] tensor
    q = x.view(*x.shape[:-1], 4, N // 4)
    h = q.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return (w[: N // 4] * h.to(x.dtype)).transpose(1, 2)


class RMSNormModule(torch.nn.Module):  # torch.nn.RMSNorm
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(N, eps=EPS)

    def forward(self, x, w):
        return self.norm(x)


VARIANTS = [
    llama,
    olmo2,
    gemma,
    gemma3n,
    divide_by_sqrt,
    sum_over_size,
    no_weight,
    deepseek_v4_unweighted,
    functional,
    qwen3_per_head,
    RMSNormModule(),
]


def _name(fn):
    return getattr(fn, "__name__", type(fn).__name__)


def _inputs(dtype):
    x = torch.randn(2, 5, N, dtype=dtype)
    w = (1.0 + 0.3 * torch.randn(N)).to(dtype)
    return x, w


@pytest.mark.parametrize("fn", VARIANTS, ids=_name)
def test_variant_matches_once(fn):
    report = fuser.explain(fn, *_inputs(torch.float32))
    assert report.counts == {"rms_norm": 1}, str(report)


@pytest.mark.parametrize("fn", VARIANTS, ids=_name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_variant_forward_and_backward_equal_eager(fn, dtype):
    if isinstance(fn, torch.nn.Module):
        fn = fn.to(dtype)
    x, w = _inputs(dtype)
    x.requires_grad_(True)
    w.requires_grad_(True)
    x_ref, w_ref = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
    out = torch.compile(fn, backend=fuser.backend(config))(x, w)
    assert fuser.backend(config).counts == {"rms_norm": 1}
    ref = fn(x_ref, w_ref)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    # fp32: the same maths up to summation order; fp16/bf16: at most one rounding of the result apart
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    dy = torch.randn_like(ref)
    out.backward(dy)
    ref.backward(dy)
    torch.testing.assert_close(x.grad.float(), x_ref.grad.float(), rtol=tol, atol=tol)
    if w_ref.grad is not None:
        # the weight gradient sums over 10 rows: eager rounds that sum in low precision, fuser in fp32
        torch.testing.assert_close(w.grad.float(), w_ref.grad.float(), rtol=4 * tol, atol=4 * tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_deepseek_v4_unweighted_norm_matches_in_half_precision(dtype):
    """transformers' own module: in fp32 its cast of rstd is a no-op the matcher looks through; in bf16/fp16 it is
    a real cast, which the fused op computes in fp32 (its one rounding is at the output)."""
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    norm = modeling.DeepseekV4UnweightedRMSNorm(eps=EPS)
    x = torch.randn(2, 5, N, dtype=dtype)
    report = fuser.explain(norm, x)
    assert report.counts == {"rms_norm": 1} and [m.variant for m in report.matches] == ["no weight"], str(report)
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
    out = torch.compile(norm, backend=fuser.backend(config))(x)
    ref = norm(x)
    assert out.dtype == ref.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=1.6e-2)


# the form each toy is reported as by fuser.explain: Llama and OLMo-2 round at different points, Gemma adds 1
FORM_NAMES = {llama: "llama", olmo2: "olmo2", gemma: "gemma", no_weight: "no weight", functional: "F.rms_norm"}


@pytest.mark.parametrize("fn", list(FORM_NAMES), ids=_name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_explain_names_each_form(fn, dtype):
    report = fuser.explain(fn, *_inputs(dtype))
    assert [m.variant for m in report.matches] == [FORM_NAMES[fn]], str(report)
    assert FORM_NAMES[fn] in str(report)


# --- near-misses: must not match ----------------------------------------------------------------------------


def layer_norm(x, w):
    return F.layer_norm(x, (N,), w, None, EPS)


def hand_written_layer_norm(x, w):  # mean-subtracted: LayerNorm without bias (Cohere)
    h = x.float()
    h = h - h.mean(-1, keepdim=True)
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def mean_over_other_dim(x, w):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-2, keepdim=True) + EPS)).to(x.dtype)


def no_eps(x, w):  # L2 normalisation, zaya qk style
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True))).to(x.dtype)


def weight_on_wrong_axis(x, w):  # a per-row scale, not a per-channel weight
    h = x.float()
    return w[:5, None] * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def sum_wrong_divisor(x, w):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) / (N + 1) + EPS)).to(x.dtype)


def different_tensors(x, w):  # the variance of one tensor normalising another
    h = x.float()
    return w * ((h + 1) * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


NEAR_MISSES = [layer_norm, mean_over_other_dim, no_eps, sum_wrong_divisor, different_tensors, hand_written_layer_norm]


@pytest.mark.parametrize("fn", NEAR_MISSES, ids=_name)
def test_near_miss_does_not_match(fn):
    report = fuser.explain(fn, *_inputs(torch.float32))
    if fn is hand_written_layer_norm:
        # the part after the mean subtraction *is* an RMSNorm of the centred tensor: fusing it is correct
        assert report.counts.get("rms_norm", 0) <= 1
        _assert_compiled_equals_eager(fn)
    elif fn is layer_norm:
        assert report.counts == {"layer_norm": 1}, str(report)  # LayerNorm's own pattern, never an RMSNorm
    else:
        assert report.counts == {}, str(report)


def l2_norm(x, w):  # Dory (nGPT): unit length, the sum of squares not divided by the hidden size
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + EPS)).type_as(x)


def fla_l2norm(x, w):  # FLA's l2norm of q/k (Qwen3-Next, Qwen3.5): (x * x).sum
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + EPS)


@pytest.mark.parametrize("fn", [l2_norm, fla_l2norm], ids=_name)
def test_l2_norm_declines_saying_it_is_not_an_rms_norm(fn):
    report = fuser.explain(fn, *_inputs(torch.float32))
    assert report.counts == {}, str(report)
    (miss,) = [nm for nm in report.near_misses if nm.pattern == "rms_norm"]  # one per norm, not one per root
    assert "an L2 norm" in miss.reason and "not divided by the hidden size" in miss.reason, miss.reason
    _assert_compiled_equals_eager(fn)


def test_weight_on_wrong_axis_declines_the_weight():
    """A per-row scale is not a weight: at most the plain norm under it is fused, and the result is unchanged."""
    report = fuser.explain(weight_on_wrong_axis, *_inputs(torch.float32))
    assert any("does not broadcast over the last dim" in nm.reason for nm in report.near_misses), str(report)
    assert all(m.variant == "no weight" for m in report.matches)
    _assert_compiled_equals_eager(weight_on_wrong_axis)


def cast_to_int_inside(x, w):  # not a norm of x: the normalised value truncated to integers
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.int32)


def cast_to_fp64_inside(x, w):
    h = x.float()
    return (w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).double()).float()


@pytest.mark.parametrize("fn", [cast_to_int_inside, cast_to_fp64_inside], ids=_name)
def test_cast_inside_to_a_dtype_the_op_does_not_compute_declines(fn):
    """Only the plain norm under the cast is fused (the cast and what follows stay as written)."""
    x, w = _inputs(torch.float32)
    report = fuser.explain(fn, x, w)
    dtype = "torch.int32" if fn is cast_to_int_inside else "torch.float64"
    assert any(f"inside the norm casts to {dtype}" in nm.reason for nm in report.near_misses), str(report)
    assert [m.variant for m in report.matches] == ["no weight"], str(report)
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
    out = torch.compile(fn, backend=fuser.backend(config))(x, w)
    torch.testing.assert_close(out, fn(x, w), rtol=1e-5, atol=1e-5)


def intermediate_used_elsewhere(x, w):
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return w * (h * rstd).to(x.dtype), rstd


def test_intermediate_used_elsewhere_declines_with_reason():
    report = fuser.explain(intermediate_used_elsewhere, *_inputs(torch.float32))
    assert report.counts == {}, str(report)
    assert any("also used by" in nm.reason for nm in report.near_misses)
    assert "also used by" in str(report)
    _assert_compiled_equals_eager(intermediate_used_elsewhere)


def _assert_compiled_equals_eager(fn):
    x, w = _inputs(torch.float32)
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
    out = torch.compile(fn, backend=fuser.backend(config))(x, w)
    ref = fn(x, w)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_rewrite_inside_autocast_region_keeps_autocast_dtypes():
    """An autocast region *inside* the compiled code: the fused ops return what eager returns there (the norm feeds
    only a trainable linear, so the pair is rms_norm_linear's: the linear computes in autocast's dtype)."""

    lin = torch.nn.Linear(N, N)

    def fn(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x)  # bf16 under autocast
            return lin(llama(y, w))

    x, w = torch.randn(3, N), 1.0 + 0.3 * torch.randn(N)
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
    out = torch.compile(fn, backend=fuser.backend(config))(x, w)
    ref = fn(x, w)
    assert fuser.backend(config).counts == {"rms_norm_linear": 1}
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=1.6e-2)
