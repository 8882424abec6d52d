"""Kernel tests for the fused gated activation (``src/fuser/kernels/gated_activation.py``): launchers, reference, ops.

Oracle: the reference formulas (``gated_activation_forward/backward(..., impl="reference")``) evaluated on fp64
copies of the inputs; the hand-written reference backward is itself checked against fp64 autograd of the activation
written the way models write it (``F.silu(g) * u``, ``F.gelu(g, approximate="tanh") * u``, ``F.gelu(g) * u``,
``torch.sigmoid(g) * u``, and under PEFT's LoRA ``act(gate + lora_g * s) * (up + lora_u * s)``).

Error measure: ``rel_err(a, b) = ‖a − b‖ / ‖b‖`` over the whole tensor, computed in fp64. Tolerances:

- fp32 ≤ 1e-5: a handful of fp32 roundings per element (exp, a division, erf; fp32 eps 1.2e-7) and no sums;
  measured ~1e-7, so 1e-5 leaves two decades of slack yet catches any formula slip.
- fp16 ≤ 2e-3: storing the fp32 result rounds each element by ≤ half an fp16 ulp (fp16 eps 9.8e-4); under LoRA
  the sum g is rounded to fp16 before act (as eager rounds it) while the oracle keeps it exact, which moves act(g)
  by act'(g)·δg, again about an ulp. 2e-3 allows a few ulps.
- bf16 ≤ 1e-2 (bf16 eps 7.8e-3): one bf16 ulp. On the interpreter fp32→bf16 stores truncate rather than round
  (DESIGN.md, "Testing tiers"), so there a full ulp per element is expected.

Every output is poisoned with NaN before the kernel runs (``out=`` / ``*_out=``), and every check first asserts
there is no NaN (nor inf), so an element the kernel never writes fails.

CPU launcher tests run through Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` when there is
no GPU); ``tl.erf`` works there (checked against ``torch.erf``), ``libdevice.tanh`` does not, which is why the
kernel writes gelu_tanh through a sigmoid. bf16 is only loaded/stored on the interpreter and proven on the GPU
tests (``@pytest.mark.gpu``), which use real shapes.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

import fuser.kernels.gated_activation as gated_activation_module
from fuser.kernels._triton import HAS_TRITON, interpreting
from fuser.kernels.gated_activation import (
    Lora,
    LoraGrads,
    gated_activation,
    gated_activation_backward,
    gated_activation_forward,
    gated_activation_packed,
    gated_activation_packed_backward,
    gated_activation_packed_forward,
    geglu,
    swiglu,
)


# The op's single entry per direction (``gated_activation_forward`` / ``gated_activation_backward``, and the packed
# form's) per path, called as the tests below call it.
def gated_activation_reference_forward(
    gate, up, activation, gate_lora=None, up_lora=None, gate_scale=1.0, up_scale=1.0
):
    lora = Lora(gate_lora, up_lora, gate_scale, up_scale)
    return gated_activation_forward(gate, up, activation, lora, impl="reference")


def gated_activation_reference_backward(
    dout, g, u, activation, gate_scale=1.0, up_scale=1.0, dgate=True, dup=True, dgate_lora=False, dup_lora=False
):
    wanted = (dgate, dup, dgate_lora, dup_lora)
    return gated_activation_backward(dout, g, u, activation, wanted, LoraGrads(gate_scale, up_scale), impl="reference")


def gated_activation_forward_triton(
    gate, up, activation, gate_lora=None, up_lora=None, gate_scale=1.0, up_scale=1.0, *buffers
):
    out, gate_sum, up_sum = (*buffers, None, None, None)[:3]
    lora = Lora(gate_lora, up_lora, gate_scale, up_scale)
    return gated_activation_forward(
        gate, up, activation, lora, impl="triton", out=out, gate_sum=gate_sum, up_sum=up_sum
    )


def gated_activation_backward_triton(
    dout, g, u, activation, gate_scale=1.0, up_scale=1.0, dgate=True, dup=True, dgate_lora=False, dup_lora=False, *out
):
    wanted = (dgate, dup, dgate_lora, dup_lora)
    lora = LoraGrads(gate_scale, up_scale)
    return gated_activation_backward(dout, g, u, activation, wanted, lora, impl="triton", out=out or (None,) * 4)


def gated_activation_packed_forward_triton(
    gate_up, activation, gate_up_lora=None, scale=1.0, out=None, gate_up_sum=None
):
    return gated_activation_packed_forward(
        gate_up, activation, gate_up_lora, scale, impl="triton", out=out, gate_up_sum=gate_up_sum
    )


def gated_activation_packed_backward_triton(dout, gate_up, activation, scale, *wanted_and_out):
    wanted, out = wanted_and_out[:2], wanted_and_out[2:]
    return gated_activation_packed_backward(dout, gate_up, activation, scale, wanted, impl="triton", out=out)


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# CPU launches of the Triton kernels need the interpreter; on a GPU machine the gpu tests cover the kernels.
# The interpreter evaluates σ(x) = 1/(1 + exp(−x)) in NumPy, which warns when exp(−x) overflows to inf for
# x < −88 (gelu_tanh's argument reaches that at g ≈ −10); the result, 1/inf = 0, is the right one, as on the GPU.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

interpreter = pytest.mark.skipif(
    not (HAS_TRITON and interpreting()), reason="needs Triton with TRITON_INTERPRET=1 (set by conftest without a GPU)"
)

ACTIVATIONS = ["silu", "gelu_tanh", "gelu", "sigmoid"]

# How models write each activation (the plain-torch oracle for autograd)
MODEL_ACTIVATION = {
    "silu": F.silu,  # Llama, Mistral, Qwen: ACT2FN["silu"]
    "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),  # Gemma: ACT2FN["gelu_pytorch_tanh"]
    "gelu": F.gelu,  # exact GELU: ACT2FN["gelu"]
    "sigmoid": torch.sigmoid,  # GLU: Qwen3-Next's gated attention, attn_output * torch.sigmoid(gate)
}

# LoRA variants: (gate LoRA scale, up LoRA scale); None = no LoRA term on that side
LORA = {
    "no_lora": (None, None),
    "lora": (0.5, 2.0),
    "gate_lora": (0.25, None),
    "up_lora": (None, 4.0),
}


# ---------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test id: fresh inputs per test and per parametrization, reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def randn(shape, gen, dtype=torch.float32, device="cpu", scale=1.0, shift=0.0) -> torch.Tensor:
    if torch.device(device).type == "cuda":  # GPU shapes: draw on the GPU, seeded from the test's generator
        seed = int(torch.randint(2**62, (1,), generator=gen))
        cuda_gen = torch.Generator(device).manual_seed(seed)
        return (torch.randn(shape, generator=cuda_gen, device=device) * scale + shift).to(dtype)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + shift).to(dtype=dtype, device=device)


def make_inputs(shape, dtype, gen, lora="no_lora", device="cpu"):
    """(gate, up, gate_lora, up_lora, gate_scale, up_scale, dout); the LoRA terms None where the variant has none."""
    gate_scale, up_scale = LORA[lora]
    # gate spread wide (σ 2.5) so both saturated tails of each activation and the curved middle all occur
    gate = randn(shape, gen, dtype, device, scale=2.5)
    up = randn(shape, gen, dtype, device)
    gate_lora = randn(shape, gen, dtype, device, scale=0.5) if gate_scale is not None else None
    up_lora = randn(shape, gen, dtype, device, scale=0.5) if up_scale is not None else None
    dout = randn(shape, gen, dtype, device)
    return gate, up, gate_lora, up_lora, gate_scale or 1.0, up_scale or 1.0, dout


def fp64(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to(torch.float64)


def poisoned(shape, dtype, device="cpu") -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


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


def model_gated_activation(gate, up, activation, gate_lora=None, up_lora=None, gate_scale=1.0, up_scale=1.0):
    """``act_fn(gate_proj(x)) * up_proj(x)`` with PEFT's LoRA linears returning ``base + lora * scaling``."""
    if gate_lora is not None:
        gate = gate + gate_lora * gate_scale
    if up_lora is not None:
        up = up + up_lora * up_scale
    return MODEL_ACTIVATION[activation](gate) * up


def model_gated_activation_packed(gate_up, activation, gate_up_lora=None, scale=1.0):
    """Phi-3's MLP: ``gate, up = gate_up_proj(x).chunk(2, dim=-1); up * act_fn(gate)``."""
    if gate_up_lora is not None:
        gate_up = gate_up + gate_up_lora * scale
    gate, up = gate_up.chunk(2, dim=-1)
    return up * MODEL_ACTIVATION[activation](gate)


def fp64_reference(gate, up, gate_lora, up_lora, gate_scale, up_scale, dout, activation):
    """(out, g, u, dgate, dup, dgate_lora, dup_lora) by the reference formulas on fp64 copies (None: no LoRA)."""
    out, gate_sum, up_sum = gated_activation_reference_forward(
        fp64(gate), fp64(up), activation, fp64(gate_lora), fp64(up_lora), gate_scale, up_scale
    )
    g = fp64(gate) if gate_sum is None else gate_sum
    u = fp64(up) if up_sum is None else up_sum
    grads = gated_activation_reference_backward(
        fp64(dout), g, u, activation, gate_scale, up_scale, True, True, gate_lora is not None, up_lora is not None
    )
    return (out, gate_sum, up_sum, *grads)


def run_triton(gate, up, gate_lora, up_lora, gate_scale, up_scale, dout, activation):
    """Forward and backward launchers, every output NaN-poisoned; backward gets the g and u forward saved."""
    shape, dtype = gate.shape, gate.dtype

    def fresh(wanted=True):
        return poisoned(shape, dtype, gate.device) if wanted else None

    has_gl, has_ul = gate_lora is not None, up_lora is not None
    out, gate_sum, up_sum = gated_activation_forward_triton(
        gate, up, activation, gate_lora, up_lora, gate_scale, up_scale, fresh(), fresh(has_gl), fresh(has_ul)
    )
    g = gate if gate_sum is None else gate_sum
    u = up if up_sum is None else up_sum
    grads = gated_activation_backward_triton(
        dout, g, u, activation, gate_scale, up_scale, True, True, has_gl, has_ul, fresh(), fresh(), fresh(has_gl),
        fresh(has_ul),
    )  # fmt: skip
    return (out, gate_sum, up_sum, *grads)


RESULT_NAMES = ("out", "gate_sum", "up_sum", "dgate", "dup", "dgate_lora", "dup_lora")


def check_against_fp64_reference(gate, up, gate_lora, up_lora, gate_scale, up_scale, dout, activation, tol=None):
    results = run_triton(gate, up, gate_lora, up_lora, gate_scale, up_scale, dout, activation)
    expected = fp64_reference(gate, up, gate_lora, up_lora, gate_scale, up_scale, dout, activation)
    tol = tol or TOLERANCE[gate.dtype]
    for name, actual, exp in zip(RESULT_NAMES, results, expected, strict=True):
        if exp is None:
            assert actual is None, f"{name} was computed though no one asked for it"
            continue
        assert actual.dtype == gate.dtype, f"{name}: dtype {actual.dtype} != {gate.dtype}"
        assert_close(name, actual, exp, tol)


# ---------------------------------------------------------------------------------------------------------
# The oracle itself: the hand-written reference equals fp64 autograd of the models' plain-torch formula
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lora", list(LORA))
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(4, 1), (13, 17), (2, 9, 300)], ids=str)
def test_reference_is_autograd_of_model_formula(shape, activation, lora, gen):
    gate, up, gate_lora, up_lora, gate_scale, up_scale, dout = make_inputs(shape, torch.float64, gen, lora)
    leaves = [t.requires_grad_() for t in (gate, up, gate_lora, up_lora) if t is not None]
    out_model = model_gated_activation(gate, up, activation, gate_lora, up_lora, gate_scale, up_scale)
    out_model.backward(dout)
    out, dgate, dup, dgate_lora, dup_lora = [
        fp64_reference(gate, up, gate_lora, up_lora, gate_scale, up_scale, dout, activation)[i] for i in (0, 3, 4, 5, 6)
    ]
    # fp64 throughout, formulas rearranged (σ instead of tanh, factored derivatives): 1e-12 is ~1e4 fp64 ulps
    assert_close("out", out, out_model, 1e-12)
    assert_close("dgate", dgate, gate.grad, 1e-12)
    assert_close("dup", dup, up.grad, 1e-12)
    if gate_lora is not None:
        assert_close("dgate_lora", dgate_lora, gate_lora.grad, 1e-12)
    if up_lora is not None:
        assert_close("dup_lora", dup_lora, up_lora.grad, 1e-12)
    assert len(leaves) == 2 + (gate_lora is not None) + (up_lora is not None)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_saturated_tails(activation):
    """|g| up to 30: σ saturates, exp(−g²/2) underflows; the formulas stay finite and equal autograd's."""
    g = torch.linspace(-30, 30, 601, dtype=torch.float64).requires_grad_()
    u = torch.ones_like(g)
    MODEL_ACTIVATION[activation](g).backward(torch.ones_like(g))
    out, _, _ = gated_activation_reference_forward(g.detach(), u, activation)
    dgate, _, _, _ = gated_activation_reference_backward(torch.ones_like(u), g.detach(), u, activation)
    # atol 1e-14: in the negative tail PyTorch's ½g(1 + tanh(z)) cancels to ~1e-16 garbage or 0, where g·σ(2z)
    # keeps the tiny true value; the two differ there by ~1 fp64 ulp of the leading 1
    torch.testing.assert_close(out, MODEL_ACTIVATION[activation](g.detach()), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(dgate, g.grad, rtol=1e-10, atol=1e-14)
    assert torch.isfinite(out).all() and torch.isfinite(dgate).all()


# ---------------------------------------------------------------------------------------------------------
# Triton launchers on the interpreter
# ---------------------------------------------------------------------------------------------------------

# Intermediate sizes 1, 17, 300, 1003: one column, a ragged single block, several ragged blocks per row (the
# kernel's BLOCK_N is at most 1024, so 1003 is one ragged block and 1003 × 2 packed is two); leading shapes with
# row counts that leave the last row tile ragged.
SHAPES = [(7, 1), (3, 11, 17), (2, 5, 300), (19, 1003)]


@interpreter
@pytest.mark.parametrize("lora", ["no_lora", "lora"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_matches_fp64_reference(shape, dtype, activation, lora, gen):
    check_against_fp64_reference(*make_inputs(shape, dtype, gen, lora), activation)


@interpreter
@pytest.mark.parametrize("lora", ["gate_lora", "up_lora"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_triton_one_sided_lora(activation, lora, gen):
    check_against_fp64_reference(*make_inputs((2, 9, 300), torch.float32, gen, lora), activation)


@interpreter
@pytest.mark.parametrize("lora", ["no_lora", "lora"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_triton_bf16_load_store(activation, lora, gen):
    """bf16 as the interpreter can be trusted with it: load → fp32 math → store (1 ulp, stores truncate)."""
    check_against_fp64_reference(*make_inputs((24, 300), torch.bfloat16, gen, lora), activation)


@interpreter
def test_triton_lora_sum_is_saved_rounded_and_the_product_uses_the_exact_sum(gen):
    """fp16: the saved g is the fp16 rounding of gate + s·lora; act(·)·up is computed from the unrounded fp32 sum
    (as Inductor computes peft's ``(base + lora·s).to(half)`` fused into its consumer), issue 16."""
    gate, up, gate_lora, _, _, _, _ = make_inputs((16, 300), torch.float16, gen, "gate_lora")
    scale = 0.3  # not a power of two: the fp32 sum is not exactly representable in fp16
    out, gate_sum, _ = gated_activation_forward_triton(
        gate,
        up,
        "silu",
        gate_lora,
        None,
        scale,
        1.0,
        poisoned(gate.shape, gate.dtype),
        poisoned(gate.shape, gate.dtype),
    )
    exact = fp64(gate) + scale * fp64(gate_lora)
    assert gate_sum.dtype == torch.float16
    assert ((fp64(gate_sum) - exact).abs() <= exact.abs() * 2.0**-11 + 2.0**-25).all(), "sum not rounded to nearest"
    # act on the exact sum agrees to fp32 accuracy before the final fp16 store (≤ half an fp16 ulp)
    expected = F.silu(exact) * fp64(up)
    assert ((fp64(out) - expected).abs() <= expected.abs() * 2.0**-11 + 2.0**-24).all()


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_a_lora_term_below_half_an_ulp_still_moves_the_product(gen, path):
    """peft's LoRA B starts at zero: early terms are far below the base's half ulp. Rounding the sum first (eager)
    gives act(base)·up exactly; the op's product must move with the term, as the fp32 computation's does."""
    if path == "triton" and not (HAS_TRITON and interpreting()):
        pytest.skip("the Triton path runs through the interpreter here (on a GPU: the GPU tests)")
    gate, up, _, _, _, _, _ = make_inputs((64, 256), torch.float16, gen)
    gate = gate.sign() * gate.abs().clamp_min(0.5)  # |gate| ≥ 0.5: half an ulp ≥ 2^-12, far above the term
    tiny = torch.full(gate.shape, 3e-5, dtype=torch.float32)
    forward = gated_activation_forward_triton if path == "triton" else gated_activation_reference_forward
    out, g, _ = forward(gate, up, "silu", tiny, None, 1.0, 1.0)
    assert torch.equal(g, gate), "the saved sum is the rounded one: the base itself"
    exact = F.silu(fp64(gate) + 3e-5) * fp64(up)
    rounded_first = (F.silu(fp64(gate)) * fp64(up)).to(torch.float16)
    assert ((fp64(out) - exact).abs() <= exact.abs() * 2.0**-11 + 2.0**-24).all()
    should_move = (exact.to(torch.float16) != rounded_first).float().mean()
    assert should_move > 0.01, "the test's term must move some fp16 outputs"
    moved = (out != rounded_first).float().mean()
    assert moved >= 0.8 * should_move, f"the LoRA term was rounded away before the product ({moved} vs {should_move})"


# Each layout builds a [R, I] (or [2, R/2, I]) tensor whose storage is not that of a contiguous tensor.
def _contiguous(gen, shape, **kw):
    return randn(shape, gen, **kw)


def _packed_half(gen, shape, **kw):  # one half of a packed [R, 2I] tensor: row stride 2I (a view)
    return randn((shape[0], 2 * shape[1]), gen, **kw)[:, shape[1] :]


def _transposed(gen, shape, **kw):  # column stride != 1: the launcher must copy
    return randn(shape[::-1], gen, **kw).t()


def _row_strided(gen, shape, **kw):  # a slice of wider rows
    return randn((shape[0], shape[1] + 13), gen, **kw)[:, 3 : 3 + shape[1]]


def _every_other_row(gen, shape, **kw):  # 3-D with a strided middle dim
    return randn((2, shape[0], shape[1]), gen, **kw)[:, ::2]


def _expanded(gen, shape, **kw):  # stride-0 rows, as autograd hands out for `out.sum()`-like losses
    return randn(shape[-1], gen, **kw).expand(shape)


LAYOUTS = {
    # (gate, up, LoRA terms, dout)
    "packed_halves": (_packed_half, _packed_half, _packed_half, _contiguous),
    "gate_transposed_dout_transposed": (_transposed, _contiguous, _contiguous, _transposed),
    "row_strided_lora": (_contiguous, _row_strided, _row_strided, _contiguous),
    "every_other_row": (_every_other_row, _every_other_row, _every_other_row, _every_other_row),
    "dout_expanded": (_contiguous, _contiguous, _transposed, _expanded),
}


@interpreter
@pytest.mark.parametrize("lora", ["no_lora", "lora"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_triton_non_contiguous_inputs(layout, lora, gen):
    shape = (36, 65)
    make_gate, make_up, make_lora, make_dout = LAYOUTS[layout]
    gate, up = make_gate(gen, shape, scale=2.5), make_up(gen, shape)
    gate_lora = up_lora = None
    if lora == "lora":
        gate_lora, up_lora = make_lora(gen, shape, scale=0.5), make_lora(gen, shape, scale=0.5)
    dout = make_dout(gen, shape)
    assert not all(t.is_contiguous() for t in (gate, up, dout))
    before = [t.clone() for t in (gate, up, gate_lora, up_lora, dout) if t is not None]
    for activation in ("silu", "gelu"):
        check_against_fp64_reference(gate, up, gate_lora, up_lora, 0.5, 2.0, dout, activation)
    after = [t for t in (gate, up, gate_lora, up_lora, dout) if t is not None]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "an input was modified"


@interpreter
@pytest.mark.parametrize(
    "wanted",
    [(True, False, False, False), (False, True, False, False), (False, False, True, True), (False, True, True, False)],
    ids=["dgate", "dup", "lora_grads_only", "dup_and_dgate_lora"],
)
def test_triton_backward_writes_only_what_is_asked(wanted, gen):
    gate, up, _, _, _, _, dout = make_inputs((2, 9, 300), torch.float32, gen)
    buffers = [poisoned(gate.shape, gate.dtype) if w else None for w in wanted]
    grads = gated_activation_backward_triton(dout, gate, up, "gelu_tanh", 0.5, 2.0, *wanted, *buffers)
    expected = gated_activation_reference_backward(fp64(dout), fp64(gate), fp64(up), "gelu_tanh", 0.5, 2.0, *wanted)
    for name, actual, exp, w in zip(RESULT_NAMES[3:], grads, expected, wanted, strict=True):
        if w:
            assert_close(name, actual, exp, TOLERANCE[torch.float32])
        else:
            assert actual is None and exp is None


@interpreter
def test_triton_inf_and_nan_in_dout_pass_through(gen):
    """GradScaler relies on a non-finite upstream gradient reaching the parameters."""
    gate, up, _, _, _, _, dout = make_inputs((8, 65), torch.float32, gen)
    dout[1, 3], dout[4, 60], dout[7, 0] = float("inf"), float("-inf"), float("nan")
    dgate, dup, _, _ = gated_activation_backward_triton(dout, gate, up, "silu")
    bad = ~torch.isfinite(dout)
    for name, grad in (("dgate", dgate), ("dup", dup)):
        assert not torch.isfinite(grad[bad]).any(), f"{name}: a non-finite dout gave a finite gradient"
        assert torch.isfinite(grad[~bad]).all()
    dgate_ref, dup_ref, _, _ = gated_activation_reference_backward(dout, gate, up, "silu")
    torch.testing.assert_close(dgate, dgate_ref, equal_nan=True)
    torch.testing.assert_close(dup, dup_ref, equal_nan=True)


def check_in_place(dout, gate, up, activation, tol):
    """``fuser::gated_activation_backward_`` writes dgate over gate and dup over up: what the out-of-place
    backward gives, and within ``tol`` of fp64."""
    expected = gated_activation_reference_backward(fp64(dout), fp64(gate), fp64(up), activation)
    out_of_place = torch.ops.fuser.gated_activation_backward(
        dout, gate, up, 1.0, 1.0, True, True, False, False, activation
    )
    torch.ops.fuser.gated_activation_backward_(dout, gate, up, 1.0, 1.0, activation)
    for name, written, reference, exp in (("dgate", gate, out_of_place[0], expected[0]),
                                          ("dup", up, out_of_place[1], expected[1])):  # fmt: skip
        assert torch.equal(written, reference), f"{name}: in place differs from out of place"
        assert_close(name, written, exp, tol)


@interpreter
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_triton_backward_in_place(activation, dtype, gen, triton_on_cpu):
    triton_on_cpu()
    gate, up, _, _, _, _, dout = make_inputs((3, 7, 300), dtype, gen)
    check_in_place(dout, gate, up, activation, TOLERANCE[dtype])


PACKED_SHAPES = [(5, 2), (2, 7, 34), (19, 600), (3, 2006)]  # I = 1, 17, 300, 1003


def run_triton_packed(gate_up, gate_up_lora, scale, dout, activation):
    shape, dtype, device = gate_up.shape, gate_up.dtype, gate_up.device
    has_lora = gate_up_lora is not None

    def fresh(wanted=True, shape=shape):
        return poisoned(shape, dtype, device) if wanted else None

    out, gate_up_sum = gated_activation_packed_forward_triton(
        gate_up, activation, gate_up_lora, scale, fresh(shape=(*shape[:-1], shape[-1] // 2)), fresh(has_lora)
    )
    saved = gate_up if gate_up_sum is None else gate_up_sum
    dgate_up, dgate_up_lora = gated_activation_packed_backward_triton(
        dout, saved, activation, scale, True, has_lora, fresh(), fresh(has_lora)
    )
    return out, gate_up_sum, dgate_up, dgate_up_lora


def check_packed_against_fp64_reference(gate_up, gate_up_lora, scale, dout, activation):
    out, gate_up_sum, dgate_up, dgate_up_lora = run_triton_packed(gate_up, gate_up_lora, scale, dout, activation)
    # the oracle: the unpacked fp64 reference on the halves, the gradients concatenated
    gate, up = gate_up.chunk(2, -1)
    gate_lora, up_lora = gate_up_lora.chunk(2, -1) if gate_up_lora is not None else (None, None)
    ref = fp64_reference(gate, up, gate_lora, up_lora, scale, scale, dout, activation)
    tol = TOLERANCE[gate_up.dtype]
    assert_close("out", out, ref[0], tol)
    assert_close("dgate_up", dgate_up, torch.cat([ref[3], ref[4]], -1), tol)
    if gate_up_lora is None:
        assert gate_up_sum is None and dgate_up_lora is None
    else:
        assert_close("gate_up_sum", gate_up_sum, torch.cat([ref[1], ref[2]], -1), tol)
        assert_close("dgate_up_lora", dgate_up_lora, torch.cat([ref[5], ref[6]], -1), tol)


@interpreter
@pytest.mark.parametrize("lora", [False, True], ids=["no_lora", "lora"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", PACKED_SHAPES, ids=str)
def test_triton_packed_matches_fp64_reference(shape, activation, lora, gen):
    gate_up = randn(shape, gen, scale=2.5)
    gate_up_lora = randn(shape, gen, scale=0.5) if lora else None
    dout = randn((*shape[:-1], shape[-1] // 2), gen)
    check_packed_against_fp64_reference(gate_up, gate_up_lora, 0.5, dout, activation)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_triton_packed_half_precision(dtype, gen):
    shape = (2, 9, 130)
    gate_up = randn(shape, gen, dtype, scale=2.5)
    gate_up_lora = randn(shape, gen, dtype, scale=0.5)
    dout = randn((2, 9, 65), gen, dtype)
    check_packed_against_fp64_reference(gate_up, gate_up_lora, 2.0, dout, "gelu_tanh")


@interpreter
def test_triton_packed_non_contiguous(gen):
    """gate_up a slice of wider rows (a fused projection's output), dout transposed."""
    gate_up = randn((24, 2 * 65 + 32), gen, scale=2.5)[:, 16 : 16 + 130]
    gate_up_lora = randn((130, 24), gen, scale=0.5).t()
    dout = randn((65, 24), gen).t()
    check_packed_against_fp64_reference(gate_up, gate_up_lora, 0.5, dout, "silu")


@interpreter
@pytest.mark.parametrize("lora", ["no_lora", "lora"])
@pytest.mark.parametrize("shape", [(0, 17), (2, 0, 65), (0, 3, 1003)], ids=str)
def test_triton_zero_rows(shape, lora, gen):
    inputs = make_inputs(shape, torch.float32, gen, lora)
    for name, result in zip(RESULT_NAMES, run_triton(*inputs, "silu"), strict=True):
        assert result is None or result.shape == shape, name
    gate_up = randn((*shape[:-1], 2 * shape[-1]), gen)
    out, _, dgate_up, _ = run_triton_packed(gate_up, None, 1.0, randn(shape, gen), "silu")
    assert out.shape == shape and dgate_up.shape == gate_up.shape


# ---------------------------------------------------------------------------------------------------------
# The custom ops and their autograd (CPU: the reference path; inside ``triton_on_cpu()``: the interpreter)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def reference_path(triton_on_cpu):
    """CPU tensors take the plain-torch reference outside ``triton_on_cpu()``; make sure of it."""
    triton_on_cpu(False)


def _call_functional(gate, up, activation, gate_lora, up_lora, gate_scale, up_scale):
    return gated_activation(
        gate, up, activation, gate_lora=gate_lora, up_lora=up_lora, gate_scale=gate_scale, up_scale=up_scale
    )


def _call_named(gate, up, activation, gate_lora, up_lora, gate_scale, up_scale):
    """swiglu / geglu: no LoRA terms."""
    assert gate_lora is None and up_lora is None
    if activation == "silu":
        return swiglu(gate, up)
    return geglu(gate, up, approximate="tanh" if activation == "gelu_tanh" else "none")


def _call_op(gate, up, activation, gate_lora, up_lora, gate_scale, up_scale):
    out, gate_sum, up_sum = torch.ops.fuser.gated_activation(
        gate, up, gate_lora, up_lora, gate_scale, up_scale, activation
    )
    # the sums are outputs only so backward can save them: filled under LoRA, empty otherwise, never differentiable
    for base, lora, scale, total in ((gate, gate_lora, gate_scale, gate_sum), (up, up_lora, up_scale, up_sum)):
        assert not total.requires_grad
        if lora is None:
            assert total.numel() == 0
        else:
            assert_close("sum", total, fp64(base) + scale * fp64(lora), TOLERANCE[torch.float32])
    return out


def check_op_autograd(call, activation, lora, shape, gen, requires_grad=(True, True, True, True)):
    """fp32 loss.backward() through fuser vs fp64 autograd of the models' formula; a leaf whose requires_grad is
    False must end without a gradient."""
    gate, up, gate_lora, up_lora, gate_scale, up_scale, _ = make_inputs(shape, torch.float32, gen, lora)
    probe = randn(shape, gen)  # a random upstream gradient
    inputs = [gate, up, gate_lora, up_lora]
    for t, r in zip(inputs, requires_grad, strict=True):
        if t is not None:
            t.requires_grad_(r)
    out = call(gate, up, activation, gate_lora, up_lora, gate_scale, up_scale)
    assert out.dtype == torch.float32 and out.shape == shape
    if out.requires_grad:
        (out * probe).sum().backward()

    inputs64 = [fp64(t).requires_grad_(t.requires_grad) if t is not None else None for t in inputs]
    out64 = model_gated_activation(inputs64[0], inputs64[1], activation, inputs64[2], inputs64[3], gate_scale, up_scale)
    if out64.requires_grad:
        (out64 * fp64(probe)).sum().backward()

    tol = TOLERANCE[torch.float32]
    assert_close("out", out, out64, tol)
    for name, t, t64 in zip(("gate", "up", "gate_lora", "up_lora"), inputs, inputs64, strict=True):
        if t is None:
            continue
        if t.requires_grad:
            assert_close(f"{name}.grad", t.grad, t64.grad, tol)
        else:
            assert t.grad is None, f"{name} got a gradient it did not ask for"


@pytest.mark.parametrize("lora", list(LORA))
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("call", [_call_functional, _call_op], ids=["functional", "torch_ops"])
def test_op_autograd_matches_fp64_model(call, activation, lora, gen, reference_path):
    check_op_autograd(call, activation, lora, (3, 7, 65), gen)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])  # the activations of swiglu() and geglu()
def test_swiglu_geglu_autograd(activation, gen, reference_path):
    check_op_autograd(_call_named, activation, "no_lora", (2, 5, 33), gen)


# (gate, up, gate_lora, up_lora) requires_grad → the flags the backward must be asked for
NEEDS_GRAD = {
    # LoRA on a frozen model's first layer: the block input needs no grad, only the adapters train
    "lora_grads_only": ("lora", (False, False, True, True)),
    # frozen adapters (e.g. evaluating one adapter while training another part)
    "base_grads_only": ("lora", (True, True, False, False)),
    "gate_only": ("no_lora", (True, False, True, True)),
    "up_lora_only": ("up_lora", (False, False, True, True)),
    "gate_and_gate_lora": ("gate_lora", (True, False, True, True)),
}


@pytest.mark.parametrize("case", list(NEEDS_GRAD))
def test_op_asks_backward_only_for_needed_grads(case, gen, reference_path, monkeypatch):
    lora, requires_grad = NEEDS_GRAD[case]
    calls = []

    real = gated_activation_module.gated_activation_backward

    def spy(dout, g, u, activation, wanted, *args, **kwargs):
        calls.append(tuple(wanted))
        return real(dout, g, u, activation, wanted, *args, **kwargs)

    monkeypatch.setattr(gated_activation_module, "gated_activation_backward", spy)
    check_op_autograd(_call_functional, "gelu_tanh", lora, (5, 300), gen, requires_grad)
    gate_scale, up_scale = LORA[lora]
    expected = (
        requires_grad[0],
        requires_grad[1],
        requires_grad[2] and gate_scale is not None,
        requires_grad[3] and up_scale is not None,
    )
    assert calls == [expected], f"backward was asked for {calls}, expected {expected}"


def test_op_without_any_needed_grad_runs_no_backward(gen, reference_path):
    gate, up, gate_lora, up_lora, _, _, _ = make_inputs((4, 17), torch.float32, gen, "lora")
    out = gated_activation(gate, up, "silu", gate_lora=gate_lora, up_lora=up_lora)
    assert not out.requires_grad


@pytest.mark.parametrize("lora", ["no_lora", "lora"])
def test_op_saves_g_and_u_never_the_activation(lora, gen, reference_path):
    gate, up, gate_lora, up_lora, gate_scale, up_scale, _ = make_inputs((6, 65), torch.float32, gen, lora)
    for t in (gate, up, gate_lora, up_lora):
        if t is not None:
            t.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, gate_sum, up_sum = torch.ops.fuser.gated_activation(
            gate, up, gate_lora, up_lora, gate_scale, up_scale, "silu"
        )
    expected = (gate, up) if lora == "no_lora" else (gate_sum, up_sum)
    assert [t.data_ptr() for t in saved] == [t.data_ptr() for t in expected]
    assert out.data_ptr() not in [t.data_ptr() for t in saved]


def test_op_zero_rows(gen, reference_path):
    gate, up, gate_lora, up_lora, _, _, _ = make_inputs((0, 4, 65), torch.float32, gen, "lora")
    leaves = [t.requires_grad_() for t in (gate, up, gate_lora, up_lora)]
    gated_activation(gate, up, "gelu", gate_lora=gate_lora, up_lora=up_lora).sum().backward()
    assert all(t.grad.shape == t.shape for t in leaves)
    gate_up = randn((0, 130), gen).requires_grad_()
    gated_activation_packed(gate_up, "silu").sum().backward()
    assert gate_up.grad.shape == gate_up.shape


def test_op_rejects_bad_arguments():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="up of gate's dtype"):
        swiglu(x, x.half())
    with pytest.raises(ValueError, match="gate_lora of gate's dtype"):
        gated_activation(x, x, "silu", gate_lora=x.double())
    with pytest.raises(ValueError, match="up of gate's shape"):
        swiglu(x, x[:, :32])
    with pytest.raises(ValueError, match="expects an activation of"):
        gated_activation(x, x, "swish")
    with pytest.raises(ValueError, match="approximate 'tanh' or 'none'"):
        geglu(x, x, approximate="erf")
    with pytest.raises(ValueError, match="even last dim"):
        gated_activation_packed(torch.randn(2, 63), "silu")


def check_packed_op_autograd(activation, lora, gen, requires_grad=(True, True), shape=(3, 5, 130)):
    gate_up = randn(shape, gen, scale=2.5).requires_grad_(requires_grad[0])
    gate_up_lora = randn(shape, gen, scale=0.5).requires_grad_(requires_grad[1]) if lora else None
    probe = randn((*shape[:-1], shape[-1] // 2), gen)
    out = gated_activation_packed(gate_up, activation, gate_up_lora=gate_up_lora, scale=0.5)
    (out * probe).sum().backward()
    gate_up64 = fp64(gate_up).requires_grad_(requires_grad[0])
    lora64 = fp64(gate_up_lora).requires_grad_(requires_grad[1]) if lora else None
    (model_gated_activation_packed(gate_up64, activation, lora64, 0.5) * fp64(probe)).sum().backward()
    tol = TOLERANCE[torch.float32]
    for name, t, t64 in (("gate_up", gate_up, gate_up64), ("gate_up_lora", gate_up_lora, lora64)):
        if t is None:
            continue
        if t.requires_grad:
            assert t.grad.shape == t.shape and t.grad.is_contiguous()
            assert_close(f"{name}.grad", t.grad, t64.grad, tol)
        else:
            assert t.grad is None


@pytest.mark.parametrize("lora", [False, True], ids=["no_lora", "lora"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_packed_op_autograd_matches_fp64_model(activation, lora, gen, reference_path):
    check_packed_op_autograd(activation, lora, gen)


def test_packed_op_asks_only_for_the_lora_grad(gen, reference_path, monkeypatch):
    calls = []
    real = gated_activation_module.gated_activation_packed_backward

    def spy(dout, gate_up, activation, scale, wanted, *args, **kwargs):
        calls.append(tuple(wanted))
        return real(dout, gate_up, activation, scale, wanted, *args, **kwargs)

    monkeypatch.setattr(gated_activation_module, "gated_activation_packed_backward", spy)
    check_packed_op_autograd("silu", True, gen, requires_grad=(False, True))
    assert calls == [(False, True)]


def _opcheck_inputs(gen):
    x = make_inputs((3, 5, 65), torch.float32, gen, "lora")
    h = make_inputs((4, 17), torch.float16, gen, "gate_lora")
    packed = randn((6, 130), gen)
    return x, h, packed


def test_opcheck_gated_activation(gen, reference_path):
    (gate, up, gl, ul, gs, us, _), (hg, hu, hgl, _, hgs, _, _), packed = _opcheck_inputs(gen)
    gate_half, up_half = packed.chunk(2, -1)
    cases = [
        (gate.requires_grad_(), up.requires_grad_(), None, None, 1.0, 1.0, "silu"),
        (gate, up, gl.requires_grad_(), ul.requires_grad_(), gs, us, "gelu_tanh"),
        (hg, hu, hgl.requires_grad_(), None, hgs, 1.0, "gelu"),  # only the gate LoRA trains
        (gate_half.requires_grad_(), up_half, None, None, 1.0, 1.0, "gelu_tanh"),  # strided halves
    ]
    for args in cases:
        torch.library.opcheck(torch.ops.fuser.gated_activation.default, args)


def test_opcheck_gated_activation_backward(gen, reference_path):
    (gate, up, _, _, _, _, dout), _, packed = _opcheck_inputs(gen)
    gate_half, up_half = packed.chunk(2, -1)
    cases = [
        (dout, gate, up, 1.0, 1.0, True, True, False, False, "silu"),
        (dout, gate, up, 0.5, 2.0, False, False, True, True, "gelu_tanh"),
        (dout[..., :2, :], gate[..., :2, :], up[..., :2, :], 0.5, 2.0, True, False, True, False, "gelu"),
        (randn((6, 65), gen), gate_half, up_half, 1.0, 1.0, True, True, True, True, "silu"),
    ]
    for args in cases:
        torch.library.opcheck(torch.ops.fuser.gated_activation_backward.default, args)


def test_opcheck_gated_activation_packed(gen, reference_path):
    _, _, packed = _opcheck_inputs(gen)
    lora = randn(packed.shape, gen, scale=0.5)
    dout = randn((6, 65), gen)
    forward_cases = [
        (packed.clone().requires_grad_(), None, 1.0, "silu"),
        (packed, lora.requires_grad_(), 0.5, "gelu_tanh"),
        (packed.reshape(2, 3, 130), None, 1.0, "gelu"),
    ]
    for args in forward_cases:
        torch.library.opcheck(torch.ops.fuser.gated_activation_packed.default, args)
    for wanted in ((True, False), (False, True), (True, True)):
        args = (dout, packed, 0.5, *wanted, "gelu_tanh")
        torch.library.opcheck(torch.ops.fuser.gated_activation_packed_backward.default, args)


@interpreter
def test_opcheck_through_triton(gen, triton_on_cpu):
    triton_on_cpu()
    gate, up, gl, ul, gs, us, dout = make_inputs((5, 33), torch.float32, gen, "lora")
    torch.library.opcheck(
        torch.ops.fuser.gated_activation.default,
        (gate.requires_grad_(), up, gl.requires_grad_(), ul, gs, us, "silu"),
    )
    torch.library.opcheck(
        torch.ops.fuser.gated_activation_packed.default,
        (torch.cat([gate, up], -1).detach().requires_grad_(), None, 1.0, "gelu"),
    )


# ---------------------------------------------------------------------------------------------------------
# The custom ops forced through Triton on CPU (the interpreter)
# ---------------------------------------------------------------------------------------------------------


def count_launches(monkeypatch, names):
    launched = []

    def counting(name, launcher):
        def launch(*args, **kwargs):
            launched.append(name)
            return launcher(*args, **kwargs)

        return launch

    for name in names:
        monkeypatch.setattr(gated_activation_module, name, counting(name, getattr(gated_activation_module, name)))
    return launched


@interpreter
@pytest.mark.parametrize("lora", ["no_lora", "lora", "up_lora"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_op_through_triton_on_cpu(activation, lora, gen, monkeypatch, triton_on_cpu):
    triton_on_cpu()
    launched = count_launches(monkeypatch, ["_launch_forward", "_launch_backward"])
    check_op_autograd(_call_functional, activation, lora, (2, 9, 65), gen)
    # a silent fall-back to the reference path must not pass
    assert launched == ["_launch_forward", "_launch_backward"]


@interpreter
def test_op_through_triton_lora_grads_only(gen, monkeypatch, triton_on_cpu):
    triton_on_cpu()
    launched = count_launches(monkeypatch, ["_launch_forward", "_launch_backward"])
    check_op_autograd(_call_functional, "silu", "lora", (2, 9, 65), gen, requires_grad=(False, False, True, True))
    assert launched == ["_launch_forward", "_launch_backward"]


@interpreter
@pytest.mark.parametrize("lora", [False, True], ids=["no_lora", "lora"])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_packed_op_through_triton_on_cpu(activation, lora, gen, monkeypatch, triton_on_cpu):
    triton_on_cpu()
    names = ["_launch_forward", "_launch_backward"]
    launched = count_launches(monkeypatch, names)
    check_packed_op_autograd(activation, lora, gen)
    assert launched == names


# ---------------------------------------------------------------------------------------------------------
# GPU: real shapes, all three dtypes
# ---------------------------------------------------------------------------------------------------------
# Tolerances as on the CPU (module docstring): bf16 ≤ 1e-2 is one bf16 ulp (eps 7.8e-3) of the final store, the
# LoRA sum's rounding adding about as much again on a few elements only; fp16 ≤ 2e-3 a few fp16 ulps (eps 9.8e-4);
# fp32 ≤ 1e-5 leaves two decades over the ~1e-7 of a handful of fp32 roundings. The fp64 oracle runs on the GPU.

GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
GPU_INTERMEDIATE = [8192, 14336, 11009]  # Llama-3-8B's 14336, and an odd size with a ragged last column block
GPU_ROWS = 4096


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["plain", "lora", "packed"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("intermediate", GPU_INTERMEDIATE)
def test_gpu_matches_fp64_reference(intermediate, dtype, activation, variant, gen):
    shape = (GPU_ROWS, intermediate)
    if variant == "packed":
        gate_up = randn((GPU_ROWS, 2 * intermediate), gen, dtype, "cuda", scale=2.5)
        gate_up_lora = randn(gate_up.shape, gen, dtype, "cuda", scale=0.5)
        check_packed_against_fp64_reference(gate_up, gate_up_lora, 0.5, randn(shape, gen, dtype, "cuda"), activation)
    else:
        inputs = make_inputs(shape, dtype, gen, "lora" if variant == "lora" else "no_lora", device="cuda")
        check_against_fp64_reference(*inputs, activation)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gpu_backward_in_place(activation, dtype, gen):
    gate, up, _, _, _, _, dout = make_inputs((GPU_ROWS, 14336), dtype, gen, device="cuda")
    check_in_place(dout, gate, up, activation, TOLERANCE[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_non_contiguous(dtype, gen):
    """gate and up as halves of a packed [2, 2048, 2·14336] tensor, dout a transposed view."""
    packed = randn((2, 2048, 2 * 14336), gen, dtype, "cuda", scale=2.5)
    gate, up = packed.chunk(2, -1)
    dout = randn((2, 14336, 2048), gen, dtype, "cuda").transpose(1, 2)
    check_against_fp64_reference(gate, up, None, None, 1.0, 1.0, dout, "silu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gpu_op_autograd(activation, dtype, gen):
    shape = (2, 2048, 14336)
    gate, up, gate_lora, up_lora, gate_scale, up_scale, dout = make_inputs(shape, dtype, gen, "lora", device="cuda")
    leaves = [t.requires_grad_() for t in (gate, up, gate_lora, up_lora)]
    out = gated_activation(
        gate, up, activation, gate_lora=gate_lora, up_lora=up_lora, gate_scale=gate_scale, up_scale=up_scale
    )
    out.backward(dout)
    ref = fp64_reference(gate, up, gate_lora, up_lora, gate_scale, up_scale, dout, activation)
    tol = TOLERANCE[dtype]
    assert_close("out", out, ref[0], tol)
    for name, leaf, expected in zip(("gate", "up", "gate_lora", "up_lora"), leaves, ref[3:], strict=True):
        assert_close(f"{name}.grad", leaf.grad, expected, tol)


@pytest.mark.gpu
def test_gpu_results_are_deterministic(gen):
    inputs = make_inputs((GPU_ROWS, 14336), torch.bfloat16, gen, "lora", device="cuda")
    first = run_triton(*inputs, "gelu_tanh")
    second = run_triton(*inputs, "gelu_tanh")
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("force_triton", [False, pytest.param(True, marks=interpreter)], ids=["reference", "triton"])
def test_fp32_lora_terms_under_a_half_precision_base(force_triton, gen, triton_on_cpu):
    """peft keeps adapters in fp32 under a bf16/fp16 base: the op takes the fp32 LoRA terms as they are, rounds
    the sums to the base dtype (as ``(base + lora * s).to(base dtype)`` does) and returns fp32 LoRA gradients."""
    triton_on_cpu(force_triton)
    shape = (6, 70)
    gate, up = (randn(shape, gen, torch.float16, scale=2.0).requires_grad_() for _ in range(2))
    gate_lora, up_lora = (randn(shape, gen, torch.float32, scale=0.5).requires_grad_() for _ in range(2))
    probe = randn(shape, gen)
    out = gated_activation(gate, up, "silu", gate_lora=gate_lora, up_lora=up_lora, gate_scale=0.5, up_scale=2.0)
    assert out.dtype == torch.float16
    (out.float() * probe).sum().backward()
    assert gate_lora.grad.dtype == torch.float32 and up_lora.grad.dtype == torch.float32
    g64 = (fp64(gate) + 0.5 * fp64(gate_lora)).to(torch.float16).to(torch.float64)
    u64 = (fp64(up) + 2.0 * fp64(up_lora)).to(torch.float16).to(torch.float64)
    g64.requires_grad_()
    u64.requires_grad_()
    ref = torch.nn.functional.silu(g64) * u64
    (ref * fp64(probe)).sum().backward()
    tol = TOLERANCE[torch.float16]
    assert_close("out", out, ref, tol)
    assert_close("gate.grad", gate.grad, g64.grad, tol)
    assert_close("gate_lora.grad", gate_lora.grad, 0.5 * g64.grad, tol)
    assert_close("up_lora.grad", up_lora.grad, 2.0 * u64.grad, tol)


@interpreter
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("over_dout", [False, True], ids=["own_buffer", "over_dout"])
def test_triton_backward_writes_the_forward_product(activation, dtype, over_dout, gen):
    """``product_out``: the backward kernel also writes ``act(g) · u``, the forward kernel's value bit for bit
    (the down projection's weight gradient takes it in place of a recompute), into its own buffer or over dout
    (each element read before it is written); the gradients are unchanged."""
    gate, up, _, _, _, _, dout = make_inputs((3, 7, 300), dtype, gen)
    forward = gated_activation_forward(gate, up, activation, impl="triton")[0]
    plain = gated_activation_backward(dout, gate, up, activation, impl="triton")
    dout_in = dout.clone()
    product = dout_in if over_dout else poisoned(gate.shape, dtype)
    buffers = (poisoned(gate.shape, dtype), poisoned(gate.shape, dtype), None, None)
    grads = gated_activation_backward(dout_in, gate, up, activation, impl="triton", out=buffers, product_out=product)
    assert torch.equal(product, forward)
    assert torch.equal(grads[0], plain[0]) and torch.equal(grads[1], plain[1])
    expected = gated_activation_reference_forward(fp64(gate), fp64(up), activation)[0]
    assert_close("product", product, expected, TOLERANCE[dtype])


@pytest.mark.parametrize("over_g_and_u", [False, True], ids=["own_buffers", "over_g_and_u"])
def test_reference_backward_writes_the_product_before_overwriting(over_g_and_u, gen):
    """The reference path computes the product from g and u before it writes the gradients, which may go over
    them (the in-place op) or over dout."""
    gate, up, _, _, _, _, dout = make_inputs((4, 33), torch.float32, gen)
    forward = gated_activation_forward(gate, up, "silu", impl="reference")[0]
    plain = gated_activation_backward(dout, gate, up, "silu", impl="reference")
    g, u, d = gate.clone(), up.clone(), dout.clone()
    out = (g, u, None, None) if over_g_and_u else (None,) * 4
    grads = gated_activation_backward(d, g, u, "silu", impl="reference", out=out, product_out=d)
    assert torch.equal(d, forward)
    assert torch.equal(grads[0], plain[0]) and torch.equal(grads[1], plain[1])
