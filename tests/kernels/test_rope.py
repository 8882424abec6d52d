"""Kernel tests for the fused rotary embedding (``src/fuser/kernels/rope.py``): launchers, reference, custom ops.

Oracle: the reference formulas (``rope_rotate(..., impl="reference")``) evaluated on fp64 copies of the inputs; the
hand-written reference backward is itself checked against fp64 autograd of the rotation written the way models
write it (Hugging Face's ``q * cos + rotate_half(q) * sin``, GLM's interleaved ``rotate_half`` with
``repeat_interleave``d cos/sin, DeepSeek-V3's pairs-to-halves permutation, Phi / GPT-NeoX partial rotary).

cos and sin are random normal values in the tests, not points of the unit circle, and differ between the two
channels of a pair: a kernel that reads cos at the wrong channel, or assumes cos[i] == cos[i + h], fails.

Error measure: ``rel_err(a, b) = ‖a − b‖ / ‖b‖`` over the whole tensor, computed in fp64. Each output element is
two fp32 products and a sum (a few fp32 roundings), then one rounding to the output dtype; the inputs and cos/sin
in fp16/bf16 are exact in the fp64 oracle, which reads the same rounded values. Tolerances:

- fp32 ≤ 1e-5: measured ~4e-8; two decades of slack, yet any formula or channel slip is O(1).
- fp16 ≤ 2e-3: the store rounds by ≤ half an fp16 ulp (fp16 eps 9.8e-4), measured ~2e-4.
- bf16 ≤ 1e-2 (bf16 eps 7.8e-3): one bf16 ulp. On the interpreter fp32→bf16 stores truncate rather than round
  (DESIGN.md, "Testing tiers"), so there a full ulp per element is expected.

Every output is poisoned with NaN before the kernel runs (``q_out=`` / ``k_out=`` / ``dq=`` / ``dk=``), and every
check first asserts there is no NaN (nor inf), so an element the kernel never writes fails.

CPU launcher tests run through Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` when there is
no GPU), at small B·T (the interpreter runs ~10 ms per program); bf16 is only loaded/stored there and proven on
the GPU tests (``@pytest.mark.gpu``), which use real shapes.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import fuser.kernels.rope as rope_module
from fuser.kernels._triton import HAS_TRITON, interpreting
from fuser.kernels.rope import LAYOUTS, Rotation, rope, rope_rotate


# The op's single entry (``rope_rotate``) per direction and path, called as the tests below call it.
def rope_reference_forward(q, k, cos, sin, rotary_dim, layout):
    return rope_rotate(q, k, Rotation(cos, sin, rotary_dim, layout), impl="reference")


def rope_reference_backward(dq_out, dk_out, cos, sin, rotary_dim, layout):
    return rope_rotate(dq_out, dk_out, Rotation(cos, sin, rotary_dim, layout), backward=True, impl="reference")


def rope_forward_triton(q, k, cos, sin, rotary_dim, layout, out_dtype=None, *, q_out=None, k_out=None):
    rotation = Rotation(cos, sin, rotary_dim, layout)
    return rope_rotate(q, k, rotation, (out_dtype, out_dtype), impl="triton", out=(q_out, k_out))


def rope_backward_triton(
    dq_out, dk_out, cos, sin, rotary_dim, layout, dq_dtype=None, dk_dtype=None, *, dq=None, dk=None
):
    rotation = Rotation(cos, sin, rotary_dim, layout)
    return rope_rotate(dq_out, dk_out, rotation, (dq_dtype, dk_dtype), backward=True, impl="triton", out=(dq, dk))


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# CPU launches of the Triton kernels need the interpreter; on a GPU machine the gpu tests cover the kernels.
interpreter = pytest.mark.skipif(
    not (HAS_TRITON and interpreting()), reason="needs Triton with TRITON_INTERPRET=1 (set by conftest without a GPU)"
)


# ---------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test id: fresh inputs per test and per parametrization, reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def randn(shape, gen, dtype=torch.float32, device="cpu") -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)


def make_heads(batch, heads, seq_len, head_dim, gen, dtype=torch.float32, storage="hf", device="cpu"):
    """A ``[batch, heads, seq, head_dim]`` tensor stored as models produce it:

    - ``"hf"``: ``x.view(B, T, H, D).transpose(1, 2)`` of a projection's output (Hugging Face attention);
    - ``"contiguous"``: ``[B, H, T, D]`` storage;
    - ``"channels_strided"``: ``[B, T, D, H]`` storage, so the channel stride is H, not 1 (all four strides used).
    """
    if storage == "hf":
        return randn((batch, seq_len, heads, head_dim), gen, dtype, device).transpose(1, 2)
    if storage == "contiguous":
        return randn((batch, heads, seq_len, head_dim), gen, dtype, device)
    assert storage == "channels_strided"
    return randn((batch, seq_len, head_dim, heads), gen, dtype, device).permute(0, 3, 1, 2)


def make_cos_sin(cos_batch, seq_len, rotary_dim, gen, dtype=torch.float32, device="cpu"):
    """4-D ``[cos_batch, 1, T, R]`` cos and sin: random values, different at every channel (see module docstring)."""
    shape = (cos_batch, 1, seq_len, rotary_dim)
    return randn(shape, gen, dtype, device), randn(shape, gen, dtype, device)


def fp64(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to(torch.float64)


def poisoned(like: torch.Tensor | None) -> torch.Tensor | None:
    return None if like is None else torch.full(like.shape, float("nan"), dtype=like.dtype, device=like.device)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in fp64."""
    diff = (actual.detach().double() - expected.detach().double()).norm()
    denom = expected.detach().double().norm()
    return (diff / denom).item() if denom > 0 else diff.item()


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    bad = ~torch.isfinite(actual)
    assert not bad.any(), f"{name}: {int(bad.sum())} of {actual.numel()} elements are NaN/inf (never written?)"
    err = rel_err(actual, expected)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"


def poisoned_as(like: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """A NaN-filled buffer of ``like``'s shape in ``dtype`` (None: like's dtype)."""
    return None if like is None else poisoned(like.to(dtype or like.dtype))


def run_triton(q, k, cos, sin, dq_out, dk_out, rotary_dim, layout, out_dtype=None):
    """Forward and backward launchers with NaN-poisoned outputs: (q_out, k_out, dq, dk); the forward writes
    ``out_dtype`` (None: q's / k's), the backward q's and k's dtypes."""
    q_out, k_out = rope_forward_triton(
        q, k, cos, sin, rotary_dim, layout, out_dtype, q_out=poisoned_as(q, out_dtype), k_out=poisoned_as(k, out_dtype)
    )
    dq_dtype, dk_dtype = q.dtype, None if k is None else k.dtype
    dq, dk = rope_backward_triton(
        dq_out, dk_out, cos, sin, rotary_dim, layout, dq_dtype, dk_dtype, dq=poisoned(q), dk=poisoned(k)
    )
    return q_out, k_out, dq, dk


def check_against_fp64_reference(q, k, cos, sin, dq_out, dk_out, rotary_dim, layout, tol=None, out_dtype=None):
    """The launchers vs the fp64 reference. ``dq_out``/``dk_out`` are the gradients of the outputs (of
    ``out_dtype``); the forward is judged at ``out_dtype``'s tolerance, each gradient at its input's."""
    inputs = [t.clone() if t is not None else None for t in (q, k, cos, sin, dq_out, dk_out)]
    q_out, k_out, dq, dk = run_triton(q, k, cos, sin, dq_out, dk_out, rotary_dim, layout, out_dtype)
    cos64, sin64 = fp64(cos), fp64(sin)
    q_ref, k_ref = rope_reference_forward(fp64(q), fp64(k), cos64, sin64, rotary_dim, layout)
    dq_ref, dk_ref = rope_reference_backward(fp64(dq_out), fp64(dk_out), cos64, sin64, rotary_dim, layout)
    assert q_out.dtype == (out_dtype or q.dtype) and dq.dtype == q.dtype
    assert_close("q_out", q_out, q_ref, tol or TOLERANCE[q_out.dtype])
    assert_close("dq", dq, dq_ref, tol or TOLERANCE[q.dtype])
    if k is None:
        assert k_out is None and dk is None
    else:
        assert k_out.dtype == (out_dtype or k.dtype) and dk.dtype == k.dtype
        assert_close("k_out", k_out, k_ref, tol or TOLERANCE[k_out.dtype])
        assert_close("dk", dk, dk_ref, tol or TOLERANCE[k.dtype])
    # the launchers read their inputs in place and never write them
    for before, after in zip(inputs, (q, k, cos, sin, dq_out, dk_out), strict=True):
        assert before is None or torch.equal(before, after)


# ---------------------------------------------------------------------------------------------------------
# How models write the rotation (fp64 autograd of these is the oracle for the reference backward)
# ---------------------------------------------------------------------------------------------------------


def rotate_half(x):
    """Hugging Face's rotate_half (Llama, Mistral, Qwen, GPT-NeoX, Phi, DeepSeek-V3)."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_interleaved(x):
    """GLM's rotate_half: pairs (x[2i], x[2i+1])."""
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def llama_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    # Llama / Mistral / Qwen
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def glm_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    # GLM: cos/sin of width R arrive as cat(freqs, freqs); their first half is repeat-interleaved, partial rotary
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate_half_interleaved(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half_interleaved(k_rot) * sin)
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed


def interleaved_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    # original Meta / Helium-style interleaved pairs with cos/sin given already at full width, every channel its own
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half_interleaved(q) * sin)
    k_embed = (k * cos) + (rotate_half_interleaved(k) * sin)
    return q_embed, k_embed


def deepseek_apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=1):
    # DeepSeek-V2/V3 (transformers 4.5x–5.1x): interleaved pairs permuted to halves, then rotate_half
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    b, h, s, d = q.shape
    q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    b, h, s, d = k.shape
    k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def deepseek_cat_apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=1):
    # DeepSeek-V3 as transformers 5.2x writes it: the first half of cat(freqs, freqs) serves both output halves
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    q_embed = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
    k_embed = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    return q_embed, k_embed


def partial_rotary(apply_rotary_pos_emb, rotary_dim):
    """Phi / GPT-NeoX: rotate the first ``rotary_dim`` channels, pass the rest through."""

    def apply(q, k, cos, sin):
        q_rot, k_rot = apply_rotary_pos_emb(q[..., :rotary_dim], k[..., :rotary_dim], cos, sin)
        return torch.cat((q_rot, q[..., rotary_dim:]), dim=-1), torch.cat((k_rot, k[..., rotary_dim:]), dim=-1)

    return apply


def _same(cos):
    return cos


def _glm_interleave(cos):
    return cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)


# name: (model function on HF's 3-D [B | 1, T, R] cos/sin, fuser layout, the cos/sin fuser is given, whether the
# model wants cat(freqs, freqs) cos/sin, whether the model does partial rotary itself)
MODELS = {
    "llama": (llama_apply_rotary_pos_emb, "half", _same, False, False),
    "glm": (glm_apply_rotary_pos_emb, "interleaved", _glm_interleave, False, True),
    "interleaved": (interleaved_apply_rotary_pos_emb, "interleaved", _same, False, False),
    "deepseek": (deepseek_apply_rotary_pos_emb_interleave, "pairs_to_halves", _same, False, False),
    "deepseek_cat": (deepseek_cat_apply_rotary_pos_emb_interleave, "pairs_to_halves", _same, True, False),
}


def model_cos_sin(model, cos_batch, seq_len, rotary_dim, gen, dtype=torch.float32, device="cpu"):
    """HF-style 3-D cos/sin for ``model``: random, or cat(c, c) where the model reads only the first half."""
    duplicated = MODELS[model][3]
    width = rotary_dim // 2 if duplicated else rotary_dim
    cos, sin = (randn((cos_batch, seq_len, width), gen, dtype, device) for _ in range(2))
    if duplicated:
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    return cos, sin


def model_forward(model, q, k, cos, sin, rotary_dim):
    apply, _, _, _, does_partial = MODELS[model]
    if rotary_dim < q.shape[-1] and not does_partial:
        apply = partial_rotary(apply, rotary_dim)
    return apply(q, k, cos, sin)


def fuser_cos_sin(model, cos, sin):
    """The 4-D cos/sin fuser's op is given for the model's 3-D ones."""
    convert = MODELS[model][2]
    return convert(cos).unsqueeze(1), convert(sin).unsqueeze(1)


# ---------------------------------------------------------------------------------------------------------
# The oracle itself: the reference is the models' rotation, and its backward is their autograd (fp64)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rotary_fraction", [1, 2, 4], ids=["full", "half_rotary", "quarter_rotary"])
@pytest.mark.parametrize("model", list(MODELS))
def test_reference_is_autograd_of_model(model, rotary_fraction, gen):
    batch, n_q_heads, n_k_heads, seq_len, head_dim = 2, 4, 2, 5, 16
    rotary_dim = head_dim // rotary_fraction
    q = make_heads(batch, n_q_heads, seq_len, head_dim, gen, torch.float64, "contiguous").requires_grad_()
    k = make_heads(batch, n_k_heads, seq_len, head_dim, gen, torch.float64, "contiguous").requires_grad_()
    cos, sin = model_cos_sin(model, batch, seq_len, rotary_dim, gen, torch.float64)
    dq_out, dk_out = randn(q.shape, gen, torch.float64), randn(k.shape, gen, torch.float64)
    q_embed, k_embed = model_forward(model, q, k, cos, sin, rotary_dim)
    torch.autograd.backward((q_embed, k_embed), (dq_out, dk_out))

    layout = MODELS[model][1]
    cos4, sin4 = fuser_cos_sin(model, cos, sin)
    q_ref, k_ref = rope_reference_forward(q.detach(), k.detach(), cos4, sin4, rotary_dim, layout)
    dq_ref, dk_ref = rope_reference_backward(dq_out, dk_out, cos4, sin4, rotary_dim, layout)
    # fp64 throughout: a few roundings of fp64 (eps 2.2e-16) per element
    for name, actual, expected in (
        ("q_out", q_ref, q_embed),
        ("k_out", k_ref, k_embed),
        ("dq", dq_ref, q.grad),
        ("dk", dk_ref, k.grad),
    ):
        assert actual.dtype == torch.float64 and actual.is_contiguous()
        assert_close(name, actual, expected, 1e-14)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_pass_through_is_exact(layout, gen):
    """Channels from rotary_dim on are copied bit for bit, forward and backward, whatever the dtype."""
    q = make_heads(1, 2, 3, 64, gen, torch.float16)
    cos, sin = make_cos_sin(1, 3, 16, gen)
    q_out, _ = rope_reference_forward(q, None, cos, sin, 16, layout)
    dq, _ = rope_reference_backward(q, None, cos, sin, 16, layout)
    assert torch.equal(q_out[..., 16:], q[..., 16:]) and torch.equal(dq[..., 16:], q[..., 16:])


# ---------------------------------------------------------------------------------------------------------
# Triton launchers on the interpreter
# ---------------------------------------------------------------------------------------------------------

# (batch, q heads, k heads (None: k absent), seq, head_dim, rotary_dim, cos batch, q/k storage, cos/sin dtype)
CASES = {
    "d64_mqa_hf": (2, 4, 1, 3, 64, 64, 1, "hf", "input"),
    "d80_gqa_cos_per_batch": (2, 4, 2, 3, 80, 80, 2, "contiguous", "fp32"),
    "d128_gqa_hf": (1, 4, 2, 4, 128, 128, 1, "hf", "fp32"),
    "d128_half_rotary": (2, 4, 2, 2, 128, 64, 2, "hf", "input"),
    "d64_quarter_rotary": (1, 4, 1, 5, 64, 16, 1, "contiguous", "fp32"),
    "d80_half_rotary_channels_strided": (1, 4, 2, 3, 80, 40, 1, "channels_strided", "input"),
    "k_absent": (2, 4, None, 3, 64, 32, 2, "hf", "fp32"),
}


def make_case(case, dtype, gen, device="cpu"):
    batch, n_q_heads, n_k_heads, seq_len, head_dim, rotary_dim, cos_batch, storage, cos_dtype = CASES[case]
    q = make_heads(batch, n_q_heads, seq_len, head_dim, gen, dtype, storage, device)
    dq_out = make_heads(batch, n_q_heads, seq_len, head_dim, gen, dtype, storage, device)
    k = dk_out = None
    if n_k_heads is not None:
        k = make_heads(batch, n_k_heads, seq_len, head_dim, gen, dtype, storage, device)
        dk_out = make_heads(batch, n_k_heads, seq_len, head_dim, gen, dtype, storage, device)
    cos_dtype = torch.float32 if cos_dtype == "fp32" else dtype
    cos, sin = make_cos_sin(cos_batch, seq_len, rotary_dim, gen, cos_dtype, device)
    return q, k, cos, sin, dq_out, dk_out, rotary_dim


@interpreter
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_fp64_reference(case, dtype, layout, gen):
    q, k, cos, sin, dq_out, dk_out, rotary_dim = make_case(case, dtype, gen)
    check_against_fp64_reference(q, k, cos, sin, dq_out, dk_out, rotary_dim, layout)


@interpreter
@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_bf16_load_store(layout, gen):
    """bf16 as the interpreter can be trusted with it: load → fp32 math → store (1 ulp, stores truncate)."""
    check_against_fp64_reference(*make_case("d128_half_rotary", torch.bfloat16, gen), layout)


# Mixed dtypes: (q, k, cos, sin, out). Each tensor is loaded in its own dtype, the maths runs in fp32, the forward
# stores out_dtype and the backward q's / k's dtypes (from gradients of out_dtype).
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
MIXED_DTYPES = {
    # autocast with fp32 master weights: half q/k from a linear, fp32 cos/sin, eager promotes to fp32
    "fp16_qk_fp32_cos_to_fp32": (F16, F16, F32, F32, F32),
    # a wider input rounded once at the output (a later pattern absorbing a trailing cast)
    "fp32_qk_fp16_cos_to_fp16": (F32, F32, F16, F16, F16),
    "fp16_everything_to_fp32": (F16, F16, F16, F16, F32),
    "fp32_everything_to_fp16": (F32, F32, F32, F32, F16),
    # q and k of different dtypes in one launch, cos and sin of different dtypes
    "fp16_q_fp32_k_fp32_cos_fp16_sin_to_fp32": (F16, F32, F32, F16, F32),
}
MIXED_CASES = ["d128_half_rotary", "d80_half_rotary_channels_strided", "k_absent"]


def make_mixed_case(case, dtypes, gen):
    """``CASES[case]``'s shapes and storage with q, k, cos, sin in their own dtypes; the output gradients (the
    backward's inputs) in the out dtype."""
    batch, n_q_heads, n_k_heads, seq_len, head_dim, rotary_dim, cos_batch, storage, _ = CASES[case]
    q_dtype, k_dtype, cos_dtype, sin_dtype, out_dtype = dtypes
    q = make_heads(batch, n_q_heads, seq_len, head_dim, gen, q_dtype, storage)
    dq_out = make_heads(batch, n_q_heads, seq_len, head_dim, gen, out_dtype, storage)
    k = dk_out = None
    if n_k_heads is not None:
        k = make_heads(batch, n_k_heads, seq_len, head_dim, gen, k_dtype, storage)
        dk_out = make_heads(batch, n_k_heads, seq_len, head_dim, gen, out_dtype, storage)
    cos, _ = make_cos_sin(cos_batch, seq_len, rotary_dim, gen, cos_dtype)
    _, sin = make_cos_sin(cos_batch, seq_len, rotary_dim, gen, sin_dtype)
    return q, k, cos, sin, dq_out, dk_out, rotary_dim


@interpreter
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", MIXED_CASES)
@pytest.mark.parametrize("dtypes", list(MIXED_DTYPES.values()), ids=list(MIXED_DTYPES))
def test_triton_mixed_dtypes_match_fp64_reference(dtypes, case, layout, gen):
    q, k, cos, sin, dq_out, dk_out, rotary_dim = make_mixed_case(case, dtypes, gen)
    check_against_fp64_reference(q, k, cos, sin, dq_out, dk_out, rotary_dim, layout, out_dtype=dtypes[-1])


@interpreter
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "dtypes",
    [pytest.param((BF16, BF16, F32, F32, F32), id="bf16_qk_fp32_cos_to_fp32"),  # HF Trainer bf16=True
     pytest.param((F32, F32, BF16, BF16, BF16), id="fp32_qk_bf16_cos_to_bf16")],
)  # fmt: skip
def test_triton_mixed_dtypes_bf16_load_store(dtypes, layout, gen):
    """bf16 only loaded and stored (the interpreter's bf16 arithmetic is wrong; its bf16 stores truncate)."""
    q, k, cos, sin, dq_out, dk_out, rotary_dim = make_mixed_case("d128_half_rotary", dtypes, gen)
    check_against_fp64_reference(q, k, cos, sin, dq_out, dk_out, rotary_dim, layout, out_dtype=dtypes[-1])


@interpreter
@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_many_heads_ragged_head_blocks(layout, gen):
    """40 q heads of D 64 take two head blocks of 32 (the second ragged), k's 8 heads a block of their own."""
    q = make_heads(1, 40, 2, 64, gen)
    k = make_heads(1, 8, 2, 64, gen)
    cos, sin = make_cos_sin(1, 2, 64, gen)
    check_against_fp64_reference(
        q, k, cos, sin, make_heads(1, 40, 2, 64, gen), make_heads(1, 8, 2, 64, gen), 64, layout
    )


def _expanded_cos(gen, batch, seq_len, rotary_dim):  # stride 0 over a batch of size > 1 (``cos.expand``)
    return randn((1, 1, seq_len, rotary_dim), gen).expand(batch, 1, seq_len, rotary_dim)


def _sliced_cos(gen, batch, seq_len, rotary_dim):  # token stride 2R: a slice of a wider table
    return randn((batch, 1, seq_len, 2 * rotary_dim), gen)[..., rotary_dim:]


def _transposed_cos(gen, batch, seq_len, rotary_dim):  # channel stride T: stored [R, T]
    return randn((batch, 1, rotary_dim, seq_len), gen).transpose(-1, -2)


def _one_token_cos(gen, batch, seq_len, rotary_dim):  # [1, 1, 1, R]: the same angles for every token
    return randn((1, 1, 1, rotary_dim), gen)


@interpreter
@pytest.mark.parametrize(
    "make_cos, make_sin",
    [
        pytest.param(_expanded_cos, _sliced_cos, id="expanded_and_sliced"),
        pytest.param(_transposed_cos, _one_token_cos, id="transposed_and_one_token"),
    ],
)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_cos_sin_strides(layout, make_cos, make_sin, gen):
    batch, seq_len, head_dim, rotary_dim = 2, 3, 32, 32
    q, k = make_heads(batch, 2, seq_len, head_dim, gen), make_heads(batch, 1, seq_len, head_dim, gen)
    cos, sin = make_cos(gen, batch, seq_len, rotary_dim), make_sin(gen, batch, seq_len, rotary_dim)
    dq_out, dk_out = randn(q.shape, gen), randn(k.shape, gen)
    check_against_fp64_reference(q, k, cos, sin, dq_out, dk_out, rotary_dim, layout)


@interpreter
def test_triton_backward_expanded_and_transposed_grads(gen):
    """Autograd hands out stride-0 gradients (``q_out.sum()``) and transposed ones."""
    q, k = make_heads(2, 4, 3, 64, gen), make_heads(2, 2, 3, 64, gen)
    cos, sin = make_cos_sin(2, 3, 64, gen)
    dq_out = randn((1, 1, 1, 64), gen).expand(q.shape)
    dk_out = randn((2, 3, 2, 64), gen).transpose(1, 2)
    check_against_fp64_reference(q, k, cos, sin, dq_out, dk_out, 64, "half")


@interpreter
@pytest.mark.parametrize(
    "shape_q, shape_k",
    [
        ((2, 4, 0, 64), (2, 2, 0, 64)),  # no tokens
        ((0, 4, 3, 64), (0, 2, 3, 64)),  # no batch
        ((1, 4, 2, 64), (1, 0, 2, 64)),  # k without heads: q alone
        ((1, 0, 2, 64), (1, 2, 2, 64)),  # q without heads: k alone
    ],
    ids=str,
)
def test_triton_zero_size(shape_q, shape_k, gen):
    q, k = randn(shape_q, gen), randn(shape_k, gen)
    cos, sin = make_cos_sin(1, shape_q[2], 64, gen)
    q_out, k_out, dq, dk = run_triton(q, k, cos, sin, randn(shape_q, gen), randn(shape_k, gen), 64, "half")
    assert q_out.shape == dq.shape == q.shape and k_out.shape == dk.shape == k.shape
    if q.numel() and k.numel() == 0:
        check_against_fp64_reference(q, k, cos, sin, randn(shape_q, gen), randn(shape_k, gen), 64, "half")
    if k.numel() and q.numel() == 0:  # k's head blocks follow q's, of which there are none: all must still run
        k_out_ref, _ = rope_reference_forward(fp64(k), None, fp64(cos), fp64(sin), 64, "half")
        assert_close("k_out", k_out, k_out_ref, TOLERANCE[torch.float32])


@interpreter
def test_triton_inf_and_nan_in_grads_pass_through(gen):
    """The backward multiplies the gradient through: an inf (fp16 GradScaler overflow) stays non-finite."""
    q = make_heads(1, 2, 1, 16, gen)
    cos, sin = make_cos_sin(1, 1, 16, gen)
    dq_out = randn(q.shape, gen)
    dq_out[0, 0, 0, 3] = float("inf")
    dq_out[0, 1, 0, 12] = float("nan")
    dq, _ = rope_backward_triton(dq_out, None, cos, sin, 16, "half", dq=poisoned(q))
    assert not torch.isfinite(dq[0, 0, 0, [3, 11]]).any() and not torch.isfinite(dq[0, 1, 0, 12]).any()
    assert torch.isfinite(dq[0, 0, 0, 4:11]).all() and torch.isfinite(dq[0, 1, 0, :4]).all()


# ---------------------------------------------------------------------------------------------------------
# The custom ops and their autograd (CPU: the reference path)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def reference_path(triton_on_cpu):
    """CPU tensors take the plain-torch reference outside ``triton_on_cpu()``; make sure of it."""
    triton_on_cpu(False)


# (model, rotary_dim as a fraction of head_dim): each layout, full and partial
OP_CASES = [
    pytest.param("llama", 1, id="llama"),
    pytest.param("llama", 2, id="phi_partial"),
    pytest.param("glm", 2, id="glm_partial"),
    pytest.param("deepseek", 1, id="deepseek"),
    pytest.param("deepseek_cat", 1, id="deepseek_cat"),
    pytest.param("interleaved", 4, id="interleaved_quarter"),
]


def check_op_autograd(model, rotary_fraction, gen, requires_grad=(True, True), with_k=True, shape=(2, 4, 2, 3, 32)):
    """fp32 ``rope`` on HF's transposed views, then backward, vs fp64 autograd of the model's rotation."""
    batch, n_q_heads, n_k_heads, seq_len, head_dim = shape
    rotary_dim = head_dim // rotary_fraction
    layout = MODELS[model][1]
    # the projections' outputs are the leaves; q and k are HF's [B, T, H, D] → [B, H, T, D] views of them
    q_proj = randn((batch, seq_len, n_q_heads * head_dim), gen).requires_grad_(requires_grad[0])
    k_proj = randn((batch, seq_len, n_k_heads * head_dim), gen).requires_grad_(requires_grad[1])
    cos, sin = model_cos_sin(model, 1, seq_len, rotary_dim, gen)
    probe_q, probe_k = (
        randn((batch, n_q_heads, seq_len, head_dim), gen),
        randn((batch, n_k_heads, seq_len, head_dim), gen),
    )

    def heads(proj, n_heads):
        return proj.view(batch, seq_len, n_heads, head_dim).transpose(1, 2)

    convert = MODELS[model][2]
    q_out, k_out = rope(
        heads(q_proj, n_q_heads),
        heads(k_proj, n_k_heads) if with_k else None,
        convert(cos),
        convert(sin),
        rotary_dim=rotary_dim,
        layout=layout,
    )
    # laid out as HF's input, [B, T, H, D] storage: the attention's output can be too (o_proj's input a view)
    assert q_out.transpose(1, 2).is_contiguous() and q_out.dtype == torch.float32
    loss = (q_out * probe_q).sum()
    if with_k:
        assert k_out.transpose(1, 2).is_contiguous() and k_out.dtype == torch.float32
        loss = loss + (k_out * probe_k).sum()
    else:
        assert k_out is None
    if loss.requires_grad:
        loss.backward()

    q64, k64 = fp64(q_proj).requires_grad_(requires_grad[0]), fp64(k_proj).requires_grad_(requires_grad[1])
    q_ref, k_ref = model_forward(model, heads(q64, n_q_heads), heads(k64, n_k_heads), fp64(cos), fp64(sin), rotary_dim)
    loss64 = (q_ref * fp64(probe_q)).sum() + ((k_ref * fp64(probe_k)).sum() if with_k else 0)
    if loss64.requires_grad:
        loss64.backward()

    tol = TOLERANCE[torch.float32]
    assert_close("q_out", q_out, q_ref, tol)
    if with_k:
        assert_close("k_out", k_out, k_ref, tol)
    for name, leaf, leaf64, wanted in (
        ("q", q_proj, q64, requires_grad[0]),
        ("k", k_proj, k64, requires_grad[1] and with_k),
    ):
        if wanted:
            assert_close(f"{name}.grad", leaf.grad, leaf64.grad, tol)
        else:
            assert leaf.grad is None


@pytest.mark.parametrize("model, rotary_fraction", OP_CASES)
def test_op_autograd_matches_fp64_model(model, rotary_fraction, gen, reference_path):
    check_op_autograd(model, rotary_fraction, gen)


@pytest.mark.parametrize(
    "requires_grad, with_k",
    [
        pytest.param((True, False), True, id="q_grad_only"),
        pytest.param((False, True), True, id="k_grad_only"),
        pytest.param((True, False), False, id="k_absent"),
        pytest.param((False, False), True, id="no_grad"),
    ],
)
def test_op_computes_only_needed_grads(requires_grad, with_k, gen, reference_path, monkeypatch):
    calls = []

    def spy(dq_out, dk_out, *args, **kwargs):
        if kwargs.get("backward"):
            calls.append((dq_out.numel() > 0, dk_out.numel() > 0))
        return rope_rotate(dq_out, dk_out, *args, **kwargs)

    monkeypatch.setattr(rope_module, "rope_rotate", spy)
    check_op_autograd("llama", 2, gen, requires_grad=requires_grad, with_k=with_k)
    # one backward, rotating only the gradients asked for (k's alone goes through q's slot)
    expected = {(True, False): [(True, False)], (False, True): [(True, False)], (False, False): []}
    assert calls == expected[(requires_grad[0], requires_grad[1] and with_k)]


def test_op_unused_k_out_gets_no_gradient(gen, reference_path):
    q = make_heads(1, 2, 3, 16, gen).requires_grad_()
    k = make_heads(1, 1, 3, 16, gen).requires_grad_()
    cos, sin = make_cos_sin(1, 3, 16, gen)
    q_out, _ = rope(q, k, cos, sin)
    q_out.sum().backward()
    assert k.grad is None
    dq_ref, _ = rope_reference_backward(torch.ones_like(fp64(q)), None, fp64(cos), fp64(sin), 16, "half")
    assert_close("q.grad", q.grad, dq_ref, TOLERANCE[torch.float32])


def test_op_saves_only_cos_and_sin(gen, reference_path):
    q = make_heads(2, 4, 3, 32, gen).requires_grad_()
    k = make_heads(2, 2, 3, 32, gen).requires_grad_()
    cos, sin = make_cos_sin(1, 3, 32, gen)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.ops.fuser.rope(q, k, cos, sin, 32, "half")
    assert [t.data_ptr() for t in saved] == [cos.data_ptr(), sin.data_ptr()]


def test_op_accepts_3d_and_4d_cos_sin(gen, reference_path):
    q, k = make_heads(2, 4, 3, 32, gen), make_heads(2, 2, 3, 32, gen)
    cos, sin = randn((2, 3, 32), gen), randn((2, 3, 32), gen)
    from_3d = rope(q, k, cos, sin, layout="interleaved")
    from_4d = rope(q, k, cos.unsqueeze(1), sin.unsqueeze(1), rotary_dim=32, layout="interleaved")
    assert all(torch.equal(a, b) for a, b in zip(from_3d, from_4d, strict=True))


def test_op_zero_tokens(gen, reference_path):
    q = make_heads(2, 4, 0, 32, gen).requires_grad_()
    k = make_heads(2, 2, 0, 32, gen).requires_grad_()
    q_out, k_out = rope(q, k, randn((1, 0, 32), gen), randn((1, 0, 32), gen))
    (q_out.sum() + k_out.sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_op_rejects_bad_arguments(gen):
    q, k = make_heads(1, 4, 3, 32, gen), make_heads(1, 2, 3, 32, gen)
    cos, sin = randn((1, 3, 32), gen), randn((1, 3, 32), gen)
    with pytest.raises(ValueError, match="no gradient for cos/sin"):
        rope(q, k, cos.requires_grad_(), sin)
    cos = cos.detach()
    with pytest.raises(ValueError, match="layout 'half', 'interleaved' or 'pairs_to_halves'"):
        rope(q, k, cos, sin, layout="neox")
    with pytest.raises(ValueError, match="even rotary_dim"):
        rope(q, k, cos[..., :15], sin[..., :15])
    with pytest.raises(ValueError, match="even rotary_dim"):
        rope(q, k, cos, sin, rotary_dim=64)
    with pytest.raises(ValueError, match="last dim 16"):
        rope(q, k, cos, sin, rotary_dim=16)
    with pytest.raises(ValueError, match=r"k of shape \[1, kv_heads, 3, 32\]"):
        rope(q, k[:, :, :2], cos, sin)
    with pytest.raises(ValueError, match="broadcastable to"):
        rope(q, k, randn((2, 3, 32), gen), sin)
    with pytest.raises(ValueError, match="broadcastable to"):
        rope(q, k, cos.unsqueeze(1).expand(1, 4, 3, 32), sin.unsqueeze(1))
    with pytest.raises(ValueError, match="seq, rotary_dim"):
        rope(q, k, cos[0], sin[0])


# (q/k dtype, cos/sin dtype, out_dtype) through the op with autograd; bf16 only on the reference path (CPU torch)
OP_MIXED_DTYPES = [
    pytest.param(F16, F32, F32, id="fp16_qk_fp32_cos_to_fp32"),
    pytest.param(F32, F16, F16, id="fp32_qk_fp16_cos_to_fp16"),
    pytest.param(F16, F16, F32, id="fp16_everything_to_fp32"),
]
OP_MIXED_DTYPES_BF16 = [
    pytest.param(BF16, F32, F32, id="bf16_qk_fp32_cos_to_fp32"),  # autocast, HF Trainer bf16=True
    pytest.param(F32, BF16, BF16, id="fp32_qk_bf16_cos_to_bf16"),
]


def check_op_autograd_mixed(model, q_dtype, cos_dtype, out_dtype, gen, shape=(2, 4, 2, 3, 32)):
    """``rope(..., out_dtype=)`` on HF's transposed views of q/k in ``q_dtype`` with cos/sin in ``cos_dtype``,
    then backward from output gradients of ``out_dtype``, vs fp64 autograd of the model's rotation of the same
    (rounded) values: outputs in ``out_dtype``, gradients in ``q_dtype``."""
    batch, n_q_heads, n_k_heads, seq_len, head_dim = shape
    rotary_dim = head_dim // 2  # partial: the pass-through channels change dtype too
    layout = MODELS[model][1]
    q_proj = randn((batch, seq_len, n_q_heads * head_dim), gen, q_dtype).requires_grad_()
    k_proj = randn((batch, seq_len, n_k_heads * head_dim), gen, q_dtype).requires_grad_()
    cos, sin = (t.to(cos_dtype) for t in model_cos_sin(model, 1, seq_len, rotary_dim, gen))
    probe_q = randn((batch, n_q_heads, seq_len, head_dim), gen, out_dtype)
    probe_k = randn((batch, n_k_heads, seq_len, head_dim), gen, out_dtype)

    def heads(proj, n_heads):
        return proj.view(batch, seq_len, n_heads, head_dim).transpose(1, 2)

    convert = MODELS[model][2]
    q_out, k_out = rope(
        heads(q_proj, n_q_heads),
        heads(k_proj, n_k_heads),
        convert(cos),
        convert(sin),
        rotary_dim=rotary_dim,
        layout=layout,
        out_dtype=out_dtype,
    )
    assert q_out.dtype == k_out.dtype == out_dtype and q_out.transpose(1, 2).is_contiguous()
    torch.autograd.backward((q_out, k_out), (probe_q, probe_k))
    assert q_proj.grad.dtype == k_proj.grad.dtype == q_dtype

    q64, k64 = fp64(q_proj).requires_grad_(), fp64(k_proj).requires_grad_()
    q_ref, k_ref = model_forward(model, heads(q64, n_q_heads), heads(k64, n_k_heads), fp64(cos), fp64(sin), rotary_dim)
    torch.autograd.backward((q_ref, k_ref), (fp64(probe_q), fp64(probe_k)))
    assert_close("q_out", q_out, q_ref, TOLERANCE[out_dtype])
    assert_close("k_out", k_out, k_ref, TOLERANCE[out_dtype])
    assert_close("q.grad", q_proj.grad, q64.grad, TOLERANCE[q_dtype])
    assert_close("k.grad", k_proj.grad, k64.grad, TOLERANCE[q_dtype])


@pytest.mark.parametrize("model", ["llama", "glm", "deepseek"])
@pytest.mark.parametrize("q_dtype, cos_dtype, out_dtype", OP_MIXED_DTYPES + OP_MIXED_DTYPES_BF16)
def test_op_mixed_dtypes_match_fp64_model(q_dtype, cos_dtype, out_dtype, model, gen, reference_path):
    check_op_autograd_mixed(model, q_dtype, cos_dtype, out_dtype, gen)


@interpreter
@pytest.mark.parametrize("model", ["llama", "glm"])
@pytest.mark.parametrize("q_dtype, cos_dtype, out_dtype", OP_MIXED_DTYPES)
def test_op_mixed_dtypes_through_triton(q_dtype, cos_dtype, out_dtype, model, gen, monkeypatch, triton_on_cpu):
    triton_on_cpu()
    launched = count_launches(monkeypatch)
    check_op_autograd_mixed(model, q_dtype, cos_dtype, out_dtype, gen, shape=(1, 4, 2, 2, 32))
    assert launched == ["forward", "backward"]


@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
def test_op_equals_eager_promotion_under_autocast_dtypes(dtype, gen, reference_path):
    """What the pattern emits under autocast: half q/k, fp32 cos/sin, out_dtype = eager's promotion. The result
    is eager's fp32 result (the same fp32 products), the gradients eager's half ones, rounded once instead of
    per term (so within one half-precision ulp)."""
    q = make_heads(2, 4, 3, 32, gen, dtype).requires_grad_()
    k = make_heads(2, 2, 3, 32, gen, dtype).requires_grad_()
    cos, sin = randn((1, 3, 32), gen), randn((1, 3, 32), gen)
    out_dtype = torch.promote_types(dtype, cos.dtype)
    q_out, k_out = rope(q, k, cos, sin, out_dtype=out_dtype)
    q_ref, k_ref = (t.detach().clone().requires_grad_() for t in (q, k))
    q_eager, k_eager = llama_apply_rotary_pos_emb(q_ref, k_ref, cos, sin)
    assert q_out.dtype == q_eager.dtype == k_out.dtype == k_eager.dtype == torch.float32
    torch.testing.assert_close(q_out, q_eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_out, k_eager, rtol=1e-6, atol=1e-6)
    probe_q, probe_k = randn(q_out.shape, gen), randn(k_out.shape, gen)
    torch.autograd.backward((q_out, k_out), (probe_q, probe_k))
    torch.autograd.backward((q_eager, k_eager), (probe_q, probe_k))
    assert q.grad.dtype == q_ref.grad.dtype == dtype and k.grad.dtype == k_ref.grad.dtype == dtype
    assert_close("q.grad", q.grad, q_ref.grad, TOLERANCE[dtype])
    assert_close("k.grad", k.grad, k_ref.grad, TOLERANCE[dtype])


def test_fake_gives_the_requested_dtypes():
    """Under compile the op is traced with fake tensors: its outputs must carry out_dtype / dq_dtype / dk_dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(2, 4, 3, 32, dtype=BF16), torch.empty(2, 2, 3, 32, dtype=F16)
        cos = torch.empty(1, 1, 3, 32)
        assert [t.dtype for t in torch.ops.fuser.rope(q, k, cos, cos, 32, "half")] == [BF16, F16]
        q_out, k_out = torch.ops.fuser.rope(q, k, cos, cos, 32, "half", F32)
        assert q_out.dtype == k_out.dtype == F32 and q_out.shape == q.shape and k_out.shape == k.shape
        dq, dk = torch.ops.fuser.rope_backward(q_out, k_out, cos, cos, 32, "half", BF16, F16)
        assert (dq.dtype, dk.dtype) == (BF16, F16) and dq.shape == q.shape and dk.shape == k.shape


def _float_args(gen):
    q, k = make_heads(1, 4, 3, 32, gen), make_heads(1, 2, 3, 32, gen)
    cos, sin = randn((1, 3, 32), gen), randn((1, 3, 32), gen)
    return {"q": q, "k": k, "cos": cos, "sin": sin}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64], ids=str)
@pytest.mark.parametrize("name", ["q", "k", "cos", "sin"])
def test_rope_rejects_non_float_inputs(name, dtype, gen, reference_path):
    """An integer (or bool, or complex) tensor is refused by name with what to do, by the function, the custom op
    and the Triton launcher alike, never rotated into garbage."""
    args = _float_args(gen)
    args[name] = args[name].to(dtype)
    message = rf"fuser: rope expects a floating-point {name} \(.*\), got {dtype}; cast it first"
    with pytest.raises(ValueError, match=message):
        rope(**args)
    q, k, cos, sin = (args[n].unsqueeze(1) if n in ("cos", "sin") else args[n] for n in ("q", "k", "cos", "sin"))
    with pytest.raises(ValueError, match=message):  # the custom op itself, as a rewritten graph calls it
        torch.ops.fuser.rope(q, k, cos, sin, 32, "half")
    with pytest.raises(ValueError, match=message):  # checked before any launch
        rope_forward_triton(q, k, cos, sin, 32, "half")


def test_rope_rejects_non_float_out_dtype(gen, reference_path):
    args = _float_args(gen)
    for bad, error in ((torch.int64, ValueError), (torch.bool, ValueError), ("float32", TypeError)):
        with pytest.raises(error, match=r"rope expects out_dtype to be None or a floating-point dtype"):
            rope(**args, out_dtype=bad)
    cos4, sin4 = args["cos"].unsqueeze(1), args["sin"].unsqueeze(1)
    with pytest.raises(ValueError, match=r"rope expects out_dtype to be None or a floating-point dtype"):
        torch.ops.fuser.rope(args["q"], args["k"], cos4, sin4, 32, "half", torch.int32)
    with pytest.raises(ValueError, match=r"rope expects dq_dtype to be None or a floating-point dtype"):
        torch.ops.fuser.rope_backward(args["q"], args["k"], cos4, sin4, 32, "half", torch.int32)


def _opcheck_rope_args(gen):
    q, k = make_heads(2, 4, 3, 32, gen), make_heads(2, 2, 3, 32, gen)
    qh = make_heads(1, 2, 3, 32, gen, torch.float16, "contiguous")
    cos, sin = make_cos_sin(1, 3, 32, gen)
    cos16, sin16 = make_cos_sin(1, 3, 16, gen)
    cos_b, sin_b = make_cos_sin(2, 3, 32, gen)
    return [
        (q.requires_grad_(), k.requires_grad_(), cos, sin, 32, "half"),  # GQA, HF's transposed views
        (qh.requires_grad_(), qh.new_empty(0), cos16, sin16, 16, "interleaved"),  # k absent, fp16, fp32 cos
        (q, k.detach()[:, :1].requires_grad_(), cos_b, sin_b, 32, "pairs_to_halves"),  # MQA, cos per batch
        # autocast: bf16 q/k, fp32 cos/sin, fp32 out (gradients back in bf16)
        (q.detach().bfloat16().requires_grad_(), k.detach().bfloat16().requires_grad_(), cos, sin, 32, "half", F32),
        # a wider input rounded once: fp32 q/k, fp16 cos/sin, fp16 out
        (q.detach().requires_grad_(), k.detach().requires_grad_(), cos.half(), sin.half(), 32, "interleaved", F16),
    ]


OPCHECK_IDS = ["gqa_half", "q_only_fp16_interleaved", "mqa_pairs_to_halves", "bf16_to_fp32", "fp32_to_fp16"]


@pytest.mark.parametrize("case", range(len(OPCHECK_IDS)), ids=OPCHECK_IDS)
def test_opcheck_rope(case, gen, reference_path):
    torch.library.opcheck(torch.ops.fuser.rope.default, _opcheck_rope_args(gen)[case])


def test_opcheck_rope_backward(gen, reference_path):
    dq_out, dk_out = make_heads(2, 4, 3, 32, gen), make_heads(2, 2, 3, 32, gen, storage="contiguous")
    cos, sin = make_cos_sin(2, 3, 16, gen)
    for layout in LAYOUTS:
        torch.library.opcheck(torch.ops.fuser.rope_backward.default, (dq_out, dk_out, cos, sin, 16, layout))
    torch.library.opcheck(torch.ops.fuser.rope_backward.default, (dq_out, dq_out.new_empty(0), cos, sin, 16, "half"))
    # gradients of fp32 outputs back to bf16 / fp16 inputs
    torch.library.opcheck(torch.ops.fuser.rope_backward.default, (dq_out, dk_out, cos, sin, 16, "half", BF16, F16))


@interpreter
def test_opcheck_through_triton(gen, triton_on_cpu):
    triton_on_cpu()
    q, k = make_heads(1, 2, 2, 16, gen), make_heads(1, 1, 2, 16, gen)
    cos, sin = make_cos_sin(1, 2, 16, gen)
    torch.library.opcheck(torch.ops.fuser.rope.default, (q.requires_grad_(), k.requires_grad_(), cos, sin, 16, "half"))
    torch.library.opcheck(
        torch.ops.fuser.rope_backward.default, (q.detach(), k.detach(), cos[..., :8], sin[..., :8], 8, "interleaved")
    )


# ---------------------------------------------------------------------------------------------------------
# The custom op forced through Triton on CPU (the interpreter)
# ---------------------------------------------------------------------------------------------------------


def count_launches(monkeypatch):
    launched = []

    def launch(src, dst, rotation, backward):
        launched.append("backward" if backward else "forward")
        return real_launch(src, dst, rotation, backward)

    real_launch = rope_module._launch
    monkeypatch.setattr(rope_module, "_launch", launch)
    return launched


@interpreter
@pytest.mark.parametrize("model, rotary_fraction", OP_CASES)
def test_op_through_triton_on_cpu(model, rotary_fraction, gen, monkeypatch, triton_on_cpu):
    triton_on_cpu()
    launched = count_launches(monkeypatch)
    check_op_autograd(model, rotary_fraction, gen, shape=(1, 4, 2, 2, 32))
    # a silent fall-back to the reference path must not pass
    assert launched == ["forward", "backward"]


@interpreter
@pytest.mark.parametrize(
    "requires_grad, with_k",
    [pytest.param((False, True), True, id="k_grad_only"), pytest.param((True, False), False, id="k_absent")],
)
def test_op_through_triton_partial_grads(requires_grad, with_k, gen, monkeypatch, triton_on_cpu):
    triton_on_cpu()
    launched = count_launches(monkeypatch)
    check_op_autograd("glm", 2, gen, requires_grad=requires_grad, with_k=with_k, shape=(1, 4, 2, 2, 32))
    assert launched == ["forward", "backward"]


# ---------------------------------------------------------------------------------------------------------
# GPU: real shapes, all three dtypes
# ---------------------------------------------------------------------------------------------------------
# Tolerances as on the CPU (module docstring): every element is one rounding of an fp32 result to the output dtype,
# the inputs and cos/sin being exact in the fp64 oracle. bf16 ≤ 1e-2 is one bf16 ulp (eps 7.8e-3) where half an ulp
# is the worst case of a correct kernel; fp16 ≤ 2e-3 two fp16 ulps (eps 9.8e-4); fp32 ≤ 1e-5 two decades over the
# ~4e-8 of a handful of fp32 roundings. The fp64 oracle runs on the GPU.

GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
GPU_BATCH, GPU_SEQ, GPU_Q_HEADS, GPU_K_HEADS = 2, 2048, 32, 8


def gpu_inputs(head_dim, rotary_dim, dtype, gen, cos_dtype=None, cos_batch=1):
    """Llama-8B-like attention at B 2, T 2048: q/k as HF's transposed views, cos/sin [cos_batch, 1, T, R]."""
    q, dq_out = (make_heads(GPU_BATCH, GPU_Q_HEADS, GPU_SEQ, head_dim, gen, dtype, "hf", "cuda") for _ in range(2))
    k, dk_out = (make_heads(GPU_BATCH, GPU_K_HEADS, GPU_SEQ, head_dim, gen, dtype, "hf", "cuda") for _ in range(2))
    cos, sin = make_cos_sin(cos_batch, GPU_SEQ, rotary_dim, gen, cos_dtype or dtype, "cuda")
    return q, k, cos, sin, dq_out, dk_out


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rotary_fraction", [1, 2], ids=["full", "half_rotary"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [128, 64, 80])
def test_gpu_matches_fp64_reference(head_dim, dtype, rotary_fraction, layout, gen):
    rotary_dim = head_dim // rotary_fraction
    q, k, cos, sin, dq_out, dk_out = gpu_inputs(head_dim, rotary_dim, dtype, gen)
    check_against_fp64_reference(q, k, cos, sin, dq_out, dk_out, rotary_dim, layout)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_fp32_cos_per_batch_and_q_only(dtype, gen):
    q, k, cos, sin, dq_out, dk_out = gpu_inputs(128, 128, dtype, gen, cos_dtype=torch.float32, cos_batch=GPU_BATCH)
    check_against_fp64_reference(q, k, cos, sin, dq_out, dk_out, 128, "half")
    check_against_fp64_reference(q, None, cos, sin, dq_out, None, 128, "interleaved")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "q_dtype, cos_dtype, out_dtype",
    [pytest.param(BF16, F32, F32, id="bf16_qk_fp32_cos_to_fp32"),  # autocast, HF Trainer bf16=True
     pytest.param(F32, BF16, BF16, id="fp32_qk_bf16_cos_to_bf16"),  # a wider input rounded once
     pytest.param(F16, F32, F32, id="fp16_qk_fp32_cos_to_fp32")],
)  # fmt: skip
def test_gpu_mixed_dtypes_match_fp64_reference(q_dtype, cos_dtype, out_dtype, layout, gen):
    q, k, cos, sin, _, _ = gpu_inputs(128, 64, q_dtype, gen, cos_dtype=cos_dtype)
    dq_out, dk_out = randn(q.shape, gen, out_dtype, "cuda"), randn(k.shape, gen, out_dtype, "cuda")
    check_against_fp64_reference(q, k, cos, sin, dq_out, dk_out, 64, layout, out_dtype=out_dtype)


def llama_cos_sin(seq_len, head_dim, dtype, device, base=500000.0):
    """HF LlamaRotaryEmbedding's output for positions 0..T-1: [1, T, D], cast to the model dtype."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    freqs = torch.arange(seq_len, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_op_autograd_llama(dtype, gen):
    """Llama attention's rotary on the GPU: fuser's op with autograd vs fp64 autograd of HF's formula."""
    head_dim = 128
    q_proj = randn((GPU_BATCH, GPU_SEQ, GPU_Q_HEADS * head_dim), gen, dtype, "cuda").requires_grad_()
    k_proj = randn((GPU_BATCH, GPU_SEQ, GPU_K_HEADS * head_dim), gen, dtype, "cuda").requires_grad_()
    cos, sin = llama_cos_sin(GPU_SEQ, head_dim, dtype, "cuda")
    probe_q = randn((GPU_BATCH, GPU_Q_HEADS, GPU_SEQ, head_dim), gen, dtype, "cuda")
    probe_k = randn((GPU_BATCH, GPU_K_HEADS, GPU_SEQ, head_dim), gen, dtype, "cuda")

    def heads(proj, n_heads):
        return proj.view(GPU_BATCH, GPU_SEQ, n_heads, head_dim).transpose(1, 2)

    q_out, k_out = rope(heads(q_proj, GPU_Q_HEADS), heads(k_proj, GPU_K_HEADS), cos, sin)
    torch.autograd.backward((q_out, k_out), (probe_q, probe_k))
    q64, k64 = fp64(q_proj).requires_grad_(), fp64(k_proj).requires_grad_()
    q_ref, k_ref = llama_apply_rotary_pos_emb(heads(q64, GPU_Q_HEADS), heads(k64, GPU_K_HEADS), fp64(cos), fp64(sin))
    torch.autograd.backward((q_ref, k_ref), (fp64(probe_q), fp64(probe_k)))
    tol = TOLERANCE[dtype]
    for name, actual, expected in (
        ("q_out", q_out, q_ref),
        ("k_out", k_out, k_ref),
        ("q.grad", q_proj.grad, q64.grad),
        ("k.grad", k_proj.grad, k64.grad),
    ):
        assert_close(name, actual, expected, tol)


@pytest.mark.gpu
def test_gpu_int64_offsets(gen):
    """q with 2^31 + 2^16 elements (B 1, T 2^19 + 16, 32 heads × 128): offsets past int32 must not wrap."""
    seq_len, n_heads, head_dim = 2**19 + 16, 32, 128
    q = torch.randn((1, seq_len, n_heads, head_dim), dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    cos, sin = llama_cos_sin(seq_len, head_dim, torch.bfloat16, "cuda")
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_out, _ = rope_forward_triton(q, None, cos, sin, head_dim, "half")
    dq, _ = rope_backward_triton(q, None, cos, sin, head_dim, "half")
    tail = slice(seq_len - 64, seq_len)  # the last tokens, past 2^31 elements
    q_ref, _ = rope_reference_forward(
        fp64(q[:, :, tail]), None, fp64(cos[:, :, tail]), fp64(sin[:, :, tail]), 128, "half"
    )
    dq_ref, _ = rope_reference_backward(
        fp64(q[:, :, tail]), None, fp64(cos[:, :, tail]), fp64(sin[:, :, tail]), 128, "half"
    )
    assert_close("q_out tail", q_out[:, :, tail], q_ref, TOLERANCE[torch.bfloat16])
    assert_close("dq tail", dq[:, :, tail], dq_ref, TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_results_are_deterministic(gen):
    q, k, cos, sin, dq_out, dk_out = gpu_inputs(128, 128, torch.bfloat16, gen)
    first = run_triton(q, k, cos, sin, dq_out, dk_out, 128, "half")
    second = run_triton(q, k, cos, sin, dq_out, dk_out, 128, "half")
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, n_heads, n_kv_heads", [(64, 32, 8), (128, 32, 8)], ids=["llama-1b", "llama-8b"])
def test_gpu_attention_output_is_laid_out_for_the_output_projection(head_dim, n_heads, n_kv_heads):
    """Llama's attention at 4×2048 tokens on the GPU: q and k rotated by fuser's op from the projections' HF views
    come back in [B, T, H, D] storage, and the causal SDPA call (the kernel PyTorch picks, GQA as the causal rewrite
    folds it) returns its output in that layout too: ``transpose(1, 2).reshape(B, T, H·D)``, o_proj's input, is a
    view of the tensor SDPA saves, not a second copy. Its backward's dq and dk come back the same way."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, t = 4, 2048

    def proj(heads):
        x = torch.randn(b, t, heads * head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
        return x.requires_grad_()

    q_proj, k_proj, v_proj = proj(n_heads), proj(n_kv_heads), proj(n_kv_heads)
    cos = torch.randn(1, t, head_dim, device="cuda", generator=gen)
    sin = torch.randn(1, t, head_dim, device="cuda", generator=gen)

    def heads(x, n):
        return x.view(b, t, n, head_dim).transpose(1, 2)

    q, k = rope(heads(q_proj, n_heads), heads(k_proj, n_kv_heads), cos.to(torch.bfloat16), sin.to(torch.bfloat16))
    assert q.transpose(1, 2).is_contiguous() and k.transpose(1, 2).is_contiguous()
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, heads(v_proj, n_kv_heads), is_causal=True, enable_gqa=True
    )
    flat = out.transpose(1, 2).reshape(b, t, n_heads * head_dim)
    assert flat.data_ptr() == out.data_ptr() and flat._base is not None, out.stride()
    flat.float().square().sum().backward()
    assert q_proj.grad.is_contiguous() and k_proj.grad.is_contiguous()
