"""Kernel tests for the un-gated MLP's activation (``src/fuser/kernels/bias_activation.py``): Triton launchers,
reference, custom op.

Oracle: the reference formulas on fp64 copies; the hand-written reference backward is checked against fp64
autograd of the activations as torch and the models write them. Error measure ``‖a − b‖ / ‖b‖`` in fp64; fp32 ≤
1e-5, fp16 ≤ 2e-3, bf16 ≤ 1e-2 (the interpreter's bf16 stores truncate). Outputs are poisoned with NaN first.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from fuser.kernels._triton import HAS_TRITON, interpreting
from fuser.kernels.bias_activation import bias_activation, bias_activation_backward, bias_activation_forward

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

interpreter = pytest.mark.skipif(
    not (HAS_TRITON and interpreting()), reason="needs Triton with TRITON_INTERPRET=1 (set by conftest without a GPU)"
)


def gelu_new(h):  # GPT-2's NewGELUActivation, as written there
    return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))


# the op's activation → the eager function it replaces
EAGER = {
    "gelu": F.gelu,
    "gelu_tanh": gelu_new,
    "gelu_quick": lambda h: h * torch.sigmoid(1.702 * h),
    "relu": F.relu,
    "relu2": lambda h: torch.square(F.relu(h)),
    "silu": F.silu,
}
ACTIVATIONS = list(EAGER)


@pytest.fixture
def gen(request) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def randn(shape, gen, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def fp64(t):
    return None if t is None else t.detach().to(torch.float64)


def assert_close(name, actual, expected, tol) -> None:
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    bad = ~torch.isfinite(actual)
    assert not bad.any(), f"{name}: {int(bad.sum())} of {actual.numel()} elements are NaN/inf (never written?)"
    diff, denom = (actual.double() - expected.double()).norm(), expected.double().norm()
    err = (diff / denom).item() if denom > 0 else diff.item()
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_is_the_eager_activation_and_its_autograd(activation, gen):
    x, bias, dy = randn((13, 63), gen, torch.float64, 2.0), randn(63, gen, torch.float64), randn((13, 63), gen)
    x.requires_grad_()
    bias.requires_grad_()
    ref = EAGER[activation](x + bias)
    ref.backward(fp64(dy))
    y = bias_activation_forward(x.detach(), bias.detach(), activation, impl="reference")
    dx, db = bias_activation_backward(fp64(dy), x.detach(), bias.detach(), activation, impl="reference")
    assert_close("y", y, ref.detach(), 1e-12)
    assert_close("dx", dx, x.grad, 1e-12)
    assert_close("dbias", db, bias.grad, 1e-12)


@interpreter
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_triton_matches_fp64_reference(activation, dtype, with_bias, gen):
    # 63 and 1100 columns: ragged column blocks; 300 rows: several row tiles per backward program (the wide shape in
    # one dtype: the column blocks do not depend on it)
    for shape in ((300, 63), (2, 5, 1100))[: 2 if dtype == torch.float32 else 1]:
        x, dy = randn(shape, gen, dtype, 2.0), randn(shape, gen, dtype)
        bias = randn(shape[-1], gen, dtype) if with_bias else None
        y = bias_activation_forward(x, bias, activation, impl="triton", out=torch.full(shape, math.nan, dtype=dtype))
        dx, db = bias_activation_backward(
            dy, x, bias, activation, impl="triton", dx_out=torch.full(shape, math.nan, dtype=dtype)
        )
        y_ref = bias_activation_forward(fp64(x), fp64(bias), activation, impl="reference")
        dx_ref, db_ref = bias_activation_backward(fp64(dy), fp64(x), fp64(bias), activation, impl="reference")
        assert y.dtype == dx.dtype == dtype
        assert_close("y", y, y_ref, TOLERANCE[dtype])
        assert_close("dx", dx, dx_ref, TOLERANCE[dtype])
        if with_bias:
            assert_close("dbias", db, db_ref, TOLERANCE[torch.float32])  # an fp32 sum
        else:
            assert db is None


@interpreter
def test_triton_bf16_load_store(gen):
    x, bias, dy = randn((24, 63), gen, torch.bfloat16, 2.0), randn(63, gen, torch.bfloat16), randn((24, 63), gen)
    dy = dy.bfloat16()
    y = bias_activation_forward(x, bias, "gelu", impl="triton")
    dx, db = bias_activation_backward(dy, x, bias, "gelu", impl="triton")
    assert_close("y", y, bias_activation_forward(fp64(x), fp64(bias), "gelu", impl="reference"), 1e-2)
    dx_ref, db_ref = bias_activation_backward(fp64(dy), fp64(x), fp64(bias), "gelu", impl="reference")
    assert_close("dx", dx, dx_ref, 1e-2)
    assert_close("dbias", db, db_ref, 1e-5)


@interpreter
@pytest.mark.parametrize("activation", ["gelu_tanh", "relu"])
def test_op_autograd_on_triton(activation, gen, triton_on_cpu):
    """``fuser.bias_activation`` through the custom op and its kernels: an fp16 pre-activation with an fp32 bias (an
    autocast linear's output and its fp32 parameter), every gradient against fp64 eager."""
    triton_on_cpu()
    x, bias, dy = randn((3, 7, 63), gen, torch.float16, 2.0), randn(63, gen), randn((3, 7, 63), gen, torch.float16)
    x.requires_grad_()
    bias.requires_grad_()
    y = bias_activation(x, bias, activation)
    assert y.dtype == torch.float16
    y.backward(dy)
    x64, b64 = fp64(x).requires_grad_(), fp64(bias).requires_grad_()
    ref = EAGER[activation](x64 + b64)
    ref.backward(fp64(dy))
    assert_close("y", y, ref.detach(), 2e-3)
    assert_close("dx", x.grad, x64.grad, 2e-3)
    assert bias.grad.dtype == torch.float32
    assert_close("dbias", bias.grad, b64.grad, 1e-5)


def test_op_rejects_bad_arguments():
    x = torch.randn(2, 63)
    with pytest.raises(ValueError, match="expects an activation of"):
        bias_activation(x, None, "swish")
    with pytest.raises(ValueError, match="1-D bias of size 63"):
        bias_activation(x, torch.randn(62))
    with pytest.raises(ValueError, match="floating-point x"):
        bias_activation(torch.ones(2, 3, dtype=torch.long))
