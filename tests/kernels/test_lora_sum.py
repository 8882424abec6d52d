"""Tier 2: ``fuser::lora_sum`` — peft's ``(base + lora_B(a) · s).to(base.dtype)`` with an fp32 adapter under a
half-precision base: values and gradients of base, ``a`` and ``B``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fuser.kernels.lora_sum as module
import fuser.kernels.upcast_linear as U
from fuser.kernels._triton import HAS_TRITON, interpreting
from fuser.kernels.lora_sum import lora_sum


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def leaves(gen, lead, rank, n_out, dtype, requires=(True, True, True)):
    base = torch.randn(*lead, n_out, generator=gen).to(dtype).requires_grad_(requires[0])
    a = torch.randn(*lead, rank, generator=gen).requires_grad_(requires[1])
    w = (0.1 * torch.randn(n_out, rank, generator=gen)).requires_grad_(requires[2])
    return base, a, w


def grads(ts):
    return [None if t.grad is None else t.grad.clone() for t in ts]


def within_one_rounding(out, exact, base, a, w, scale):
    """``out`` is the exact sum computed in fp32 (error ≤ (rank + 2)·2⁻²⁴·Σ|terms|) and rounded once to its dtype
    (≤ half a unit in the last place, subnormals included): the bound, element by element."""
    info = torch.finfo(out.dtype)
    terms = base.detach().double().abs() + F.linear(a.detach().double().abs(), w.detach().double().abs()) * abs(scale)
    fp32_error = (a.shape[-1] + 2) * 2.0**-24 * terms
    half_ulp = torch.maximum(exact.abs() * info.eps / 2, torch.full_like(exact, info.smallest_normal * info.eps / 2))
    excess = (out.double() - exact).abs() - (half_ulp + fp32_error)
    assert (excess <= 0).all(), f"{(excess > 0).sum().item()} elements beyond one rounding of an fp32 sum"


def rel(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def fp64_reference(base, a, w, scale, g):
    """The exact sum (before its one rounding) and the exact gradients."""
    b64, a64, w64 = (t.detach().double().requires_grad_(t.requires_grad) for t in (base, a, w))
    out = b64 + F.linear(a64, w64) * scale
    out.backward(g.double())
    return out.detach(), b64.grad, a64.grad, w64.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("lead", [(7,), (2, 5)], ids=str)
@pytest.mark.parametrize("requires", [(True, True, True), (True, False, True), (False, True, False)], ids=str)
def test_reference_path_is_the_graphs_computation(dtype, lead, requires, gen):
    """Off the Triton path the op is peft's computation, op for op: the same values and gradients."""
    base, a, w = leaves(gen, lead, 16, 24, dtype, requires)
    g = torch.randn(*lead, 24, generator=gen).to(dtype)
    expected = (base + F.linear(a, w) * 2.0).to(dtype)
    expected.backward(g)
    ref = grads((base, a, w))
    for t in (base, a, w):
        t.grad = None
    out = lora_sum(base, a, w, 2.0)
    assert out.dtype == dtype and out.shape == expected.shape
    assert torch.equal(out, expected)
    out.backward(g)
    for name, got, want, t in zip(("base", "a", "B"), grads((base, a, w)), ref, (base, a, w), strict=True):
        if want is None:
            assert got is None, f"d{name} formed but not asked for"
            continue
        assert got.dtype == t.dtype, f"d{name} of dtype {got.dtype}"
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"d{name}")


def test_rejects_what_it_does_not_compute():
    with pytest.raises(ValueError, match="rank"):
        lora_sum(torch.randn(3, 8).half(), torch.randn(3, 4), torch.randn(8, 5))
    with pytest.raises(ValueError, match="base of shape"):
        lora_sum(torch.randn(3, 9).half(), torch.randn(3, 4), torch.randn(8, 4))


# --- the Triton path (a GPU, or the interpreter; fp16 only there) ------------------------------------------------

interpreter = pytest.mark.skipif(
    not (HAS_TRITON and interpreting()), reason="the Triton path runs on CPU only through the Triton interpreter"
)


@interpreter
@pytest.mark.parametrize("gpu_tiles", [False, True], ids=["cpu tiles", "gpu tiles"])
@pytest.mark.parametrize("lead, rank, n_out", [((37,), 8, 40), ((3, 100), 16, 200), ((2, 70), 64, 33)], ids=str)
def test_triton_kernels_match_fp64(lead, rank, n_out, gpu_tiles, gen, triton_path, monkeypatch):
    """One rounding of the fp32 sum in the forward; dbase is g exactly; da and dB within fp32 rounding of fp64.
    Rows, ranks and outputs off the tile edges, with the interpreter's tiles and with the GPU's."""
    if gpu_tiles:
        monkeypatch.setattr(U, "_CPU_CONFIGS", U.CONFIGS)
    base, a, w = leaves(gen, lead, rank, n_out, torch.float16)
    g = torch.randn(*lead, n_out, generator=gen).to(torch.float16)
    out = lora_sum(base, a, w, 0.5)
    out.backward(g)
    assert triton_path == ["_dx_triton", "_forward_triton", "_dw_triton"], triton_path
    exact, dbase, da, dw = fp64_reference(base, a, w, 0.5, g)
    assert out.dtype == torch.float16 and not out.isnan().any()
    within_one_rounding(out, exact, base, a, w, 0.5)
    assert torch.equal(base.grad, g)
    assert a.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    # fp32 sums over the outputs (da) and the rows (dB): relative errors of order 1e-7
    assert rel(a.grad, da) < 1e-6 and rel(w.grad, dw) < 1e-6, (rel(a.grad, da), rel(w.grad, dw))


@interpreter
@pytest.mark.parametrize("gpu_tiles", [False, True], ids=["cpu tiles", "gpu tiles"])
def test_a_sliced_from_a_shared_adapter_output(gpu_tiles, gen, triton_path, monkeypatch):
    """``a`` as one adapter's columns of a wider LoRA A output (``fuser::upcast_linear`` on q/k/v's concatenated
    weights, narrowed per adapter): the kernels read it at its row stride, in place, to the same bounds."""
    if gpu_tiles:
        monkeypatch.setattr(U, "_CPU_CONFIGS", U.CONFIGS)
    wide = torch.randn(3, 50, 24, generator=gen)
    a = wide.narrow(-1, 8, 8).requires_grad_()
    assert not a.is_contiguous() and U.as_rows(a).data_ptr() == a.data_ptr()
    read = []  # the address each dx / dW kernel launch reads its ``dy`` (here: a) from

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kw: read.append(args[0].data_ptr()) or self.kernel[grid](*args, **kw)

    for name in ("upcast_linear_dx_kernel", "upcast_linear_dw_kernel"):
        monkeypatch.setattr(U, name, Spy(getattr(U, name)))
    base, _, w = leaves(gen, (3, 50), 8, 40, torch.float16)
    g = torch.randn(3, 50, 40, generator=gen).to(torch.float16)
    out = lora_sum(base, a, w, 0.5)
    out.backward(g)
    assert triton_path == ["_dx_triton", "_forward_triton", "_dw_triton"], triton_path
    assert read == [a.data_ptr()] * 2, "a was copied before a kernel read it"
    exact, dbase, da, dw = fp64_reference(base, a, w, 0.5, g)
    within_one_rounding(out, exact, base, a, w, 0.5)
    assert rel(a.grad, da) < 1e-6 and rel(w.grad, dw) < 1e-6, (rel(a.grad, da), rel(w.grad, dw))


@pytest.mark.parametrize("path", ["reference", pytest.param("triton", marks=interpreter)])
@pytest.mark.parametrize("gpu_tiles", [False, True], ids=["cpu tiles", "gpu tiles"])
def test_half_adapter_as_autocast_rounds_it(path, gpu_tiles, gen, request, monkeypatch):
    """An adapter and ``a`` in the base's half dtype (autocast's rounded copies): the products of the half
    operands exact, fp32 sums, the sum rounded once; da and dB each rounded once to their half dtype."""
    launched = request.getfixturevalue("triton_path") if path == "triton" else None
    if gpu_tiles:
        monkeypatch.setattr(U, "_CPU_CONFIGS", U.CONFIGS)
    base, a, w = leaves(gen, (3, 40), 16, 72, torch.float16)
    a, w = (t.detach().to(torch.float16).requires_grad_() for t in (a, w))
    g = torch.randn(3, 40, 72, generator=gen).to(torch.float16)
    out = lora_sum(base, a, w, 0.5)
    out.backward(g)
    if launched is not None:
        assert launched == ["_dx_triton", "_forward_triton", "_dw_triton"], launched
    exact, dbase, da, dw = fp64_reference(base, a, w, 0.5, g)
    within_one_rounding(out, exact, base, a, w, 0.5)
    assert torch.equal(base.grad, g)
    assert a.grad.dtype == torch.float16 and w.grad.dtype == torch.float16
    # fp32 sums (of 72 outputs, of 120 rows), then one rounding to fp16
    for got, want in ((a.grad, da), (w.grad, dw)):
        torch.testing.assert_close(got, want.to(torch.float16), rtol=2.0**-10, atol=2.0**-14)


@interpreter
def test_triton_kernels_equal_the_reference_path_to_fp32_rounding(gen, triton_path, monkeypatch):
    base, a, w = leaves(gen, (3, 50), 16, 48, torch.float16)
    g = torch.randn(3, 50, 48, generator=gen).to(torch.float16)
    out = lora_sum(base, a, w, 2.0)
    out.backward(g)
    fused = (out.clone(), *grads((base, a, w)))
    for t in (base, a, w):
        t.grad = None
    ref = (base + F.linear(a, w) * 2.0).to(base.dtype)  # peft's graph, through autograd
    ref.backward(g)
    # the forward: the same fp32 sum up to its last bit, rounded once: at most one fp16 ulp apart
    assert ((fused[0].double() - ref.double()).abs() <= ref.double().abs() * 2.0**-10 + 2.0**-24).all()
    assert torch.equal(fused[1], base.grad)
    for got, want in zip(fused[2:], grads((a, w)), strict=True):
        assert rel(got, want) < 1e-6, rel(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rank, n_out", [(16, 4096), (16, 14336), (64, 4096)], ids=str)
def test_gpu_half_adapter_at_lora_shapes(dtype, rank, n_out):
    """Autocast's rounded adapter on the GPU's tensor cores (native half dots): the sum within one rounding of the
    exact sum of the half operands, da and dB within one half rounding of theirs (fp32 sums over 8192 rows)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(4, 2048, n_out, device="cuda", generator=gen).to(dtype).requires_grad_()
    a = torch.randn(4, 2048, rank, device="cuda", generator=gen).to(dtype).requires_grad_()
    w = (0.02 * torch.randn(n_out, rank, device="cuda", generator=gen)).to(dtype).requires_grad_()
    g = torch.randn(4, 2048, n_out, device="cuda", generator=gen).to(dtype)
    assert module.triton_path(base, a, w)
    exact, dbase, da, dw = fp64_reference(base, a, w, 2.0, g)
    out = lora_sum(base, a, w, 2.0)
    out.backward(g)
    within_one_rounding(out, exact, base, a, w, 2.0)
    eps = torch.finfo(dtype).eps
    for name, got, want in (("da", a.grad, da), ("dB", w.grad, dw)):
        assert got.dtype == dtype
        excess = (got.double() - want).abs() - (want.abs() * eps / 2 + want.abs().max() * 1e-5)
        assert (excess <= 0).all(), f"{name}: {(excess > 0).sum().item()} elements beyond one rounding"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rank, n_out", [(16, 4096), (16, 14336), (64, 4096), (8, 1024)], ids=str)
def test_gpu_triton_path_at_lora_shapes(dtype, rank, n_out, monkeypatch):
    """The Triton path on the GPU at Llama-3-8B LoRA-B shapes (8192 rows) against fp64, to the same bounds as the
    reference path (cuBLAS fp32; ``allow_triton=False``)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(4, 2048, n_out, device="cuda", generator=gen).to(dtype).requires_grad_()
    a = torch.randn(4, 2048, rank, device="cuda", generator=gen).requires_grad_()
    w = (0.02 * torch.randn(n_out, rank, device="cuda", generator=gen)).requires_grad_()
    g = torch.randn(4, 2048, n_out, device="cuda", generator=gen).to(dtype)
    exact, dbase, da, dw = fp64_reference(base, a, w, 2.0, g)
    for flag in ("1", "0"):
        assert module.triton_path(base, a, w, allow_triton=flag == "1") == (flag == "1")
        for t in (base, a, w):
            t.grad = None
        out = lora_sum(base, a, w, 2.0, allow_triton=flag == "1")
        out.backward(g)
        assert torch.equal(base.grad, g)
        within_one_rounding(out, exact, base, a, w, 2.0)
        for name, got, want in (("da", a.grad, da), ("dB", w.grad, dw)):
            err = rel(got, want)
            assert err < 1e-5, f"allow_triton={flag}: {name} relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_round_term_reference_path_is_peft_bitsandbytes_order(dtype, gen):
    """``round_term``: the scaled term rounded to the base dtype, then added there (peft's QLoRA layers): the same
    values as that graph, and the same gradients as without ``round_term`` (the same functions of g)."""
    base, a, w = leaves(gen, (2, 5), 16, 24, dtype)
    g = torch.randn(2, 5, 24, generator=gen).to(dtype)
    expected = base + (F.linear(a, w) * 2.0).to(dtype)
    expected.backward(g)
    ref = grads((base, a, w))
    for t in (base, a, w):
        t.grad = None
    out = lora_sum(base, a, w, 2.0, round_term=True)
    assert torch.equal(out, expected)
    assert not torch.equal(out, lora_sum(base, a, w, 2.0))  # the two orders round differently somewhere
    out.backward(g)
    for got, want in zip(grads((base, a, w)), ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@interpreter
def test_round_term_triton_kernel_rounds_the_term_first(gen, triton_path):
    base, a, w = leaves(gen, (3, 40), 16, 72, torch.float16)
    out = lora_sum(base, a, w, 0.5, round_term=True)
    term = (F.linear(a, w) * 0.5).detach()
    expected = base + term.to(torch.float16)
    # the fp32 term may differ from the reference's in its last bits: one rounding of the term and one of the sum
    # may each land one fp16 ulp apart, no more
    bound = (term.abs() + expected.float().abs()) * 2.0**-10 + 2.0**-23
    assert ((out.float() - expected.float()).abs() <= bound).all()
    unrounded = lora_sum(base, a, w, 0.5)
    assert not torch.equal(out, unrounded)  # the kernel did round the term first


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_round_term_at_a_lora_shape(dtype, monkeypatch):
    """QLoRA's order on the GPU: the Triton path within one rounding of the term and one of the sum of the
    reference path's values (cuBLAS fp32), and the same gradients as without ``round_term``."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    base = torch.randn(8192, 4096, device="cuda", generator=gen).to(dtype)
    a = torch.randn(8192, 16, device="cuda", generator=gen)
    w = 0.02 * torch.randn(4096, 16, device="cuda", generator=gen)
    expected = lora_sum(base, a, w, 2.0, round_term=True, allow_triton=False)
    term = (F.linear(a, w) * 2.0).abs()
    out = lora_sum(base, a, w, 2.0, round_term=True)
    eps = torch.finfo(dtype).eps
    assert ((out.float() - expected.float()).abs() <= (term + expected.float().abs()) * eps + 1e-30).all()
    assert not torch.equal(out, lora_sum(base, a, w, 2.0))


# --- fuser::gated_activation_of_lora_sums: the wide gate/up sums and their gated product, in row slices ------------


def gated_of_sums_inputs(gen, lead=(3, 11), rank=8, n_cols=48, dtype=torch.float16):
    """Gate's and up's bases (half), LoRA a (fp32, one per sum) and B (fp32 [n_cols, rank]), and two scales."""
    g_base, u_base = (torch.randn(*lead, n_cols, generator=gen).to(dtype) for _ in range(2))
    g_a, u_a = (torch.randn(*lead, rank, generator=gen) for _ in range(2))
    g_w, u_w = (0.3 * torch.randn(n_cols, rank, generator=gen) for _ in range(2))
    return (g_base, g_a, g_w, 0.5), (u_base, u_a, u_w, 2.0)


def three_calls(gate, up, activation):
    """What the post-grad pass replaces: lora_sum_wide of each, then the gated op on their results."""
    ops = torch.ops.fuser
    g_out, g_wide = ops.lora_sum_wide(*gate)
    u_out, u_wide = ops.lora_sum_wide(*up)
    product = ops.gated_activation(g_out, u_out, None, None, 1.0, 1.0, activation, gate_wide=g_wide, up_wide=u_wide)[0]
    return product, g_out, u_out


def check_gated_of_sums(gen, monkeypatch, slice_rows, activation):
    gate, up = gated_of_sums_inputs(gen)
    n_cols = gate[0].shape[-1]
    want = three_calls(gate, up, activation)
    if slice_rows is not None:  # slices that do not divide the 33 rows: two of 12, one of 9
        monkeypatch.setattr(module, "WIDE_SLICE_BYTES", slice_rows * 4 * n_cols)
    got = torch.ops.fuser.gated_activation_of_lora_sums(*gate, True, *up, True, activation)
    for name, g, w in zip(("product", "gate sum", "up sum"), got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous(), name
        assert not g.isnan().any() and torch.equal(g, w), f"{name}: {(g.float() - w.float()).abs().max()}"
    # and the product is the gated activation of the fp32 sums, rounded once (fp64 check of the whole chain)
    sums = [p[0].double() + p[3] * (p[1].double() @ p[2].double().t()) for p in (gate, up)]
    act = F.silu(sums[0]) if activation == "silu" else F.gelu(sums[0], approximate="tanh")
    exact = act * sums[1]
    err = ((got[0].double() - exact).abs() / exact.abs().clamp_min(1e-3)).max().item()
    assert err <= 2.0**-10, err  # fp16: within one rounding (2^-11 relative) plus fp32 arithmetic


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("slice_rows", [None, 12], ids=["whole", "slices"])
def test_gated_activation_of_lora_sums_is_the_three_calls_reference(slice_rows, activation, gen, monkeypatch):
    """On the reference path, whole or in slices (the last one short): the product and both rounded sums equal
    lora_sum_wide ×2 + gated_activation's bit for bit, and the product is fp64's within one fp16 rounding."""
    check_gated_of_sums(gen, monkeypatch, slice_rows, activation)


@interpreter
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("slice_rows", [None, 12], ids=["whole", "slices"])
def test_gated_activation_of_lora_sums_is_the_three_calls_triton(slice_rows, activation, gen, triton_path, monkeypatch):
    """The same through the Triton kernels (interpreter, every buffer NaN-filled first): bit for bit the three
    calls' results, one lora-sum kernel per sum and slice."""
    check_gated_of_sums(gen, monkeypatch, slice_rows, activation)
    slices = 1 if slice_rows is None else 3
    assert triton_path == ["_dx_triton"] * (2 + 2 * slices), triton_path
