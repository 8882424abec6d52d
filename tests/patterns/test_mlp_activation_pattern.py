"""Tier 1: the un-gated MLP activation pattern on toy graphs — each activation and bias form fuses once (the bias
add joins the op) and equals eager, forward and every gradient; activations read by anything but a projection, and
other constants, do not match and say why."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fuser

H, INTER = 16, 63  # hidden, intermediate (not a power of two)
STRICT = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")


def gelu_new(h):  # GPT-2, Phi: NewGELUActivation as transformers writes it
    return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))


# activation → (the op's activation, eager function)
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "gelu_new": gelu_new,
    "quick_gelu": lambda h: h * torch.sigmoid(1.702 * h),
    "relu": F.relu,
    "relu2": lambda h: torch.square(F.relu(h)),
    "silu": F.silu,
}


def linear_bias(act):  # GPT-NeoX, OPT, Phi, StarCoder2: nn.Linear with a bias
    return lambda x, w1, b1, w2, b2: F.linear(act(F.linear(x, w1, b1)), w2, b2)


def bias_by_hand(act):  # Falcon's FalconLinear: x @ W.T + b
    return lambda x, w1, b1, w2, b2: act(x @ w1.T + b1) @ w2.T


def conv1d(act):  # GPT-2's Conv1D: addmm(b, x.view(-1, d), W), the bias inside the addmm
    def fn(x, w1, b1, w2, b2):
        h = torch.addmm(b1, x.view(-1, H), w1.T).view(*x.shape[:-1], INTER)
        return torch.addmm(b2, act(h).view(-1, INTER), w2.T).view(*x.shape[:-1], H)

    return fn


FORMS = {"linear_bias": linear_bias, "bias_by_hand": bias_by_hand, "conv1d": conv1d}


def _inputs(dtype=torch.float32, requires_grad=True):
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(2, 5, H, generator=g),
        torch.randn(INTER, H, generator=g) / 4,
        torch.randn(INTER, generator=g) / 2,
        torch.randn(H, INTER, generator=g) / 8,
        torch.randn(H, generator=g) / 2,
    ]
    return [t.to(dtype).requires_grad_(requires_grad) for t in tensors]


def _assert_equals_eager(fn, dtype=torch.float32, tol=1e-5):
    inputs = _inputs(dtype)
    ref_inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = torch.compile(fn, backend=fuser.backend(STRICT))(*inputs)
    assert fuser.backend(STRICT).counts.get("mlp_activation") == 1, fuser.backend(STRICT).counts
    ref = fn(*ref_inputs)
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    dy = torch.randn_like(ref)
    out.backward(dy)
    ref.backward(dy)
    for name, t, r in zip(("x", "w1", "b1", "w2", "b2"), inputs, ref_inputs, strict=True):
        if r.grad is None:  # the form does not use it (Falcon's second projection has no bias)
            assert t.grad is None, name
            continue
        torch.testing.assert_close(t.grad.float(), r.grad.float(), rtol=2 * tol, atol=2 * tol, msg=name)


# every activation in nn.Linear's form; the other two forms with the activations their models use
CASES = [(a, "linear_bias") for a in ACTIVATIONS] + [
    ("gelu", "bias_by_hand"),  # Falcon
    ("relu2", "bias_by_hand"),
    ("gelu_new", "conv1d"),  # GPT-2
    ("quick_gelu", "conv1d"),
]


@pytest.mark.parametrize("activation, form", CASES)
def test_activation_fuses_once_and_equals_eager(activation, form):
    fn = FORMS[form](ACTIVATIONS[activation])
    report = fuser.explain(fn, *_inputs(requires_grad=False))
    assert report.counts.get("mlp_activation") == 1, str(report)
    (match,) = [m for m in report.matches if m.pattern == "mlp_activation"]
    # the bias joins the op where the first projection is a linear with a bias or a bias added by hand
    assert (match.replacement.args[1] is not None) == (form != "conv1d"), str(report)
    _assert_equals_eager(fn)


@pytest.mark.parametrize("activation", ["gelu", "gelu_new", "relu2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_equals_eager(activation, dtype):
    # eager rounds the linear, the bias add and each op of the activation; fuser once: a few ulps apart
    _assert_equals_eager(
        linear_bias(ACTIVATIONS[activation]), dtype, {torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    )


# --- near-misses ----------------------------------------------------------------------------------------------


def gelu_then_norm(x, w1, b1, w2, b2):  # BERT's head transform: dense → gelu → LayerNorm, no second projection
    return F.layer_norm(F.gelu(F.linear(x, w1, b1)), (INTER,))


def relu_cubed(x, w1, b1, w2, b2):
    return F.linear(F.relu(F.linear(x, w1, b1)) ** 3, w2)


def scaled_sigmoid(x, w1, b1, w2, b2):
    h = F.linear(x, w1, b1)
    return F.linear(h * torch.sigmoid(1.5 * h), w2)


def other_tanh_constant(x, w1, b1, w2, b2):
    h = F.linear(x, w1, b1)
    return F.linear(0.5 * h * (1.0 + torch.tanh(0.8 * (h + 0.044715 * torch.pow(h, 3.0)))), w2)


def relu_scores_weighted(x, w1, b1, w2, b2):  # a sparse-attention indexer: weights @ relu(q @ kᵀ), no MLP
    scores = F.linear(x, w1, b1)  # [2, 5, INTER]
    weights = F.linear(x, w1[:5])  # [2, 5, 5]: computed from the input, not a layer's weight
    return torch.matmul(weights, F.relu(scores))


@pytest.mark.parametrize(
    "fn, reason",
    [
        (gelu_then_norm, "not only by a projection"),
        (relu_scores_weighted, "as the matrix it multiplies by"),
        (relu_cubed, "relu(h) to the power 3"),
        (scaled_sigmoid, "neither QuickGELU (1.702) nor silu (1)"),
        (other_tanh_constant, "the tanh formula has 0.8"),
    ],
    ids=["read_by_norm", "relu_scores_weighted", "relu_cubed", "scaled_sigmoid", "tanh_constant"],
)
def test_near_miss_declines_and_says_why(fn, reason):
    report = fuser.explain(fn, *_inputs(requires_grad=False))
    assert "mlp_activation" not in report.counts, str(report)
    assert any(reason in nm.reason for nm in report.near_misses), str(report)
    inputs = _inputs(requires_grad=False)
    out = torch.compile(fn, backend=fuser.backend(STRICT))(*inputs)
    torch.testing.assert_close(out, fn(*inputs), rtol=1e-5, atol=1e-5)


def test_gated_relu_is_not_an_unfused_mlp_activation():
    """``relu(gate) * up``: the activation feeds a product, not a projection; no un-gated match is made of it."""

    def reglu(x, w1, b1, w2, b2):
        return F.linear(F.relu(F.linear(x, w1)) * F.linear(x, w1 * 0.5), w2)

    report = fuser.explain(reglu, *_inputs(requires_grad=False))
    assert "mlp_activation" not in report.counts, str(report)
