"""Kernel tests for the fused LayerNorm (``src/fuser/kernels/layer_norm.py``): Triton launchers, reference, custom op.

Oracle: the reference formulas (``impl="reference"``) on fp64 copies of the inputs; the hand-written reference
backward is itself checked against fp64 autograd of ``F.layer_norm``. Error measure and tolerances as in
``test_rms_norm.py``: ``‖a − b‖ / ‖b‖`` in fp64; fp32 ≤ 1e-5, fp16 ≤ 2e-3, bf16 ≤ 1e-2 (one ulp: the interpreter's
fp32→bf16 stores truncate). dx is measured against ‖rstd·g‖, the size of the terms its formula subtracts. Every
output is poisoned with NaN first, so an element the kernel never writes fails.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from fuser.kernels._triton import HAS_TRITON, interpreting
from fuser.kernels.layer_norm import layer_norm, layer_norm_backward, layer_norm_forward

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
EPS = 1e-5

interpreter = pytest.mark.skipif(
    not (HAS_TRITON and interpreting()), reason="needs Triton with TRITON_INTERPRET=1 (set by conftest without a GPU)"
)

# (weight, bias): nn.LayerNorm; Cohere (weight only); elementwise_affine=False
AFFINE = [
    pytest.param(True, True, id="weight_bias"),
    pytest.param(True, False, id="weight"),
    pytest.param(False, False, id="none"),
]
# 63 and 1000 columns (ragged blocks), per-head 4-D rows, several row tiles per backward program
SHAPES = [(7, 1), (300, 63), (2, 97, 65), (2, 6, 4, 48), (37, 1000)]


@pytest.fixture
def gen(request) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def randn(shape, gen, dtype=torch.float32, scale=1.0, shift=0.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + shift).to(dtype)


def make_inputs(shape, dtype, gen, with_weight, with_bias, param_dtype=None):
    hidden, param_dtype = shape[-1], param_dtype or dtype
    # a mean far from zero and a scale far from 1: neither the centring nor the scaling is trivial
    x = randn(shape, gen, dtype, scale=2.0, shift=3.0)
    weight = randn(hidden, gen, param_dtype, scale=0.5, shift=1.0) if with_weight else None
    bias = randn(hidden, gen, param_dtype, scale=0.5) if with_bias else None
    return x, weight, bias


def fp64(t):
    return None if t is None else t.detach().to(torch.float64)


def poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


def assert_close(name, actual, expected, tol, scale=None) -> None:
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    bad = ~torch.isfinite(actual)
    assert not bad.any(), f"{name}: {int(bad.sum())} of {actual.numel()} elements are NaN/inf (never written?)"
    diff = (actual.double() - expected.double()).norm()
    denom = expected.double().norm() if scale is None else scale
    err = (diff / denom).item() if denom > 0 else diff.item()
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"


def dx_scale(dy, x, weight) -> torch.Tensor:
    x, dy = fp64(x), fp64(dy)
    rstd = torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + EPS)
    return (rstd * (dy if weight is None else dy * fp64(weight))).norm()


def check_triton_against_fp64(x, weight, bias, dy, out_dtype=None) -> None:
    out_dtype = out_dtype or x.dtype
    y, mean, rstd = layer_norm_forward(x, weight, bias, EPS, out_dtype, impl="triton", out=poisoned(x.shape, out_dtype))
    dx, dw, db = layer_norm_backward(
        dy, x, weight, mean, rstd, True, bias is not None, impl="triton", dx_out=poisoned(x.shape, x.dtype)
    )
    y_ref, mean_ref, rstd_ref = layer_norm_forward(fp64(x), fp64(weight), fp64(bias), EPS, impl="reference")
    dx_ref, dw_ref, db_ref = layer_norm_backward(
        fp64(dy), fp64(x), fp64(weight), mean_ref, rstd_ref, True, bias is not None, impl="reference"
    )
    assert y.dtype == out_dtype and dx.dtype == x.dtype
    assert_close("y", y, y_ref, TOLERANCE[out_dtype])
    assert_close("mean", mean, mean_ref, TOLERANCE[torch.float32])
    assert_close("rstd", rstd, rstd_ref, TOLERANCE[torch.float32])
    assert_close("dx", dx, dx_ref, TOLERANCE[x.dtype], scale=dx_scale(dy, x, weight))
    # the parameter gradients are fp32 sums (the op casts them to the parameters' dtypes)
    if weight is None:
        assert dw is None
    else:
        assert_close("dweight", dw, dw_ref, TOLERANCE[torch.float32])
    if bias is None:
        assert db is None
    else:
        assert_close("dbias", db, db_ref, TOLERANCE[torch.float32])


@pytest.mark.parametrize("with_weight, with_bias", AFFINE)
# not one column: there x − mean is 0 and eager's native backward returns its own rounding noise times 1/√eps
@pytest.mark.parametrize("shape", [(4, 2), (13, 63), (2, 3, 4, 30)], ids=str)
def test_reference_backward_is_autograd_of_layer_norm(shape, with_weight, with_bias, gen):
    x, weight, bias = make_inputs(shape, torch.float64, gen, with_weight, with_bias)
    dy = randn(shape, gen, torch.float64)
    for t in (x, weight, bias):
        if t is not None:
            t.requires_grad_()
    F.layer_norm(x, shape[-1:], weight, bias, EPS).backward(dy)
    y, mean, rstd = layer_norm_forward(x.detach(), fp64(weight), fp64(bias), EPS, impl="reference")
    assert_close("y", y, F.layer_norm(x.detach(), shape[-1:], fp64(weight), fp64(bias), EPS), 1e-12)
    dx, dw, db = layer_norm_backward(dy, x.detach(), fp64(weight), mean, rstd, True, True, impl="reference")
    assert_close("dx", dx, x.grad, 1e-10, scale=dx_scale(dy, x, weight))
    assert_close("dbias", db, dy.reshape(-1, shape[-1]).sum(0), 1e-12)
    if weight is not None:
        assert_close("dweight", dw, weight.grad, 1e-12)
    else:
        assert dw is None


@interpreter
@pytest.mark.parametrize("with_weight, with_bias", AFFINE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_matches_fp64_reference(shape, dtype, with_weight, with_bias, gen):
    x, weight, bias = make_inputs(shape, dtype, gen, with_weight, with_bias)
    check_triton_against_fp64(x, weight, bias, randn(shape, gen, dtype))


@interpreter
def test_triton_bf16_load_store(gen):
    """bf16 as the interpreter can be trusted with it: load → fp32 math → store (1 ulp, stores truncate)."""
    x, weight, bias = make_inputs((24, 63), torch.bfloat16, gen, True, True)
    check_triton_against_fp64(x, weight, bias, randn((24, 63), gen, torch.bfloat16))


@interpreter
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32], ids=str)
def test_triton_half_input_fp32_parameters(out_dtype, gen):
    """A half-precision x with fp32 weight and bias: an fp16 result (a bf16 model whose norms stay fp32) or an fp32
    one (under autocast, where eager's layer_norm runs in fp32; dy then arrives in fp32)."""
    x, weight, bias = make_inputs((2, 11, 63), torch.float16, gen, True, True, param_dtype=torch.float32)
    check_triton_against_fp64(x, weight, bias, randn(x.shape, gen, out_dtype), out_dtype)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_op_autograd_on_triton(dtype, gen, triton_on_cpu):
    """``fuser.layer_norm`` with autograd, through the custom op and its Triton kernels, against fp64 eager: every
    gradient, with the parameters in fp32 under a half-precision x."""
    triton_on_cpu()
    x, weight, bias = make_inputs((5, 7, 63), dtype, gen, True, True, param_dtype=torch.float32)
    dy = randn(x.shape, gen, dtype)
    leaves = [t.requires_grad_() for t in (x, weight, bias)]
    y = layer_norm(x, weight, bias, EPS)
    assert y.dtype == dtype
    y.backward(dy)
    ref_leaves = [fp64(t).requires_grad_() for t in leaves]
    ref = F.layer_norm(ref_leaves[0], (63,), ref_leaves[1], ref_leaves[2], EPS)
    ref.backward(fp64(dy))
    tol = TOLERANCE[dtype]
    assert_close("y", y, ref.detach(), tol)
    assert_close("dx", x.grad, ref_leaves[0].grad, tol, scale=dx_scale(dy, x, weight))
    assert weight.grad.dtype == bias.grad.dtype == torch.float32
    assert_close("dweight", weight.grad, ref_leaves[1].grad, max(tol, 1e-5))
    assert_close("dbias", bias.grad, ref_leaves[2].grad, max(tol, 1e-5))


def test_op_rejects_bad_arguments():
    x = torch.randn(2, 63)
    with pytest.raises(ValueError, match="1-D weight of size 63"):
        layer_norm(x, torch.randn(62))
    with pytest.raises(ValueError, match="1-D bias of size 63"):
        layer_norm(x, None, torch.randn(2, 63))
    with pytest.raises(ValueError, match="floating-point x"):
        layer_norm(torch.ones(2, 3, dtype=torch.long))
