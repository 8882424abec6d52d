"""Tier 1: the RoPE pattern on toy graphs — each spelling matches (q and k fused into one op) and equals eager."""

from __future__ import annotations

import pytest
import torch

import fuser
from fuser.engine.canonical import canonical

B, HQ, HK, T, D = 2, 4, 2, 5, 16


def rotate_half(x):  # Hugging Face
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_interleaved(x):  # GLM, Helium: pairs (x[2i], x[2i+1])
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def llama(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def partial(q, k, cos, sin):  # Phi, GPT-NeoX: only the first R channels rotate
    cos, sin = cos.unsqueeze(1)[..., : D // 2], sin.unsqueeze(1)[..., : D // 2]
    r = cos.shape[-1]
    q_rot, q_pass, k_rot, k_pass = q[..., :r], q[..., r:], k[..., :r], k[..., r:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


def glm_interleaved_partial(q, k, cos, sin):  # GLM-4: interleaved, partial, cos/sin repeat-interleaved
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)[..., : D // 2]
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)[..., : D // 2]
    r = cos.shape[-1]
    q_rot, q_pass, k_rot, k_pass = q[..., :r], q[..., r:], k[..., :r], k[..., r:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_interleaved(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_interleaved(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


def deepseek_v3(q, k, cos, sin):  # interleaved pairs in, halves out, no neg; cos/sin of width R/2
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(1)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    q_embed = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
    k_embed = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    return q_embed, k_embed


def gpt_oss_chunked(q, k, cos, sin):  # rotate_half's rotation on chunk()'s halves, no neg; cos/sin of width R/2
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(1)

    def rotate(x):
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q), rotate(k)


def rotate_half_flipped(x):  # NanoChat: the sign on the other half, -rotate_half(x)
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((x2, -x1), dim=-1)


def nanochat(q, k, cos, sin):  # a rotation by -angle: the op gets -sin
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half_flipped(q) * sin), (k * cos) + (rotate_half_flipped(k) * sin)


def q_only(q, k, cos, sin):  # a lone rotation still fuses (into the same op, with no k)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), k * 2


VARIANTS = [llama, partial, glm_interleaved_partial, deepseek_v3, gpt_oss_chunked, nanochat, q_only]


def _inputs(dtype=torch.float32, requires_grad=False, cos_dtype=None):
    # q and k as Hugging Face makes them: [B, T, H, D] projections viewed as [B, H, T, D]; cos/sin in
    # ``cos_dtype`` (None: q's), as HF's rotary embedding returns them
    q = torch.randn(B, T, HQ, D, dtype=dtype).transpose(1, 2)
    k = torch.randn(B, T, HK, D, dtype=dtype).transpose(1, 2)
    angles = torch.randn(1, T, D // 2)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(cos_dtype or dtype), emb.sin().to(cos_dtype or dtype)
    if requires_grad:
        q = q.detach().requires_grad_()
        k = k.detach().requires_grad_()
    return q, k, cos, sin


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _fp64(t):
    return t.to(torch.complex128) if t.is_complex() else t.double() if t.is_floating_point() else t


def _assert_fused_as_close_to_fp64_as_eager(fn, args, n_grad=2, inner_compiler="aot_eager", eager_strides=False):
    """``fn`` through fuser (one rope op) against eager and against ``fn`` on fp64 copies of ``args``, whose first
    ``n_grad`` are differentiated: the outputs and those gradients, in eager's dtypes (and strides, where
    ``eager_strides``: on a transposed [B, H, T, D] view the op keeps q's layout where eager's cat makes a
    contiguous result). A result in fp32 is the same fp32 maths as eager's (within 1e-5 of it) and within fp32
    rounding of fp64 (1e-6 normwise); one in half precision is no further from fp64 than eager's (normwise), with
    no slack: the op rounds once, eager after each product."""
    fused_in = [a.detach().clone().requires_grad_() for a in args[:n_grad]] + list(args[n_grad:])
    eager_in = [a.detach().clone().requires_grad_() for a in args[:n_grad]] + list(args[n_grad:])
    ref_in = [_fp64(a.detach()).requires_grad_() for a in args[:n_grad]] + [_fp64(a) for a in args[n_grad:]]
    config = fuser.FuserConfig(strict=True, inner_compiler=inner_compiler)
    out = torch.compile(fn, backend=fuser.backend(config))(*fused_in)
    assert fuser.backend(config).counts == {"rope": 1}
    eager = fn(*eager_in)
    ref = fn(*ref_in)
    grads = [torch.randn_like(r) for r in ref]
    torch.autograd.backward(out, [g.to(o.dtype) for g, o in zip(grads, out, strict=True)])
    torch.autograd.backward(eager, [g.to(e.dtype) for g, e in zip(grads, eager, strict=True)])
    torch.autograd.backward(ref, grads)
    grad_triples = [(f.grad, e.grad, r.grad) for f, e, r in zip(fused_in, eager_in, ref_in[:n_grad], strict=False)]
    for got, eager_value, want in [*zip(out, eager, ref, strict=True), *grad_triples]:
        assert got.dtype == eager_value.dtype and got.shape == eager_value.shape
        assert not eager_strides or got.stride() == eager_value.stride()
        if got.dtype == torch.float32:
            torch.testing.assert_close(got, eager_value, rtol=1e-5, atol=1e-5)
            assert _rel(got, want) <= 1e-6, _rel(got, want)
        else:
            assert _rel(got, want) <= _rel(eager_value, want), (got.dtype, _rel(got, want), _rel(eager_value, want))


@pytest.mark.parametrize("fn", VARIANTS, ids=lambda f: f.__name__)
def test_variant_matches_as_one_op(fn):
    report = fuser.explain(fn, *_inputs())
    assert report.counts == {"rope": 1}, str(report)


@pytest.mark.parametrize("fn", VARIANTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_variant_forward_and_backward_are_as_close_to_fp64_as_eager(fn, dtype):
    _assert_fused_as_close_to_fp64_as_eager(fn, _inputs(dtype))


# q/k and cos/sin of different dtypes: eager promotes (bf16 q from an autocast linear times fp32 cos gives fp32,
# HF Trainer bf16=True with fp32 master weights), and so does the fused op, through its out_dtype argument
MIXED = [
    pytest.param(torch.bfloat16, torch.float32, id="bf16_q_fp32_cos"),
    pytest.param(torch.float16, torch.float32, id="fp16_q_fp32_cos"),
    pytest.param(torch.float32, torch.bfloat16, id="fp32_q_bf16_cos"),
    pytest.param(torch.float16, torch.bfloat16, id="fp16_q_bf16_cos"),
]


@pytest.mark.parametrize("fn", VARIANTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype, cos_dtype", MIXED)
def test_mixed_dtypes_match_as_one_op_and_are_as_close_to_fp64_as_eager(fn, dtype, cos_dtype):
    """The rotated values come out in the promoted dtype (fp32 here: the same fp32 maths as eager's); the gradients
    in q's, formed once (eager rounds each term's gradient before summing them)."""
    q, k, cos, sin = _inputs(dtype, cos_dtype=cos_dtype)
    assert fuser.explain(fn, q, k, cos, sin).counts == {"rope": 1}
    assert fn(q, k, cos, sin)[0].dtype == torch.promote_types(dtype, cos_dtype)
    _assert_fused_as_close_to_fp64_as_eager(fn, (q, k, cos, sin))


def attention_rope_under_autocast(x, wq, wk, cos, sin):
    # Llama's attention up to the rotation: linear projections (bf16 under autocast) rotated by fp32 cos/sin
    q = torch.nn.functional.linear(x, wq).view(B, T, HQ, D).transpose(1, 2)
    k = torch.nn.functional.linear(x, wk).view(B, T, HK, D).transpose(1, 2)
    return llama(q, k, cos, sin)


def test_autocast_projections_with_fp32_cos_fuse_and_equal_eager():
    hidden = 32
    x = torch.randn(B, T, hidden)
    wq = (torch.randn(HQ * D, hidden) / hidden**0.5).requires_grad_()
    wk = (torch.randn(HK * D, hidden) / hidden**0.5).requires_grad_()
    _, _, cos, sin = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = fuser.explain(attention_rope_under_autocast, x, wq, wk, cos, sin)
    assert report.counts == {"rope": 1}, str(report)
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
    wq_ref, wk_ref = wq.detach().clone().requires_grad_(), wk.detach().clone().requires_grad_()
    compiled = torch.compile(attention_rope_under_autocast, backend=fuser.backend(config))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x, wq, wk, cos, sin)
        ref = attention_rope_under_autocast(x, wq_ref, wk_ref, cos, sin)
    assert fuser.backend(config).counts == {"rope": 1}
    for o, r in zip(out, ref, strict=True):
        assert o.dtype == r.dtype == torch.float32
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
    grads = [torch.randn_like(r) for r in ref]
    torch.autograd.backward(out, grads)
    torch.autograd.backward(ref, grads)
    for w, w_ref in ((wq, wq_ref), (wk, wk_ref)):
        assert w.grad.dtype == w_ref.grad.dtype == torch.float32
        # the gradient of the bf16 projection output is rounded to bf16 in both (eager per term, fuser once),
        # then goes through a bf16 matmul: judged over the whole tensor, within one bf16 eps (7.8e-3)
        err = ((w.grad - w_ref.grad).norm() / w_ref.grad.norm()).item()
        assert err <= 7.8e-3, err


def fp64_cos(q, k, cos, sin):  # fp64 rotary tables: the fused op computes for fp32/bf16/fp16 only
    return llama(q, k, cos.double(), sin.double())


def fp64_q(q, k, cos, sin):
    return llama(q.double(), k.double(), cos, sin)


@pytest.mark.parametrize(
    "fn, reason",
    [(fp64_cos, "cos is torch.float64: the fused op reads cos of"), (fp64_q, "input dtype torch.float64 is not")],
    ids=["fp64_cos", "fp64_q"],
)
def test_dtype_the_op_cannot_take_declines_with_reason(fn, reason):
    report = fuser.explain(fn, *_inputs())
    assert report.counts == {}, str(report)
    assert any(reason in nm.reason for nm in report.near_misses), str(report)
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
    inputs = _inputs()
    out = torch.compile(fn, backend=fuser.backend(config))(*inputs)
    for o, r in zip(out, fn(*inputs), strict=True):
        assert o.dtype == r.dtype == torch.float64
        torch.testing.assert_close(o, r)


# --- near-misses --------------------------------------------------------------------------------------------


def no_sign(q, k, cos, sin):  # cat(x2, x1): no negation, not a rotation
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    h = D // 2
    rot = torch.cat((q[..., h:], q[..., :h]), dim=-1)
    return q * cos + rot * sin, k


def both_signs(q, k, cos, sin):  # cat(-x2, -x1): both halves negated, not a rotation
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    h = D // 2
    rot = torch.cat((-q[..., h:], -q[..., :h]), dim=-1)
    return q * cos + rot * sin, k


def halves_swapped(q, k, cos, sin):  # cat(-x1, x2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    h = D // 2
    rot = torch.cat((-q[..., :h], q[..., h:]), dim=-1)
    return q * cos + rot * sin, k


def uneven_split(q, k, cos, sin):  # halves split at the wrong place
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = torch.cat((-q[..., 6:], q[..., :6]), dim=-1)
    return q * cos + rot * sin, k


def deepseek_wrong_pairing(q, k, cos, sin):  # odd channel where the even one belongs: not a rotation
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(1)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    return torch.cat([q1 * cos - q2 * sin, q1 * cos + q2 * sin], dim=-1), k


@pytest.mark.parametrize(
    "fn", [no_sign, both_signs, halves_swapped, uneven_split, deepseek_wrong_pairing], ids=lambda f: f.__name__
)
def test_near_miss_does_not_match(fn):
    report = fuser.explain(fn, *_inputs())
    assert report.counts == {}, str(report)


def test_sign_flipped_form_equals_an_fp64_rotation_by_minus_the_angle():
    """NanoChat's ``x * cos + cat(x2, -x1) * sin`` fused (fp32) against the rotation by -angle computed in fp64,
    forward and backward: the op's sign convention (it gets -sin) is exact, not approximate."""
    q, k, cos, sin = _inputs(requires_grad=True)
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
    out = torch.compile(nanochat, backend=fuser.backend(config))(q, k, cos, sin)
    assert fuser.backend(config).counts == {"rope": 1}
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    ref = llama(q64, k64, cos.double(), -sin.double())  # rotate_half, sin negated
    for o, r in zip(out, ref, strict=True):
        torch.testing.assert_close(o.double(), r, rtol=1e-6, atol=1e-6)
    grads = [torch.randn_like(o) for o in out]
    torch.autograd.backward(out, grads)
    torch.autograd.backward(ref, [g.double() for g in grads])
    torch.testing.assert_close(q.grad.double(), q64.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k.grad.double(), k64.grad, rtol=1e-6, atol=1e-6)


def different_cos_for_q_and_k(q, k, cos, sin):
    c1, s1 = cos.unsqueeze(1), sin.unsqueeze(1)
    c2, s2 = (cos * 0.5).unsqueeze(1), (sin * 0.5).unsqueeze(1)
    return (q * c1) + (rotate_half(q) * s1), (k * c2) + (rotate_half(k) * s2)


def test_different_cos_for_q_and_k_are_not_fused_together():
    report = fuser.explain(different_cos_for_q_and_k, *_inputs())
    assert report.counts == {"rope": 2}, str(report)  # two lone rotations, never one op with one cos
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
    inputs = _inputs()
    out = torch.compile(different_cos_for_q_and_k, backend=fuser.backend(config))(*inputs)
    for o, r in zip(out, different_cos_for_q_and_k(*inputs), strict=True):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)


def cos_not_of_rotary_width(q, k, cos, sin):
    # cos/sin of width 1 broadcast over the channels: a valid computation, but not a rotation of width D
    c, s_ = cos[..., :1].unsqueeze(1), sin[..., :1].unsqueeze(1)
    return (q * c) + (rotate_half(q) * s_), k


def test_rotary_dim_not_matching_cos_width_declines_with_reason():
    report = fuser.explain(cos_not_of_rotary_width, *_inputs())
    assert report.counts == {}, str(report)
    assert any("does not match the rotary dim" in nm.reason for nm in report.near_misses), str(report)
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
    inputs = _inputs()
    out = torch.compile(cos_not_of_rotary_width, backend=fuser.backend(config))(*inputs)
    torch.testing.assert_close(out[0], cos_not_of_rotary_width(*inputs)[0], rtol=1e-5, atol=1e-5)


def llama4_complex(xq, xk, freqs_cis):  # Llama-4 text: complex rotation of [B, T, H, D]
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis[:, :, None, :]).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis[:, :, None, :]).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_complex_form_matches_as_one_op_and_is_as_close_to_fp64_as_eager(dtype):
    xq = torch.randn(B, T, HQ, D, dtype=dtype, requires_grad=True)
    xk = torch.randn(B, T, HK, D, dtype=dtype, requires_grad=True)
    freqs_cis = torch.polar(torch.ones(1, T, D // 2), torch.randn(1, T, D // 2))
    assert fuser.explain(llama4_complex, xq, xk, freqs_cis).counts == {"rope": 1}
    _assert_fused_as_close_to_fp64_as_eager(llama4_complex, (xq, xk, freqs_cis))


def llama4_complex_uncast(xq, xk, freqs_cis):  # without the final type_as: an fp32 result from bf16 inputs
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    return torch.view_as_real(xq_ * freqs_cis[:, :, None, :]).flatten(3), torch.view_as_real(
        xk_ * freqs_cis[:, :, None, :]
    ).flatten(3)


def test_complex_form_with_a_wider_result_matches_and_is_as_close_to_fp64_as_eager():
    xq = torch.randn(B, T, HQ, D, dtype=torch.bfloat16, requires_grad=True)
    xk = torch.randn(B, T, HK, D, dtype=torch.bfloat16, requires_grad=True)
    freqs_cis = torch.polar(torch.ones(1, T, D // 2), torch.randn(1, T, D // 2))
    assert fuser.explain(llama4_complex_uncast, xq, xk, freqs_cis).counts == {"rope": 1}
    assert llama4_complex_uncast(xq, xk, freqs_cis)[0].dtype == torch.float32
    _assert_fused_as_close_to_fp64_as_eager(llama4_complex_uncast, (xq, xk, freqs_cis))


def deepseek_v2_complex(xq, xk, freqs_cis):  # DeepSeek-V2: rotations unsqueezed once, q and k of [B, H, T, D]
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.unsqueeze(1).to(xq_.device)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xk)
    return xq_out, xk_out


def complex_shaped_heads_third(xq, xk, freqs_cis):  # rotations shaped [1, T, 1, D/2] once, on [B, T, H, D]
    freqs_cis = freqs_cis.unsqueeze(2)
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq)
    return xq_out, torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xk)


@pytest.mark.parametrize(
    "fn, heads_second",
    [(deepseek_v2_complex, True), (complex_shaped_heads_third, False)],
    ids=["deepseek_v2", "heads_third"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_complex_form_with_shaped_rotations_matches_as_one_op_and_is_as_close_to_fp64_as_eager(fn, heads_second, dtype):
    shape = (B, HQ, T, D) if heads_second else (B, T, HQ, D)
    xq = torch.randn(*shape, dtype=dtype, requires_grad=True)
    xk = torch.randn(*((B, 1, T, D) if heads_second else (B, T, 1, D)), dtype=dtype, requires_grad=True)
    freqs_cis = torch.polar(torch.ones(1, T, D // 2), torch.randn(1, T, D // 2))
    report = fuser.explain(fn, xq, xk, freqs_cis)
    assert report.counts == {"rope": 1}, str(report)
    assert {m.variant for m in report.matches} == {"complex, shaped"}
    _assert_fused_as_close_to_fp64_as_eager(fn, (xq, xk, freqs_cis))


def test_complex_form_with_a_per_head_rotation_declines():
    """Rotations that differ per head ([B, T, H, D/2] complex) are not the broadcast cos/sin the op takes."""

    def per_head(xq, freqs):
        z = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        return torch.view_as_real(z * freqs).flatten(3).type_as(xq)

    xq = torch.randn(B, T, HQ, D)
    freqs = torch.polar(torch.ones(B, T, HQ, D // 2), torch.randn(B, T, HQ, D // 2))
    assert fuser.explain(per_head, xq, freqs).counts == {}


# The same rotations on [B, T, H, D] q/k, cos/sin unsqueezed at dim 2 (GPT-J, CodeGen, the DeepSeek-V3.2 and HY-V4
# indexers): the op runs on the [B, H, T, D] view, with half-width cos/sin repeated over both halves first
def llama_heads_third(q, k, cos, sin):
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def pairs_to_halves_heads_third(q, k, cos, sin):  # HY-V4's indexer (transformers 5.25)
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(2)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(2)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    return torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], -1), torch.cat(
        [k1 * cos - k2 * sin, k2 * cos + k1 * sin], -1
    )


def chunked_heads_third(q, k, cos, sin):
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(2)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(2)

    def rotate(x):
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q), rotate(k)


def sign_flipped_heads_third(q, k, cos, sin):
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return (q * cos) + (rotate_half_flipped(q) * sin), (k * cos) + (rotate_half_flipped(k) * sin)


HEADS_THIRD = [llama_heads_third, pairs_to_halves_heads_third, chunked_heads_third, sign_flipped_heads_third]


def _inputs_heads_third(dtype, shape=(B, T, HQ, HK, D), device="cpu"):
    b, t, hq, hk, d = shape
    q = torch.randn(b, t, hq, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(b, t, hk, d, dtype=dtype, device=device, requires_grad=True)
    angles = torch.randn(1, t, d // 2, device=device)
    emb = torch.cat((angles, angles), dim=-1)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


def _check_heads_third(fn, dtype, shape, device, inner_compiler):
    """One op for q and k, its results in q's [B, T, H, D] layout, as close to fp64 as the helper above asks."""
    q, k, cos, sin = _inputs_heads_third(dtype, shape, device)
    report = fuser.explain(fn, q, k, cos, sin)
    assert report.counts == {"rope": 1} and not report.near_misses, str(report)
    _assert_fused_as_close_to_fp64_as_eager(fn, (q, k, cos, sin), inner_compiler=inner_compiler, eager_strides=True)


@pytest.mark.parametrize("fn", HEADS_THIRD, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_heads_third_rotations_match_as_one_op_and_are_as_close_to_fp64_as_eager(fn, dtype):
    _check_heads_third(fn, dtype, (B, T, HQ, HK, D), "cpu", "aot_eager")


@pytest.mark.gpu
@pytest.mark.parametrize("fn", HEADS_THIRD, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_heads_third_rotations_at_real_widths(fn, dtype):
    """The same forms on the GPU's Triton kernel at a real attention's widths (2×2048 tokens, 32 q / 8 kv heads of
    128), through Inductor: fp32 within fp32 rounding of fp64 (the kernel's cos·x + sin·x' is two roundings), bf16
    no further from fp64 than eager bf16."""
    torch.manual_seed(0)
    _check_heads_third(fn, dtype, (2, 2048, 32, 8, 128), "cuda", "inductor")


# --- multimodal (M-RoPE) and 2-D rotary embeddings -----------------------------------------------------------
# The rotation is the Llama form; what differs is how cos/sin are built from several position ids (t, h, w for
# Qwen2-VL's text, h and w for the vision towers). That is position-only data the rotation reads as it is, so the
# fused op must match with the cos/sin computation in the same graph, in front of it.

MROPE_SECTION = (2, 3, 3)  # t, h, w sections of the D/2 = 8 frequencies (Qwen2-VL's [16, 24, 24] at D 128)


def _mrope_inputs(dtype=torch.float32):
    """q, k as Hugging Face hands them over; (t, h, w) positions [3, B, T] that differ per axis (an image's grid),
    and the inverse frequencies [D/2]."""
    q, k, _, _ = _inputs(dtype)
    positions = torch.stack([torch.arange(T), torch.arange(T) // 2, torch.arange(T) % 3 + 1]).expand(B, 3, T)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    return q, k, positions.transpose(0, 1).contiguous(), inv_freq


def qwen2_vl_mrope_in_attention(q, k, positions, inv_freq):
    """transformers 4.x's Qwen2-VL: cos/sin [3, B, T, D] of the three position axes, split into sections (both halves)
    and re-concatenated inside the attention's ``apply_multimodal_rotary_pos_emb``, then the Llama rotation."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    sections = list(MROPE_SECTION) * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(sections, dim=-1))], dim=-1).unsqueeze(1)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(sections, dim=-1))], dim=-1).unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def qwen2_vl_mrope(q, k, positions, inv_freq):
    """transformers 5.x's Qwen2-VL / Qwen2.5-VL: the rotary embedding recomposes the frequencies by sections, the
    attention runs the Llama ``apply_rotary_pos_emb``."""
    freqs = positions[..., None].float() * inv_freq
    freqs = torch.cat([m[i % 3] for i, m in enumerate(freqs.split(list(MROPE_SECTION), dim=-1))], dim=-1)
    emb = torch.cat((freqs, freqs), dim=-1)
    return llama(q, k, emb.cos(), emb.sin())


def qwen3_vl_interleaved_mrope(q, k, positions, inv_freq):
    """Qwen3-VL: the h and w frequencies written over every third of t's (``apply_interleaved_mrope``, in place)."""
    freqs = positions[..., None].float() * inv_freq
    freqs_thw = freqs[0]
    for dim, offset in enumerate((1, 2), start=1):
        length = MROPE_SECTION[dim] * 3
        freqs_thw[..., offset:length:3] = freqs[dim, ..., offset:length:3]
    emb = torch.cat((freqs_thw, freqs_thw), dim=-1)
    return llama(q, k, emb.cos(), emb.sin())


def mrope_halves_disagree(q, k, positions, inv_freq):
    """Sections over the whole head dim, not repeated per half: channel i and its partner i + D/2 get the angles
    of different axes. Not a rotation, but the fused op reads cos/sin at each output channel, so it computes
    exactly what eager does: it fuses, and must equal eager."""
    freqs = positions[..., None].float() * torch.cat((inv_freq, inv_freq))
    freqs = torch.cat([m[i % 3] for i, m in enumerate(freqs.split([4, 6, 6], dim=-1))], dim=-1)
    return llama(q, k, freqs.cos(), freqs.sin())


MROPE = [qwen2_vl_mrope_in_attention, qwen2_vl_mrope, qwen3_vl_interleaved_mrope, mrope_halves_disagree]


@pytest.mark.parametrize("fn", MROPE, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_mrope_matches_as_one_op_and_is_as_close_to_fp64_as_eager(fn, dtype):
    """Each form fuses q and k into one op with the section split and concat left in front of it, as eager runs
    them; fp32 cos/sin rotate q/k of each dtype (the result fp32, eager's promotion)."""
    inputs = _mrope_inputs(dtype)
    report = fuser.explain(fn, *inputs)
    assert report.counts == {"rope": 1} and not report.near_misses, str(report)
    _assert_fused_as_close_to_fp64_as_eager(fn, inputs)


def test_mrope_equals_a_float64_rotation_by_the_sectioned_angles():
    """Qwen2-VL's M-RoPE, fused, against hand-built fp64 angles: channel c of the rotated half i < D/2 takes the
    angle of axis t, h or w by the section i falls in (sections 2, 3, 3), forward and backward."""
    q, k, positions, inv_freq = _mrope_inputs()
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
    out = torch.compile(qwen2_vl_mrope, backend=fuser.backend(config))(q, k, positions, inv_freq)
    assert fuser.backend(config).counts == {"rope": 1}
    axis = torch.tensor([0] * 2 + [1] * 3 + [2] * 3)  # the position axis of each of the D/2 frequencies
    angles = positions.double()[axis, :, :].permute(1, 2, 0) * inv_freq.double()  # [B, T, D/2]
    cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]
    h = D // 2
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    ref = [x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin for x in (q64, k64)]
    for o, r in zip(out, ref, strict=True):
        torch.testing.assert_close(o.double(), r, rtol=1e-6, atol=1e-6)
    grads = [torch.randn_like(o) for o in out]
    torch.autograd.backward(out, grads)
    torch.autograd.backward(ref, [g.double() for g in grads])
    torch.testing.assert_close(q.grad.double(), q64.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k.grad.double(), k64.grad, rtol=1e-6, atol=1e-6)


def qwen2_vl_vision(qkv, cos, sin):
    """Qwen2-VL's vision attention (and Qwen2.5-VL's, Qwen3-VL's, GLM-4V's, ...): q/k [T, H, D] of all tokens of all
    images from one packed projection, rotated in fp32 by cos/sin [T, D] of the (h, w) positions, cast back."""
    q, k, _ = qkv.reshape(T, 3, HQ, -1).permute(1, 0, 2, 3).unbind(0)
    orig_q_dtype, orig_k_dtype = q.dtype, k.dtype
    q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed.to(orig_q_dtype), k_embed.to(orig_k_dtype)


def vision_partial(qkv, cos, sin):
    """MiniMax-M3-VL's vision attention: only the first R = cos.shape[-1] channels of [T, H, D] rotate."""
    q, k, _ = qkv.reshape(T, 3, HQ, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = cos[:, None, : D // 2], sin[:, None, : D // 2]
    r = cos.shape[-1]
    q_rot = torch.cat([q[..., :r] * cos + rotate_half(q[..., :r]) * sin, q[..., r:]], dim=-1)
    k_rot = torch.cat([k[..., :r] * cos + rotate_half(k[..., :r]) * sin, k[..., r:]], dim=-1)
    return q_rot, k_rot


def rotate_pairwise(x):  # Inkling-2, SAM-3: the interleaved rotation through the pairs' own dim
    x1, x2 = x.view(*x.shape[:-1], -1, 2).unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(start_dim=-2)


def inkling2_vision(qkv, cos, sin):
    """Inkling-2's vision attention: Qwen2-VL's form with interleaved pairs, cos/sin repeat-interleaved."""
    q, k, _ = qkv.reshape(T, 3, HQ, -1).permute(1, 0, 2, 3).unbind(0)
    orig_q_dtype, orig_k_dtype = q.dtype, k.dtype
    q, k = q.float(), k.float()
    cos = cos[:, : D // 2].repeat_interleave(2, dim=-1).unsqueeze(-2).float()
    sin = sin[:, : D // 2].repeat_interleave(2, dim=-1).unsqueeze(-2).float()
    q_embed = (q * cos) + (rotate_pairwise(q) * sin)
    k_embed = (k * cos) + (rotate_pairwise(k) * sin)
    return q_embed.to(orig_q_dtype), k_embed.to(orig_k_dtype)


def pixtral_vision(q, k, cos, sin):
    """Pixtral's vision attention: cos/sin [T, D] of the (h, w) positions unsqueezed at dim 0, [1, T, D] against
    q/k [B, H, T, D]."""
    return llama(q, k, cos.unsqueeze(0).squeeze(1), sin.unsqueeze(0).squeeze(1))


def _vision_inputs(dtype=torch.float32):
    """A packed qkv projection [T, 3·H·D] in ``dtype``; cos/sin [T, D] in fp32 of 2-D (h, w) angles, each axis on
    a quarter of the channels, both halves alike (Qwen2-VL's vision rotary embedding)."""
    qkv = torch.randn(T, 3 * HQ * D, dtype=dtype)
    h_pos, w_pos = torch.arange(T) // 2, torch.arange(T) % 2
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D // 2, 2, dtype=torch.float32) / (D // 2)))
    freqs = torch.cat((h_pos[:, None] * inv_freq, w_pos[:, None] * inv_freq), dim=-1)
    emb = torch.cat((freqs, freqs), dim=-1)
    return qkv, emb.cos(), emb.sin()


@pytest.mark.parametrize("fn", [qwen2_vl_vision, vision_partial, inkling2_vision], ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_vision_rotation_matches_as_one_op_and_is_as_close_to_fp64_as_eager(fn, dtype):
    """One op for q and k on their [1, H, T, D] views. Qwen2-VL's form: the op reads q/k in their own dtype (the
    upcast is exact), computes in fp32 as eager does and rounds once to the dtype cast back to, so its results and
    q/k's gradient equal eager's, in eager's dtypes."""
    inputs = _vision_inputs(dtype)
    report = fuser.explain(fn, *inputs)
    assert report.counts == {"rope": 1} and not report.near_misses, str(report)
    _assert_fused_as_close_to_fp64_as_eager(fn, inputs, n_grad=1)


def test_vision_rotation_reads_q_without_its_upcast_and_writes_the_cast_back_dtype():
    """The op takes bf16 q and k (not their fp32 copies) and writes bf16 (no cast after it): the one match covers
    the casts back."""
    report = fuser.explain(qwen2_vl_vision, *_vision_inputs(torch.bfloat16))
    (match,) = report.matches
    q, k = (_graph_node(a) for a in match.replacement.args[:2])
    assert q.meta["example_value"].dtype == k.meta["example_value"].dtype == torch.bfloat16
    assert match.replacement.args[6] is torch.bfloat16
    assert {canonical(n).op for n in match.found.nodes if canonical(n) is not None} >= {"to"}


def _graph_node(arg):
    """The graph node a replacement argument is built from (through views the rewrite builds, and the upcasts it
    looks through when it builds the op)."""
    from fuser.patterns.rope import UpcastStripped

    while not isinstance(arg, torch.fx.Node):
        arg = arg.build(arg.source.graph) if isinstance(arg, UpcastStripped) else arg.source
    return arg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pixtral_cos_of_three_dims_matches_as_one_op_and_is_as_close_to_fp64_as_eager(dtype):
    q, k, _, _ = _inputs(dtype)
    _, cos, sin = _vision_inputs()
    inputs = (q, k, cos.to(dtype), sin.to(dtype))
    report = fuser.explain(pixtral_vision, *inputs)
    assert report.counts == {"rope": 1} and not report.near_misses, str(report)
    _assert_fused_as_close_to_fp64_as_eager(pixtral_vision, inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_vision_rotation_through_the_kernel_on_the_interpreter(dtype, monkeypatch, triton_on_cpu):
    """The Triton kernel on the views the vision form hands it: q/k [T, H, D] slices of a packed projection (token
    stride 3·H·D), viewed [1, H, T, D], cos/sin [T, 1, D] viewed [1, 1, T, D] (the interpreter's bf16 arithmetic
    is not trusted: fp32 and fp16)."""
    import fuser.kernels.rope as rope_module

    triton_on_cpu()
    launched = []
    real_launch = rope_module._launch
    monkeypatch.setattr(rope_module, "_launch", lambda *a: launched.append(a[3]) or real_launch(*a))
    _assert_fused_as_close_to_fp64_as_eager(qwen2_vl_vision, _vision_inputs(dtype), n_grad=1)
    assert launched == [False, True]  # forward, then backward: no silent fall-back to the reference path


# near-misses: forms the fused op does not compute, and must not take


def mrope_sections_not_selected(q, k, positions, inv_freq):
    """The three axes' cos/sin [3, B, T, D] used without picking one axis per section: eager broadcasts q/k to
    [3, B, H, T, D], three rotations, not one."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().unsqueeze(2), emb.sin().unsqueeze(2)
    return (q * cos) + (rotate_half(q) * sin), k


def vision_cos_per_head(qkv, cos, sin):
    """cos/sin [T, H, D] that differ per head."""
    q, k, _ = qkv.reshape(T, 3, HQ, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = cos[:, None, :] * torch.arange(1, HQ + 1)[:, None], sin[:, None, :].expand(T, HQ, D)
    return (q * cos) + (rotate_half(q) * sin), k


def vision_uneven_split(qkv, cos, sin):
    """A 2-D rotation that pairs channel i with i + D/4 in each half: not rotate_half's pairing."""
    q, k, _ = qkv.reshape(T, 3, HQ, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rot = torch.cat((-q[..., D // 4 :], q[..., : D // 4]), dim=-1)
    return (q * cos) + (rot * sin), k


def vision_pairwise_unrotated(qkv, cos, sin):
    """``stack((x2, x1))``: the pairs swapped without the sign, a reflection rather than a rotation."""
    q, k, _ = qkv.reshape(T, 3, HQ, -1).permute(1, 0, 2, 3).unbind(0)
    x1, x2 = q.view(*q.shape[:-1], -1, 2).unbind(dim=-1)
    return (q * cos.unsqueeze(-2)) + (torch.stack((x2, x1), dim=-1).flatten(start_dim=-2) * sin.unsqueeze(-2)), k


def vision_rounded_inside(qkv, cos, sin):
    """One product rounded to bf16 before the sum: a rounding inside the rotation that the op does not make."""
    q, k, _ = qkv.reshape(T, 3, HQ, -1).permute(1, 0, 2, 3).unbind(0)
    q, cos, sin = q.float(), cos.unsqueeze(-2), sin.unsqueeze(-2)
    return ((q * cos).bfloat16() + rotate_half(q) * sin).bfloat16(), k


@pytest.mark.parametrize(
    "fn, inputs, reason",
    [
        (mrope_sections_not_selected, _mrope_inputs, "has more dims than q/k's (2, 4, 5, 16): eager broadcasts q/k"),
        (vision_cos_per_head, _vision_inputs, "cos/sin vary over heads"),
        (vision_uneven_split, _vision_inputs, "rotate_half splits at 4:16, not at the halves of 16"),
        (vision_pairwise_unrotated, _vision_inputs, None),
        (vision_rounded_inside, _vision_inputs, None),
    ],
    ids=lambda v: v.__name__ if callable(v) else "",
)
def test_multimodal_and_vision_near_misses_decline(fn, inputs, reason):
    args = inputs()
    report = fuser.explain(fn, *args)
    assert report.counts == {}, str(report)
    if reason is not None:
        assert any(reason in nm.reason for nm in report.near_misses), str(report)
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
    out = torch.compile(fn, backend=fuser.backend(config))(*args)
    for o, r in zip(out, fn(*args), strict=True):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
