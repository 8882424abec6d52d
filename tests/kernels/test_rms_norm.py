"""Kernel tests for the fused RMSNorm (``src/fuser/kernels/rms_norm.py``): Triton launchers, reference, custom op.

Oracle: the reference formulas (``rms_norm_forward/backward(..., impl="reference")``) evaluated on fp64 copies of
the inputs; the hand-written reference backward is itself checked against fp64 autograd of the reference forward.

Error measure: ``rel_err(a, b) = ‖a − b‖ / ‖b‖`` over the whole tensor, computed in fp64. Tolerances:

- fp32 outputs ≤ 1e-5: the kernel's own error is a handful of fp32 roundings (fp32 eps 1.2e-7) plus a sum over
  ≤ 8192 columns; measured ~1e-7, so 1e-5 leaves two decades of slack yet still catches any formula slip.
- fp16 outputs ≤ 2e-3: storing an fp32 result rounds each element by ≤ half an fp16 ulp (fp16 eps 9.8e-4);
  2e-3 allows a few ulps (inputs are fp16 too, but their fp64 copies are exact, so no input error enters).
- bf16 outputs ≤ 1e-2 (bf16 eps 7.8e-3): one bf16 ulp. On the interpreter fp32→bf16 stores truncate rather
  than round (see DESIGN.md, "Testing tiers"), so there a full ulp per element is expected.
- dx is measured against ‖rstd·g‖ (g = dy·(weight + offset)) instead of ‖dx‖: dx = rstd·(g − n·mean(g·n))
  subtracts two terms of that size, so no fp32 evaluation of the formula (eager autograd included) can be
  accurate to better than u·‖rstd·g‖. For hidden ≥ 17 the two norms agree within a few percent; for hidden = 1
  the terms cancel almost exactly (dx = rstd·g·eps/(x² + eps)) and ‖dx‖ is ~1e-3 of ‖rstd·g‖.

Every output is poisoned with NaN before the kernel runs (``out=`` / ``dx_out=``), and every check first asserts
there is no NaN (nor inf), so an element the kernel never writes fails.

CPU launcher tests run through Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` when there is
no GPU); the interpreter's bf16 arithmetic is not trusted, so bf16 is only loaded/stored there and proven on the
GPU tests (``@pytest.mark.gpu``), which use real shapes.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import fuser.kernels.rms_norm as rms_norm_module
from fuser.kernels._triton import HAS_TRITON, interpreting, triton_on_cpu
from fuser.kernels.rms_norm import Norm, rms_norm, rms_norm_backward, rms_norm_forward


# The op's single entry per direction (``rms_norm_forward`` / ``rms_norm_backward``) per path, called as the tests
# below call it.
def rms_norm_reference_forward(x, weight, eps, offset=0.0, norm_dtype=None, out_dtype=None):
    return rms_norm_forward(x, Norm(weight, eps, offset, norm_dtype), out_dtype, impl="reference")


def rms_norm_reference_backward(
    dy, x, weight, eps, offset=0.0, norm_dtype=None, compute_dweight=True, rstd=None, dx_dtype=None
):
    norm = Norm(weight, eps, offset, norm_dtype)
    return rms_norm_backward(dy, x, norm, compute_dweight, dx_dtype, rstd=rstd, impl="reference")


def rms_norm_forward_triton(x, weight, eps, offset=0.0, norm_dtype=None, out_dtype=None, out=None, rstd=None):
    return rms_norm_forward(x, Norm(weight, eps, offset, norm_dtype), out_dtype, impl="triton", out=out, rstd=rstd)


def rms_norm_backward_triton(
    dy, x, weight, eps, offset=0.0, norm_dtype=None, compute_dweight=True, dx_out=None, rstd=None, dx_dtype=None
):
    norm = Norm(weight, eps, offset, norm_dtype)
    return rms_norm_backward(dy, x, norm, compute_dweight, dx_dtype, rstd=rstd, impl="triton", dx_out=dx_out)


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# CPU launches of the Triton kernels need the interpreter; on a GPU machine the gpu tests cover the kernels.
interpreter = pytest.mark.skipif(
    not (HAS_TRITON and interpreting()), reason="needs Triton with TRITON_INTERPRET=1 (set by conftest without a GPU)"
)

# (weight, offset): no weight; Llama-style weight; Gemma's 1 + weight
VARIANTS = [
    pytest.param(False, 0.0, id="no_weight"),
    pytest.param(True, 0.0, id="weight"),
    pytest.param(True, 1.0, id="gemma_offset"),
]


# ---------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test id: fresh inputs per test and per parametrization, reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def randn(shape, gen, dtype=torch.float32, device="cpu", scale=1.0, shift=0.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + shift).to(dtype=dtype, device=device)


def make_inputs(shape, dtype, gen, with_weight, device="cpu"):
    hidden = shape[-1]
    # a non-zero mean and a scale far from 1, so neither the mean-square nor the normalisation is trivial
    x = randn(shape, gen, dtype, device, scale=2.0, shift=0.5)
    weight = randn(hidden, gen, dtype, device, scale=0.5, shift=1.0) if with_weight else None
    dy = randn(shape, gen, dtype, device)
    return x, weight, dy


def fp64(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to(torch.float64)


def poisoned(shape, dtype, device="cpu") -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def rel_err(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """‖actual − expected‖ / ‖expected‖ in fp64; ``scale`` replaces the denominator."""
    diff = (actual.detach().double() - expected.detach().double()).norm()
    denom = expected.detach().double().norm() if scale is None else scale
    return (diff / denom).item() if denom > 0 else diff.item()


def dx_scale(dy, x, weight, eps, offset) -> torch.Tensor:
    """‖rstd·g‖, the size of the terms the dx formula subtracts (see the module docstring)."""
    x, dy = fp64(x), fp64(dy)
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    g = dy if weight is None else dy * (fp64(weight) + offset)
    return (rstd * g).norm()


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float, scale=None) -> None:
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    bad = ~torch.isfinite(actual)
    assert not bad.any(), f"{name}: {int(bad.sum())} of {actual.numel()} elements are NaN/inf (never written?)"
    err = rel_err(actual, expected, scale)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"


def run_triton(x, weight, dy, eps, offset, norm_dtype=None, out_dtype=None, compute_dweight=True):
    """Forward and backward launchers with NaN-poisoned outputs."""
    y = rms_norm_forward_triton(
        x, weight, eps, offset, norm_dtype, out_dtype, out=poisoned(x.shape, out_dtype or x.dtype, x.device)
    )
    dx, dw = rms_norm_backward_triton(
        dy, x, weight, eps, offset, norm_dtype, compute_dweight, dx_out=poisoned(x.shape, x.dtype, x.device)
    )
    return y, dx, dw


def check_against_fp64_reference(x, weight, dy, eps, offset, norm_dtype=None, out_dtype=None, tol=None):
    y, dx, dw = run_triton(x, weight, dy, eps, offset, norm_dtype, out_dtype)
    y_ref = rms_norm_reference_forward(fp64(x), fp64(weight), eps, offset, norm_dtype, torch.float64)
    dx_ref, dw_ref = rms_norm_reference_backward(fp64(dy), fp64(x), fp64(weight), eps, offset, norm_dtype)
    out_dtype = out_dtype or x.dtype
    assert y.dtype == out_dtype and dx.dtype == x.dtype
    assert_close("y", y, y_ref, tol or TOLERANCE[out_dtype])
    assert_close("dx", dx, dx_ref, tol or TOLERANCE[x.dtype], scale=dx_scale(dy, x, weight, eps, offset))
    if weight is None:
        assert dw is None
    else:
        assert dw.dtype == weight.dtype
        assert_close("dweight", dw, dw_ref, tol or TOLERANCE[weight.dtype])


# ---------------------------------------------------------------------------------------------------------
# The oracle itself: the hand-written reference backward is autograd of the reference forward (fp64)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_weight, offset", VARIANTS)
@pytest.mark.parametrize("shape", [(4, 1), (13, 17), (2, 9, 65), (2, 3, 4, 300)], ids=str)
def test_reference_backward_is_autograd_of_reference_forward(shape, with_weight, offset, gen):
    eps = 1e-6
    x, weight, dy = make_inputs(shape, torch.float64, gen, with_weight)
    x.requires_grad_()
    if weight is not None:
        weight.requires_grad_()
    rms_norm_reference_forward(x, weight, eps, offset).backward(dy)
    dx, dw = rms_norm_reference_backward(dy, x.detach(), fp64(weight), eps, offset)
    # fp64 throughout: 1e-10 is ~1e6 fp64 ulps, and hidden=1's cancellation costs ~1e3 of them
    assert_close("dx", dx, x.grad, 1e-10, scale=dx_scale(dy, x, weight, eps, offset))
    if weight is not None:
        assert_close("dweight", dw, weight.grad, 1e-12)
    else:
        assert dw is None


# ---------------------------------------------------------------------------------------------------------
# Triton launchers on the interpreter
# ---------------------------------------------------------------------------------------------------------

# Hidden sizes 1, 17, 65, 300, 1000, 4099 (plus a power of two); row counts chosen so that the forward has several
# row tiles with a ragged last one, and the backward (4 programs on the interpreter) walks more than one tile per
# program with some programs' last tile fully masked.
SHAPES = [
    (7, 1),
    (300, 17),
    (2, 97, 65),
    (2, 6, 4, 300),  # [batch, seq, heads, head_dim]
    (3, 5, 4, 64),  # [batch, seq, heads, head_dim], Qwen3-style per-head q/k norm
    (37, 1000),
    (9, 4099),
]


@interpreter
@pytest.mark.parametrize("with_weight, offset", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_matches_fp64_reference(shape, dtype, with_weight, offset, gen):
    x, weight, dy = make_inputs(shape, dtype, gen, with_weight)
    check_against_fp64_reference(x, weight, dy, 1e-6, offset)


@interpreter
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("with_weight", [False, True], ids=["no_weight", "weight"])
def test_triton_fp16_norm_dtype_rounds_before_weight(with_weight, out_dtype, gen):
    """Llama on fp16: the normalised value is rounded to fp16 before the weight multiply (and in dweight)."""
    shape, eps = (40, 65), 1e-6
    x, weight, dy = make_inputs(shape, torch.float16, gen, with_weight)
    # the fp16 tolerance even for an fp32 result: the kernel's fp32 n and the oracle's fp64 n can fall on either
    # side of an fp16 rounding boundary, and such an element then differs by one fp16 ulp
    check_against_fp64_reference(x, weight, dy, eps, 0.0, torch.float16, out_dtype, tol=TOLERANCE[torch.float16])
    if weight is None and out_dtype == torch.float32:
        # without a weight y is fp16(n) itself: exactly representable in fp16, within one fp16 ulp of the rounding
        # of the fp64 n
        n16 = rms_norm_forward_triton(x, None, eps, 0.0, torch.float16, torch.float32, out=poisoned(shape, out_dtype))
        n16_ref = rms_norm_reference_forward(fp64(x), None, eps, 0.0, torch.float16, torch.float64)
        assert torch.equal(n16, n16.half().float()), "the normalised value was not rounded to fp16"
        ulp = torch.clamp(n16_ref.abs() * 2.0**-10, min=2.0**-24)
        assert ((n16.double() - n16_ref).abs() <= ulp).all()
        # dweight sums dy·fp16(n), the same rounded n the forward multiplies the weight by; with an fp32 weight
        # (so an fp32 dweight) the fp32 tolerance separates that from dy·n (rounding n moves dweight ~2e-4)
        weight32 = randn(shape[-1], gen, scale=0.5, shift=1.0)
        _, dw = rms_norm_backward_triton(dy, x, weight32, eps, 0.0, torch.float16, True, poisoned(shape, x.dtype))
        assert_close("dweight", dw, (fp64(dy) * fp64(n16)).sum(0), TOLERANCE[torch.float32])


@interpreter
def test_triton_bf16_load_store(gen):
    """bf16 as the interpreter can be trusted with it: load → fp32 math → store (1 ulp, stores truncate)."""
    x, weight, dy = make_inputs((24, 65), torch.bfloat16, gen, True)
    check_against_fp64_reference(x, weight, dy, 1e-6, 1.0)


@interpreter
def test_triton_out_dtype_differs_from_input(gen):
    """fp16 activations with an fp32 weight and an fp32 result (dy then arrives in fp32)."""
    shape = (2, 11, 300)
    x = randn(shape, gen, torch.float16, scale=2.0)
    weight = randn(shape[-1], gen, torch.float32, scale=0.5, shift=1.0)
    dy = randn(shape, gen, torch.float32)
    eps = 1e-5
    y, dx, dw = run_triton(x, weight, dy, eps, 0.0, None, torch.float32)
    assert (y.dtype, dx.dtype, dw.dtype) == (torch.float32, torch.float16, torch.float32)
    y_ref = rms_norm_reference_forward(fp64(x), fp64(weight), eps, 0.0, None, torch.float64)
    dx_ref, dw_ref = rms_norm_reference_backward(fp64(dy), fp64(x), fp64(weight), eps, 0.0)
    assert_close("y", y, y_ref, TOLERANCE[torch.float32])
    assert_close("dx", dx, dx_ref, TOLERANCE[torch.float16], scale=dx_scale(dy, x, weight, eps, 0.0))
    assert_close("dweight", dw, dw_ref, TOLERANCE[torch.float32])


# Each layout builds a [36, 65] (or [2, 18, 65]) tensor whose storage is not that of a contiguous tensor.
X_KW = {"scale": 2.0, "shift": 0.5}


def _transposed(gen, shape, **kw):  # column stride != 1: the launcher must copy
    return randn(shape[::-1], gen, **kw).t()


def _row_strided(gen, shape, **kw):  # a slice of wider rows: unit column stride, row stride != hidden (a view)
    return randn((shape[0], shape[1] + 13), gen, **kw)[:, 3 : 3 + shape[1]]


def _every_other_row(gen, shape, **kw):  # 3-D with a strided middle dim
    return randn((2, shape[0], shape[1]), gen, **kw)[:, ::2]


def _expanded(gen, shape, **kw):  # stride-0 rows, as autograd hands out for `y.sum()`-like losses
    return randn(shape[-1], gen, **kw).expand(shape)


def _contiguous(gen, shape, **kw):
    return randn(shape, gen, **kw)


@interpreter
@pytest.mark.parametrize(
    "make_x, make_dy",
    [
        pytest.param(_transposed, _contiguous, id="x_transposed"),
        pytest.param(_row_strided, _contiguous, id="x_row_strided"),
        pytest.param(_every_other_row, _every_other_row, id="x_and_dy_every_other_row"),
        pytest.param(_contiguous, _transposed, id="dy_transposed"),
        pytest.param(_contiguous, _expanded, id="dy_expanded"),
        pytest.param(_expanded, _row_strided, id="x_expanded"),
    ],
)
def test_triton_non_contiguous_inputs(make_x, make_dy, gen):
    shape = (36, 65)
    x = make_x(gen, shape, **X_KW)
    dy = make_dy(gen, shape)
    weight = randn(2 * shape[-1], gen, scale=0.5, shift=1.0)[::2]  # a non-contiguous weight too
    assert x.shape == dy.shape
    assert not (x.is_contiguous() and dy.is_contiguous())
    x_before = x.clone()
    check_against_fp64_reference(x, weight, dy, 1e-6, 1.0)
    assert torch.equal(x, x_before)


@interpreter
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_triton_backward_without_dweight(offset, gen):
    x, weight, dy = make_inputs((2, 33, 65), torch.float32, gen, True)
    dx, dw = rms_norm_backward_triton(
        dy, x, weight, 1e-6, offset, None, compute_dweight=False, dx_out=poisoned(x.shape, x.dtype)
    )
    assert dw is None
    dx_ref, _ = rms_norm_reference_backward(fp64(dy), fp64(x), fp64(weight), 1e-6, offset)
    assert_close("dx", dx, dx_ref, TOLERANCE[torch.float32], scale=dx_scale(dy, x, weight, 1e-6, offset))


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(37, 65), (2, 9, 300), (3, 1000)], ids=str)
def test_triton_saved_rstd_path(shape, dtype, gen):
    """The op's path: forward stores rstd, backward loads it instead of recomputing it."""
    x, weight, dy = make_inputs(shape, dtype, gen, True)
    rstd = torch.full(shape[:-1], float("nan"), dtype=torch.float32)
    y = rms_norm_forward_triton(
        x, weight, 1e-6, 1.0, None, None, out=torch.full(shape, float("nan"), dtype=dtype), rstd=rstd
    )
    rstd64 = torch.rsqrt(fp64(x).pow(2).mean(-1) + 1e-6)
    assert_close("rstd", rstd, rstd64, TOLERANCE[torch.float32])
    y64 = rms_norm_reference_forward(fp64(x), fp64(weight), 1e-6, 1.0)
    assert_close("y", y, y64, TOLERANCE[dtype])
    dx_out = torch.full(shape, float("nan"), dtype=dtype)
    dx, dw = rms_norm_backward_triton(dy, x, weight, 1e-6, 1.0, None, True, dx_out=dx_out, rstd=rstd)
    dx64, dw64 = rms_norm_reference_backward(fp64(dy), fp64(x), fp64(weight), 1e-6, 1.0)
    assert_close("dx", dx, dx64, TOLERANCE[dtype])
    assert_close("dweight", dw, dw64, TOLERANCE[dtype])
    # a wrong rstd must change dx: the kernel really uses the saved statistic
    dx_wrong, _ = rms_norm_backward_triton(dy, x, weight, 1e-6, 1.0, None, False, rstd=rstd * 2)
    assert not torch.allclose(dx_wrong.float(), dx.float())


@interpreter
@pytest.mark.parametrize("with_weight", [False, True], ids=["no_weight", "weight"])
@pytest.mark.parametrize("shape", [(0, 17), (2, 0, 65), (0, 4, 4099)], ids=str)
def test_triton_zero_rows(shape, with_weight, gen):
    x, weight, dy = make_inputs(shape, torch.float32, gen, with_weight)
    y, dx, dw = run_triton(x, weight, dy, 1e-6, 0.0)
    assert y.shape == x.shape and dx.shape == x.shape
    if with_weight:
        assert dw.shape == weight.shape and dw.dtype == weight.dtype
        assert torch.equal(dw, torch.zeros_like(weight))
    else:
        assert dw is None


# ---------------------------------------------------------------------------------------------------------
# The custom op and its autograd (CPU: the reference path)
# ---------------------------------------------------------------------------------------------------------


def llama_rms_norm(x, weight, eps):
    """Hugging Face's LlamaRMSNorm.forward (upcast to fp32, cast back before the weight multiply)."""
    upcast = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(upcast)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def gemma_rms_norm(x, weight, eps):
    """Hugging Face's GemmaRMSNorm.forward (all in fp32, ``1 + weight``)."""
    upcast = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(upcast)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.to(upcast))).to(x.dtype)


def plain_rms_norm(x, weight, eps):
    """No weight (weight is None): the normalisation alone."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# name: (plain-torch module body, fuser kwargs, uses a weight)
MODELS = {
    "llama": (llama_rms_norm, {"offset": 0.0, "norm_dtype": torch.float32}, True),
    "gemma": (gemma_rms_norm, {"offset": 1.0}, True),
    "no_weight": (plain_rms_norm, {}, False),
}


@pytest.fixture
def reference_path():
    """CPU tensors take the plain-torch reference outside ``triton_on_cpu()``: these tests run there."""
    with triton_on_cpu(False):
        yield


def _call_functional(x, weight, eps, kwargs):
    return rms_norm(x, weight, eps, **kwargs)


def _call_op(x, weight, eps, kwargs):
    y, rstd = torch.ops.fuser.rms_norm(
        x, weight, eps, kwargs.get("offset", 0.0), kwargs.get("norm_dtype"), kwargs.get("out_dtype")
    )
    # the op's second output is the per-row statistic backward uses
    rstd64 = torch.rsqrt(fp64(x.detach()).pow(2).mean(-1) + eps)
    assert rstd.dtype == torch.float32 and rstd.shape == x.shape[:-1]
    assert_close("rstd", rstd, rstd64, TOLERANCE[torch.float32])
    return y


def check_op_autograd(call, model, shape, gen, x_grad=True, weight_grad=True):
    """fp32 loss.backward() through fuser vs fp64 autograd of the plain-torch module."""
    module_fn, kwargs, with_weight = MODELS[model]
    eps = 1e-6
    x, weight, _ = make_inputs(shape, torch.float32, gen, with_weight)
    probe = randn(shape, gen)  # a random upstream gradient, so dy is not uniform
    x.requires_grad_(x_grad)
    if weight is not None:
        weight.requires_grad_(weight_grad)
    y = call(x, weight, eps, kwargs)
    (y * probe).sum().backward()

    x64, w64 = fp64(x).requires_grad_(x_grad), fp64(weight)
    if w64 is not None:
        w64.requires_grad_(weight_grad)
    y64 = module_fn(x64, w64, eps)
    (y64 * fp64(probe)).sum().backward()

    tol = TOLERANCE[torch.float32]
    assert_close("y", y, y64, tol)
    if x_grad:
        assert_close("x.grad", x.grad, x64.grad, tol)
    else:
        assert x.grad is None
    if weight is not None:
        if weight_grad:
            assert_close("weight.grad", weight.grad, w64.grad, tol)
        else:
            assert weight.grad is None


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("call", [_call_functional, _call_op], ids=["functional", "torch_ops"])
def test_op_autograd_matches_fp64_module(call, model, gen, reference_path):
    check_op_autograd(call, model, (3, 7, 65), gen)


@pytest.mark.parametrize("model", ["llama", "gemma"])
def test_op_skips_dweight_when_weight_is_frozen(model, gen, reference_path, monkeypatch):
    calls = []

    def spy(dy, x, norm, compute_dweight, *args, **kwargs):
        calls.append(compute_dweight)
        return rms_norm_backward(dy, x, norm, compute_dweight, *args, **kwargs)

    monkeypatch.setattr(rms_norm_module, "rms_norm_backward", spy)
    check_op_autograd(_call_functional, model, (5, 300), gen, weight_grad=False)
    assert calls == [False], f"the backward was asked for dweight: compute_dweight={calls}"


@pytest.mark.parametrize("model", ["llama", "gemma"])
def test_op_without_x_grad(model, gen, reference_path):
    check_op_autograd(_call_functional, model, (5, 300), gen, x_grad=False)


def test_op_zero_rows(gen, reference_path):
    x, weight, _ = make_inputs((0, 4, 65), torch.float32, gen, True)
    x.requires_grad_()
    weight.requires_grad_()
    rms_norm(x, weight).sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_op_rejects_a_weight_of_the_wrong_size():
    with pytest.raises(ValueError, match="1-D weight of size 64"):
        rms_norm(torch.randn(2, 64), torch.randn(32))


def _opcheck_args(gen):
    x, w, _ = make_inputs((3, 5, 65), torch.float32, gen, True)
    xh, wh, _ = make_inputs((4, 17), torch.float16, gen, True)
    return [
        (x.requires_grad_(), w.requires_grad_(), 1e-6, 0.0, None, None),
        (xh.requires_grad_(), wh, 1e-5, 1.0, torch.float16, torch.float32),
        (x.detach().transpose(0, 1).requires_grad_(), None, 1e-6, 0.0, None, None),
    ]


@pytest.mark.parametrize("case", [0, 1, 2], ids=["fp32_weight", "fp16_gemma_frozen_weight", "no_weight_strided"])
def test_opcheck_rms_norm(case, gen, reference_path):
    torch.library.opcheck(torch.ops.fuser.rms_norm.default, _opcheck_args(gen)[case])


@pytest.mark.parametrize("compute_dweight", [True, False])
def test_opcheck_rms_norm_backward(compute_dweight, gen, reference_path):
    x, w, dy = make_inputs((3, 5, 65), torch.float32, gen, True)
    rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-6)
    torch.library.opcheck(torch.ops.fuser.rms_norm_backward.default, (dy, x, w, rstd, 1e-6, 1.0, None, compute_dweight))


# ---------------------------------------------------------------------------------------------------------
# The custom op forced through Triton on CPU (the interpreter)
# ---------------------------------------------------------------------------------------------------------


@interpreter
@pytest.mark.parametrize("model", list(MODELS))
def test_op_through_triton_on_cpu(model, gen, monkeypatch, triton_on_cpu):
    triton_on_cpu()
    launched = []

    for name in ("_launch_forward", "_launch_backward"):
        real = getattr(rms_norm_module, name)
        monkeypatch.setattr(
            rms_norm_module, name, lambda *a, _real=real, _name=name: launched.append(_name) or _real(*a)
        )
    check_op_autograd(_call_functional, model, (2, 9, 65), gen)
    # a silent fall-back to the reference path must not pass
    assert launched == ["_launch_forward", "_launch_backward"]


@pytest.mark.parametrize("path", ["reference", pytest.param("triton", marks=interpreter)])
@pytest.mark.parametrize("dy_layout", ["as_x", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_op_keeps_a_per_head_views_layout(path, dy_layout, dtype, gen, triton_on_cpu, monkeypatch):
    """A q/k norm's input, ``[B, H, T, D]`` viewed from ``[B, T, H, D]`` storage: y, rstd and dx come back in that
    layout (as eager's elementwise norm keeps it), with no copy of x on the Triton path, and the values of the
    same norm of the contiguous tensor; a dy in another layout (copied into x's row order) gives the same dx."""
    triton_on_cpu(path == "triton")
    copied = []
    real_as_rows = rms_norm_module.tt.as_rows

    def as_rows(t, order=None):
        rows = real_as_rows(t, order)
        if rows.data_ptr() != t.data_ptr():
            copied.append(tuple(t.shape))
        return rows

    monkeypatch.setattr(rms_norm_module.tt, "as_rows", as_rows)
    b, t, h, d = 2, 7, 3, 40
    x = randn((b, t, h, d), gen, dtype, scale=2.0, shift=0.5).transpose(1, 2)
    weight = randn(d, gen, dtype, scale=0.5, shift=1.0)
    dy = randn((b, t, h, d), gen, dtype).transpose(1, 2)
    if dy_layout == "contiguous":
        dy = dy.contiguous()
    y, rstd = torch.ops.fuser.rms_norm(x, weight, 1e-6, 1.0, None, None)
    assert y.stride() == x.stride() and rstd.stride() == (t * h, 1, h)
    dx, dw = torch.ops.fuser.rms_norm_backward(dy, x, weight, rstd, 1e-6, 1.0, None, True)
    assert dx.stride() == x.stride()
    if path == "triton":  # x and its rstd read in place; only a dy of another layout is copied
        assert copied == ([tuple(dy.shape)] if dy_layout == "contiguous" else [])
    y64 = rms_norm_reference_forward(fp64(x).contiguous(), fp64(weight), 1e-6, 1.0)
    dx64, dw64 = rms_norm_reference_backward(fp64(dy).contiguous(), fp64(x).contiguous(), fp64(weight), 1e-6, 1.0)
    tol = TOLERANCE[dtype]
    assert_close("y", y, y64, tol)
    assert_close("rstd", rstd, torch.rsqrt(fp64(x).pow(2).mean(-1) + 1e-6), TOLERANCE[torch.float32])
    assert_close("dx", dx, dx64, tol)
    assert_close("dweight", dw, dw64, tol)


def test_opcheck_per_head_view(gen, reference_path):
    """The fake kernels promise the layouts the op returns for a per-head view (opcheck compares them)."""
    x = randn((2, 5, 3, 16), gen).transpose(1, 2)
    w = randn(16, gen)
    torch.library.opcheck(torch.ops.fuser.rms_norm.default, (x.requires_grad_(), w, 1e-6, 0.0, None, None))
    x = x.detach()
    rstd = torch.ops.fuser.rms_norm(x, w, 1e-6, 0.0, None, None)[1]
    dy = randn((2, 5, 3, 16), gen).transpose(1, 2)
    torch.library.opcheck(torch.ops.fuser.rms_norm_backward.default, (dy, x, w, rstd, 1e-6, 0.0, None, True))


# ---------------------------------------------------------------------------------------------------------
# GPU: real shapes, all three dtypes
# ---------------------------------------------------------------------------------------------------------

GPU_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GPU_HIDDEN = [2048, 4096, 8192, 5121]
GPU_ROWS = 4096


@pytest.mark.gpu
@pytest.mark.parametrize(
    "offset, norm_cast", [pytest.param(0.0, True, id="llama"), pytest.param(1.0, False, id="gemma")]
)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("hidden", GPU_HIDDEN)
def test_gpu_matches_fp64_reference(hidden, dtype, offset, norm_cast, gen):
    x, weight, dy = make_inputs((GPU_ROWS, hidden), dtype, gen, True, device="cuda")
    check_against_fp64_reference(x, weight, dy, 1e-6, offset, dtype if norm_cast else None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_no_weight_and_strided(dtype, gen):
    base = randn((GPU_ROWS, 4096 + 64), gen, dtype, "cuda", scale=2.0)
    x = base[:, 32 : 32 + 4096]
    dy = randn((4096, GPU_ROWS), gen, dtype, "cuda").t()
    check_against_fp64_reference(x, None, dy, 1e-6, 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [4096, 5121])
def test_gpu_backward_is_deterministic(hidden, dtype, gen):
    x, weight, dy = make_inputs((GPU_ROWS, hidden), dtype, gen, True, device="cuda")
    dx1, dw1 = rms_norm_backward_triton(dy, x, weight, 1e-6, 0.0, dtype)
    dx2, dw2 = rms_norm_backward_triton(dy, x, weight, 1e-6, 0.0, dtype)
    assert torch.equal(dw1, dw2), "dweight differs between two identical backward runs"
    assert torch.equal(dx1, dx2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("model", list(MODELS))
def test_gpu_op_autograd(model, dtype, gen):
    module_fn, kwargs, with_weight = MODELS[model]
    if kwargs.get("norm_dtype") is not None:
        kwargs = {**kwargs, "norm_dtype": dtype}
    x, weight, dy = make_inputs((2, 1024, 4096), dtype, gen, with_weight, device="cuda")
    x.requires_grad_()
    if weight is not None:
        weight.requires_grad_()
    y = rms_norm(x, weight, 1e-6, **kwargs)
    y.backward(dy)
    y_ref = rms_norm_reference_forward(
        fp64(x), fp64(weight), 1e-6, kwargs.get("offset", 0.0), kwargs.get("norm_dtype"), torch.float64
    )
    dx_ref, dw_ref = rms_norm_reference_backward(
        fp64(dy), fp64(x), fp64(weight), 1e-6, kwargs.get("offset", 0.0), kwargs.get("norm_dtype")
    )
    tol = TOLERANCE[dtype]
    assert_close("y", y, y_ref, tol)
    assert_close("x.grad", x.grad, dx_ref, tol, scale=dx_scale(dy, x, weight, 1e-6, kwargs.get("offset", 0.0)))
    if weight is not None:
        assert_close("weight.grad", weight.grad, dw_ref, tol)


# ---------------------------------------------------------------------------------------------------------
# add_rms_norm with a residual of x's dtype (full fine-tuning's residual adds): one gradient, written once
# ---------------------------------------------------------------------------------------------------------


def _add_norm_inputs(shape, dtype, gen, device="cpu"):
    """x, residual (both ``dtype``), weight, and the upstream gradients dy (of y) and dh (of the rounded sum)."""
    x, weight, dy = make_inputs(shape, dtype, gen, True, device)
    residual = randn(shape, gen, dtype, device, scale=0.5)
    dh = randn(shape, gen, dtype, device)
    return x, residual, weight, dy, dh


def _add_norm_dx64(dy, dh, h, weight, rstd, eps=1e-6, offset=0.0):
    """fp64 reference of add_rms_norm's input gradient: the norm's backward at the saved (rounded) sum and rstd, plus
    the sum's own gradient ``dh`` (None: none)."""
    norm = Norm(fp64(weight), eps, offset)
    rstd64 = None if rstd is None else fp64(rstd)
    dx, _ = rms_norm_backward(fp64(dy), fp64(h), norm, False, rstd=rstd64, impl="reference")
    return dx if dh is None else dx + fp64(dh)


@pytest.mark.parametrize("with_dh", [True, False], ids=["dh", "no_dh"])
@pytest.mark.parametrize(
    "dtype, path",
    [
        (torch.float32, "reference"),
        (torch.float16, "reference"),
        (torch.bfloat16, "reference"),
        pytest.param(torch.float32, "triton", marks=interpreter),
        pytest.param(torch.float16, "triton", marks=interpreter),
    ],
    ids=["fp32", "fp16", "bf16", "fp32_triton_interpreter", "fp16_triton_interpreter"],
)
def test_add_rms_norm_backward_of_one_dtype_returns_no_second_gradient(dtype, path, with_dh, gen, triton_on_cpu):
    """residual_dtype == h's dtype: dres is empty (nothing written twice), dx is the fp64 reference (the norm's
    input gradient plus dh, summed in fp32 and rounded once: within the dtype's tolerance), and it is bit for bit
    the dx of the two-store path (residual in fp32), which computes the same fp32 value. On the reference path and
    through the Triton kernels (the interpreter: fp32 and fp16, its bf16 is not trusted)."""
    triton_on_cpu(path == "triton")
    x, residual, weight, dy, dh = _add_norm_inputs((3, 7, 65), dtype, gen)
    dh = dh if with_dh else None
    _, rstd, h = torch.ops.fuser.add_rms_norm(x, residual, weight, 1e-6, 0.0, None, None)
    dx, dres, dw = torch.ops.fuser.add_rms_norm_backward(dy, dh, h, weight, rstd, 1e-6, 0.0, None, True, dtype)
    assert dres.numel() == 0 and dres.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    scale = dx_scale(dy, h, weight, 1e-6, 0.0)
    assert_close("dx", dx, _add_norm_dx64(dy, dh, h, weight, rstd), TOLERANCE[dtype], scale=scale)
    dx2, dres2, dw2 = torch.ops.fuser.add_rms_norm_backward(
        dy, dh, h, weight, rstd, 1e-6, 0.0, None, True, torch.float32 if dtype != torch.float32 else torch.float64
    )
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2) and dres2.shape == h.shape


@pytest.mark.parametrize(
    "path", ["reference", pytest.param("triton", marks=interpreter)], ids=["reference", "triton_interpreter"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_backward_with_dres_and_no_second_store(path, dtype, gen):
    """The entry add_rms_norm_backward calls when the residual has h's dtype: dres added to dx, no ``dx2_out``.
    dx is NaN-poisoned before the kernel runs (the interpreter: fp32 and fp16 only, its bf16 is not trusted)."""
    x, _, weight, dy, dh = _add_norm_inputs((2, 97, 65), dtype, gen)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
    dx, dw = rms_norm_backward(
        dy, x, Norm(weight, 1e-6), True, dtype, rstd=rstd, dres=dh, impl=path, dx_out=poisoned(x.shape, dtype)
    )
    scale = dx_scale(dy, x, weight, 1e-6, 0.0)
    assert_close("dx", dx, _add_norm_dx64(dy, dh, x, weight, rstd), TOLERANCE[dtype], scale=scale)
    _, dw_ref = rms_norm_reference_backward(fp64(dy), fp64(x), fp64(weight), 1e-6, rstd=fp64(rstd))
    assert_close("dweight", dw, dw_ref, TOLERANCE[dtype])


def _add_norm_autograd(x, residual, weight, probe_y, probe_h, use_y=True):
    y, rstd, h = torch.ops.fuser.add_rms_norm(x, residual, weight, 1e-6, 0.0, None, None)
    assert rstd.dtype == torch.float32 and h.dtype == x.dtype
    loss = (h.double() * probe_h).sum()
    if use_y:
        loss = loss + (y.double() * probe_y).sum()
    loss.backward()
    return y, h


@pytest.mark.parametrize("use_y", [True, False], ids=["y_and_h", "h_only"])
@pytest.mark.parametrize(
    "dtype, device",
    [
        (torch.float32, "cpu"),
        (torch.bfloat16, "cpu"),
        pytest.param(torch.bfloat16, "cuda", marks=pytest.mark.gpu),
        pytest.param(torch.float16, "cuda", marks=pytest.mark.gpu),
    ],
    ids=["fp32", "bf16", "bf16_cuda", "fp16_cuda"],
)
def test_add_rms_norm_autograd_of_one_dtype_matches_fp64(dtype, device, use_y, gen):
    """Gradients through add_rms_norm's autograd, x and residual of one dtype, against fp64 autograd of the add and
    Llama's norm: both inputs get one gradient (dx handed to both), the weight its own. The fp64 reference is
    evaluated at the inputs' exact values; the tolerance is the dtype's (TOLERANCE), the op rounding the sum, the
    gradient and the output once each."""
    shape = (2, 33, 300) if device == "cpu" else (4, 1024, 2048)
    x, residual, weight, _, _ = _add_norm_inputs(shape, dtype, gen, device)
    probe_y, probe_h = randn(shape, gen, device=device).double(), randn(shape, gen, device=device).double()
    x.requires_grad_()
    residual.requires_grad_()
    weight.requires_grad_()
    y, h = _add_norm_autograd(x, residual, weight, probe_y, probe_h, use_y)

    x64, r64, w64 = (fp64(t).requires_grad_() for t in (x, residual, weight))
    h64 = x64 + r64
    y64 = w64 * (h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-6))
    loss64 = (h64 * probe_h).sum() + ((y64 * probe_y).sum() if use_y else 0)
    loss64.backward()

    tol = TOLERANCE[dtype]
    assert_close("h", h, h64, tol)
    assert torch.equal(x.grad, residual.grad), "x and the residual take one gradient"
    assert x.grad.dtype == residual.grad.dtype == dtype
    # the norm's part of dx is measured against ‖rstd·g‖ as everywhere here; dh adds a term of its own size
    scale = dx_scale(probe_y, h64, weight, 1e-6, 0.0) + probe_h.norm() if use_y else None
    assert_close("x.grad", x.grad, x64.grad, tol, scale=scale)
    assert_close("residual.grad", residual.grad, r64.grad, tol, scale=scale)
    if use_y:
        assert_close("y", y, y64, tol)
        assert_close("weight.grad", weight.grad, w64.grad, tol)
    else:
        assert weight.grad is None


def test_add_rms_norm_only_one_input_needs_a_gradient(gen, reference_path):
    x, residual, weight, _, _ = _add_norm_inputs((5, 65), torch.float32, gen)
    residual.requires_grad_()
    y, _, h = torch.ops.fuser.add_rms_norm(x, residual, weight, 1e-6, 0.0, None, None)
    (y.sum() + h.sum()).backward()
    assert x.grad is None and residual.grad is not None and torch.isfinite(residual.grad).all()


@pytest.mark.parametrize("residual_dtype", [torch.float16, torch.float32], ids=["same_dtype", "fp32_residual"])
def test_opcheck_add_rms_norm_backward(residual_dtype, gen, reference_path):
    """The fake function returns what the op returns: an empty dres where the residual has h's dtype."""
    _, _, weight, dy, dh = _add_norm_inputs((3, 5, 65), torch.float16, gen)
    h = randn((3, 5, 65), gen, torch.float16, scale=2.0)
    rstd = torch.rsqrt(h.float().pow(2).mean(-1) + 1e-6)
    args = (dy, dh, h, weight, rstd, 1e-6, 0.0, None, True, residual_dtype)
    torch.library.opcheck(torch.ops.fuser.add_rms_norm_backward.default, args)


def test_opcheck_add_rms_norm_of_one_dtype(gen, reference_path):
    x, residual, weight, _, _ = _add_norm_inputs((3, 5, 65), torch.float32, gen)
    args = (x.requires_grad_(), residual.requires_grad_(), weight.requires_grad_(), 1e-6, 0.0, None, None)
    torch.library.opcheck(torch.ops.fuser.add_rms_norm.default, args)


# ---------------------------------------------------------------------------------------------------------
# add_rms_norm with an fp32 x and a half-precision residual: autocast's bf16 projection added into the fp32 stream
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "residual_dtype, path, device",
    [
        (torch.bfloat16, "reference", "cpu"),
        (torch.float16, "reference", "cpu"),
        pytest.param(torch.float16, "triton", "cpu", marks=interpreter),
        pytest.param(torch.bfloat16, "triton", "cuda", marks=pytest.mark.gpu),
    ],
    ids=["bf16", "fp16", "fp16_triton_interpreter", "bf16_cuda"],
)
def test_add_rms_norm_of_an_fp32_stream_and_a_half_residual(residual_dtype, path, device, gen, triton_on_cpu):
    """h is eager's fp32 sum ``x + residual.float()`` bit for bit; y and every gradient match fp64 autograd of the add
    and Llama's norm within fp32's tolerance; the residual's gradient is x's (fp32) rounded once to the residual's
    dtype, as autograd's add with type promotion hands it back. The interpreter runs fp16 only (its bf16 is not
    trusted); the GPU runs bf16."""
    triton_on_cpu(path == "triton" and device == "cpu")
    shape = (3, 7, 65) if device == "cpu" else (4, 1024, 2048)
    x, weight, _ = make_inputs(shape, torch.float32, gen, True, device)
    residual = randn(shape, gen, residual_dtype, device, scale=0.5)
    probe_y, probe_h = randn(shape, gen, device=device).double(), randn(shape, gen, device=device).double()
    for t in (x, residual, weight):
        t.requires_grad_()
    y, h = _add_norm_autograd(x, residual, weight, probe_y, probe_h)
    assert torch.equal(h, x.detach() + residual.detach().float())
    assert x.grad.dtype == torch.float32 and residual.grad.dtype == residual_dtype
    assert torch.equal(residual.grad, x.grad.to(residual_dtype)), "the residual's gradient is x's, rounded once"

    x64, r64, w64 = (fp64(t).requires_grad_() for t in (x, residual, weight))
    h64 = x64 + r64
    y64 = w64 * (h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-6))
    ((h64 * probe_h).sum() + (y64 * probe_y).sum()).backward()
    tol = TOLERANCE[torch.float32]
    scale = dx_scale(probe_y, h64, weight, 1e-6, 0.0) + probe_h.norm()
    assert_close("y", y, y64, tol)
    assert_close("x.grad", x.grad, x64.grad, tol, scale=scale)
    assert_close("residual.grad", residual.grad.double(), r64.grad, TOLERANCE[residual_dtype], scale=scale)
    assert_close("weight.grad", weight.grad, w64.grad, tol)


def test_opcheck_add_rms_norm_of_an_fp32_stream_and_a_half_residual(gen, reference_path):
    x, weight, _ = make_inputs((3, 5, 65), torch.float32, gen, True)
    residual = randn((3, 5, 65), gen, torch.bfloat16)
    args = (x.requires_grad_(), residual.requires_grad_(), weight.requires_grad_(), 1e-6, 0.0, None, None)
    torch.library.opcheck(torch.ops.fuser.add_rms_norm.default, args)


@pytest.mark.parametrize("x_dtype, residual_dtype", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)])
def test_add_rms_norm_refuses_a_residual_its_sum_would_round(x_dtype, residual_dtype, gen, reference_path):
    """A residual of another half-precision dtype than x's: x's dtype cannot hold their sum as eager computes it
    (PyTorch promotes bf16 + fp16 to fp32), so the op refuses it and says what it takes."""
    x, weight, _ = make_inputs((2, 65), x_dtype, gen, True)
    with pytest.raises(ValueError, match="in x's dtype .*, fp32 or a narrower float dtype"):
        torch.ops.fuser.add_rms_norm(x, randn((2, 65), gen, residual_dtype), weight, 1e-6, 0.0, None, None)


# ---------------------------------------------------------------------------------------------------------
# The output gradient as a sum of terms (experimental.rms_norm.gradient_sums): dy + dy2 (+ dy3, dy4), summed in
# the kernel
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_terms", [2, 3, 4])
@pytest.mark.parametrize(
    "dtype, path, device",
    [
        (torch.float32, "reference", "cpu"),
        (torch.bfloat16, "reference", "cpu"),
        pytest.param(torch.float32, "triton", "cpu", marks=interpreter),
        pytest.param(torch.float16, "triton", "cpu", marks=interpreter),
        pytest.param(torch.bfloat16, "triton", "cuda", marks=pytest.mark.gpu),
    ],
    ids=["fp32", "bf16", "fp32_triton_interpreter", "fp16_triton_interpreter", "bf16_cuda"],
)
def test_backward_of_a_sum_of_terms_matches_fp64_of_the_exact_sum(n_terms, dtype, path, device, gen, triton_on_cpu):
    """dx and dweight of the norm whose output gradient is dy + dy2 (+ dy3, dy4): within the dtype's tolerance of
    fp64's at the exact sum (the terms summed in fp32, never rounded to their dtype), into NaN-filled outputs; strided
    terms (a view of every other row) and a saved rstd. In fp32 it is bit for bit the backward of the sum added in
    fp32 first, left to right, as Inductor's add kernel computes it."""
    triton_on_cpu(path == "triton" and device == "cpu")
    shape = (3, 37, 65) if device == "cpu" else (8, 1024, 2048)
    x, weight, dy = make_inputs(shape, dtype, gen, True, device)
    more = [randn((shape[0], 2 * shape[1], shape[2]), gen, dtype, device)[:, ::2] for _ in range(n_terms - 1)]
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)
    dx, dw = rms_norm_backward(
        dy, x, Norm(weight, 1e-6), True, rstd=rstd, impl=path, dx_out=poisoned(shape, dtype, device), dy_more=more
    )
    total = fp64(dy) + sum(fp64(t) for t in more)
    dx_ref, dw_ref = rms_norm_reference_backward(total, fp64(x), fp64(weight), 1e-6, rstd=fp64(rstd))
    assert_close("dx", dx, dx_ref, TOLERANCE[dtype], scale=dx_scale(total, x, weight, 1e-6, 0.0))
    assert_close("dweight", dw, dw_ref, TOLERANCE[dtype])
    if dtype == torch.float32:
        summed = dy.clone()
        for t in more:
            summed = summed + t
        dx1, dw1 = rms_norm_backward(summed, x, Norm(weight, 1e-6), True, rstd=rstd, impl=path)
        assert torch.equal(dx, dx1) and torch.equal(dw, dw1)


def test_ops_take_the_terms_and_their_fakes_check_them(gen, reference_path):
    """The two backward ops with dy2 to dy4: the terms' sum's gradients (reference path, fp32, bit for bit against
    the op given the sum); opcheck; a term of another shape or dtype, or dy3 without dy2, is refused with a message."""
    x, residual, weight, dy, dh = _add_norm_inputs((3, 5, 65), torch.float32, gen)
    dy2, dy3, dy4 = randn(x.shape, gen), randn(x.shape, gen), randn(x.shape, gen)
    rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-6)
    got = torch.ops.fuser.rms_norm_backward(dy, x, weight, rstd, 1e-6, 0.0, None, True, None, dy2, dy3, dy4)
    want = torch.ops.fuser.rms_norm_backward(dy + dy2 + dy3 + dy4, x, weight, rstd, 1e-6, 0.0, None, True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    args = (dy, dh, x, weight, rstd, 1e-6, 0.0, None, True, torch.float32)
    got = torch.ops.fuser.add_rms_norm_backward(*args, dy2=dy2)
    want = torch.ops.fuser.add_rms_norm_backward(dy + dy2, *args[1:])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    torch.library.opcheck(torch.ops.fuser.rms_norm_backward.default, (dy, x, weight, rstd, 1e-6, 0.0, None, True),
                          {"dy2": dy2, "dy3": dy3, "dy4": dy4})  # fmt: skip
    torch.library.opcheck(torch.ops.fuser.add_rms_norm_backward.default, args, {"dy2": dy2})
    with pytest.raises(ValueError, match="at most three more output-gradient terms of dy's dtype"):
        torch.ops.fuser.rms_norm_backward(dy, x, weight, rstd, 1e-6, 0.0, None, True, None, dy2[..., :64])
    with pytest.raises(ValueError, match="at most three more output-gradient terms of dy's dtype"):
        torch.ops.fuser.rms_norm_backward(dy, x, weight, rstd, 1e-6, 0.0, None, True, None, dy2.double())
    with pytest.raises(ValueError, match="dy3 only with dy2"):
        torch.ops.fuser.rms_norm_backward(dy, x, weight, rstd, 1e-6, 0.0, None, True, None, None, dy3)
    with pytest.raises(ValueError, match="dy4 only with dy3"):
        torch.ops.fuser.rms_norm_backward(dy, x, weight, rstd, 1e-6, 0.0, None, True, None, dy2, None, dy4)
