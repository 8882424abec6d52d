"""Bad input gets a clear error, the one eager gives where eager gives one; never a silent wrong number, never a NaN
where eager raises on the same device.

- Out-of-range labels of the fused lm_head + cross-entropy: on CPU the op raises what ``F.cross_entropy`` raises
  (``IndexError: Target 256 is out of bounds.``), both CPU paths (reference and Triton through the interpreter),
  through ``torch.ops.fuser.linear_cross_entropy`` and ``fuser.linear_cross_entropy``, and through a tiny Llama
  compiled by ``fuser.optimize``. (On a GPU the op cannot check without a host synchronisation: see the module
  docstring of ``src/fuser/kernels/linear_cross_entropy.py``.)
- Non-floating tensors (integer, bool, complex) into every public functional op: a ``ValueError`` naming the op,
  the argument and its dtype; where eager's equivalent raises on the same input, an instance of eager's exception
  type too (checked here by running eager, not assumed).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import fuser
from fuser.kernels._triton import HAS_TRITON, interpreting

VOCAB = 16
IGNORE = -100

interpreter = pytest.mark.skipif(
    not (HAS_TRITON and interpreting()), reason="needs Triton with TRITON_INTERPRET=1 (set by conftest without a GPU)"
)


def eager_error(fn) -> BaseException | None:
    """The exception eager raises for ``fn()``, or None when it returns."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - whatever eager raises is the expectation
        return e
    return None


@pytest.fixture(params=["reference", pytest.param("triton", marks=interpreter)])
def path(request, triton_on_cpu):
    """Both CPU paths of the fused ops."""
    triton_on_cpu(request.param == "triton")
    return request.param


# ---------------------------------------------------------------------------------------------------------
# Out-of-range labels
# ---------------------------------------------------------------------------------------------------------


def _lce_inputs(n_rows=12, hidden=8, requires_grad=True):
    h = torch.randn(n_rows, hidden, requires_grad=requires_grad)
    w = torch.randn(VOCAB, hidden, requires_grad=requires_grad)
    return h, w


def _eager_lce(h, w, labels, **kw):
    return F.cross_entropy(F.linear(h, w).float(), labels, **kw)


def _op_lce(h, w, labels, reduction="mean", ignore_index=IGNORE):
    grad = torch.is_grad_enabled()
    return torch.ops.fuser.linear_cross_entropy(
        h, w, None, labels, ignore_index, reduction, 1.0, 0.0, grad and h.requires_grad, grad and w.requires_grad, False
    )[0]


@pytest.mark.parametrize("bad_label", [VOCAB, 256, -1, -101])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_out_of_range_label_raises_like_eager(bad_label, reduction, path):
    h, w = _lce_inputs()
    labels = torch.randint(0, VOCAB, (12,))
    labels[[2, 9]] = IGNORE  # ignored rows are fine
    labels[5] = bad_label
    expected = eager_error(lambda: _eager_lce(h, w, labels, reduction=reduction))
    assert type(expected) is IndexError and str(expected) == f"Target {bad_label} is out of bounds."  # the premise
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            with pytest.raises(IndexError, match=f"^{re.escape(str(expected))}$"):
                fuser.linear_cross_entropy(h, w, labels, reduction=reduction)
            with pytest.raises(IndexError, match=f"^{re.escape(str(expected))}$"):
                _op_lce(h, w, labels, reduction)
    # the same value is a fine label where it is the ignore_index
    labels = torch.where(labels == IGNORE, 0, labels)
    loss = fuser.linear_cross_entropy(h, w, labels, reduction=reduction, ignore_index=bad_label)
    ref = _eager_lce(h, w, labels, reduction=reduction, ignore_index=bad_label)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)


def test_first_out_of_range_label_is_named_as_eager_names_it(path):
    """Several bad labels (of a 2-D label tensor): eager names the first in row order; so does the op."""
    h, w = _lce_inputs(n_rows=12)
    h = h.detach().reshape(3, 4, 8).requires_grad_()
    labels = torch.randint(0, VOCAB, (3, 4))
    labels[1, 0], labels[1, 3], labels[2, 2] = 40, -3, VOCAB
    expected = eager_error(lambda: _eager_lce(h.reshape(12, 8), w, labels.reshape(-1)))
    assert str(expected) == "Target 40 is out of bounds."
    with pytest.raises(type(expected), match=f"^{re.escape(str(expected))}$"):
        fuser.linear_cross_entropy(h, w, labels)


def _tiny_llama():
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("bad_label", [256, -5])
def test_out_of_range_label_through_a_model_raises_like_eager(bad_label):
    """A tiny Llama (fp32, CPU, vocab 128) trained through ``fuser.optimize`` with one label 256 (or -5): the error
    eager raises arrives (Dynamo and AOT pass the op's IndexError through unwrapped), not a NaN loss."""
    model = _tiny_llama()
    ids = torch.randint(0, 128, (2, 8))
    bad = ids.clone()
    bad[1, 5] = bad_label
    expected = eager_error(lambda: model(input_ids=ids, labels=bad))
    assert type(expected) is IndexError and str(expected) == f"Target {bad_label} is out of bounds."  # the premise
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
    assert fuser.explain(model, config=config, input_ids=ids, labels=ids).counts.get("linear_cross_entropy") == 1
    compiled = fuser.optimize(model, config)
    good = compiled(input_ids=ids, labels=ids).loss  # compiles; the fused loss is the eager one
    torch.testing.assert_close(good, model(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-5)
    with pytest.raises(type(expected)) as raised:
        compiled(input_ids=ids, labels=bad)
    assert str(expected) in str(raised.value)


# ---------------------------------------------------------------------------------------------------------
# Non-floating tensors
# ---------------------------------------------------------------------------------------------------------

BAD_DTYPES = [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64]


def _t(shape, dtype):
    """A tensor of ``dtype`` with small non-trivial values (an integer rms_norm of it would not be all zeros)."""
    x = torch.randn(shape) * 3
    return x.to(dtype) if dtype != torch.bool else x > 0


def _cases(dtype):
    """(name in fuser's message, bad argument, fuser call, eager equivalent) for each public op and argument."""
    f32 = torch.float32
    x, w8, w48 = _t((3, 8), f32), _t((8,), f32), _t((4, 8), f32)
    xi, w8i, w48i, b4i = _t((3, 8), dtype), _t((8,), dtype), _t((4, 8), dtype), _t((4,), dtype)
    bf_base, a, lw = _t((3, 4), torch.bfloat16), _t((3, 8), f32), _t((4, 8), f32)
    labels = torch.tensor([0, 1, 3])
    return [
        ("rms_norm", "x", lambda: fuser.rms_norm(xi, w8), lambda: F.rms_norm(xi, (8,), w8)),
        ("rms_norm", "x", lambda: fuser.rms_norm(xi), lambda: F.rms_norm(xi, (8,))),
        ("rms_norm", "x", lambda: torch.ops.fuser.rms_norm(xi, None, 1e-6, 0.0, None, None), None),
        ("rms_norm", "weight", lambda: fuser.rms_norm(x, w8i), lambda: F.rms_norm(x, (8,), w8i)),
        ("swiglu", "gate", lambda: fuser.swiglu(xi, xi), lambda: F.silu(xi) * xi),
        ("swiglu", "up", lambda: fuser.swiglu(x, xi), lambda: F.silu(x) * xi),
        ("geglu", "gate", lambda: fuser.geglu(xi, xi), lambda: F.gelu(xi, approximate="tanh") * xi),
        ("geglu", "gate", lambda: fuser.geglu(xi, xi, "none"), lambda: F.gelu(xi) * xi),
        (
            "gated_activation",
            "gate",
            lambda: torch.ops.fuser.gated_activation(xi, xi, None, None, 1.0, 1.0, "silu"),
            None,
        ),
        (
            "lora_sum",
            "base",
            lambda: fuser.lora_sum(xi[:, :4], a, lw, 2.0),
            lambda: (xi[:, :4] + F.linear(a, lw) * 2.0).to(xi.dtype),
        ),
        (
            "lora_sum",
            "a",
            lambda: fuser.lora_sum(bf_base, xi, lw, 2.0),
            lambda: (bf_base + F.linear(xi, lw) * 2.0).to(bf_base.dtype),
        ),
        (
            "lora_sum",
            "weight",
            lambda: fuser.lora_sum(bf_base, a, w48i, 2.0),
            lambda: (bf_base + F.linear(a, w48i) * 2.0).to(bf_base.dtype),
        ),
        ("upcast_linear", "x", lambda: fuser.upcast_linear(xi, w48), lambda: F.linear(xi.to(w48.dtype), w48)),
        ("upcast_linear", "weight", lambda: fuser.upcast_linear(x, w48i), lambda: F.linear(x.to(w48i.dtype), w48i)),
        ("upcast_linear", "bias", lambda: fuser.upcast_linear(x, w48, b4i), None),
        (
            "linear_cross_entropy",
            "hidden",
            lambda: fuser.linear_cross_entropy(xi, w48i, labels),
            lambda: F.cross_entropy(F.linear(xi, w48i).float(), labels),
        ),
        (
            "linear_cross_entropy",
            "hidden",
            lambda: fuser.linear_cross_entropy(xi, w48, labels),
            lambda: F.cross_entropy(F.linear(xi, w48).float(), labels),
        ),
        (
            "linear_cross_entropy",
            "weight",
            lambda: fuser.linear_cross_entropy(x, w48i, labels),
            lambda: F.cross_entropy(F.linear(x, w48i).float(), labels),
        ),
    ]


CASE_IDS = [
    "rms_norm-x",
    "rms_norm-x-noweight",
    "rms_norm-op",
    "rms_norm-weight",
    "swiglu-gate",
    "swiglu-up",
    "geglu-tanh",
    "geglu-none",
    "gated_activation-op",
    "lora_sum-base",
    "lora_sum-a",
    "lora_sum-weight",
    "upcast_linear-x",
    "upcast_linear-weight",
    "upcast_linear-bias",
    "lce-hidden-weight",
    "lce-hidden",
    "lce-weight",
]


@pytest.mark.parametrize("case", range(len(CASE_IDS)), ids=CASE_IDS)
@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=str)
@pytest.mark.filterwarnings("ignore:Casting complex values to real:UserWarning")
def test_non_floating_input_raises_a_clear_error(case, dtype, path):
    name, arg, call, eager = _cases(dtype)[case]
    expected = eager_error(eager) if eager is not None else None
    with pytest.raises(ValueError) as raised:
        call()
    message = str(raised.value)
    assert message.startswith(f"fuser: {name} expects a floating-point {arg} "), message
    assert f"got {dtype}" in message and "cast it first" in message, message
    if expected is not None:  # eager raises too: fuser's error is also of eager's type
        assert isinstance(raised.value, type(expected)), f"eager raises {type(expected).__name__}: {expected}"
