"""Tier 2: ``fuser::upcast_linear`` — the values and gradients of ``F.linear(x.to(W.dtype), W, b)``, with ``x``
(not its fp32 copy) saved for the backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fuser.kernels.upcast_linear as module
from fuser.kernels._triton import HAS_TRITON, interpreting
from fuser.kernels.upcast_linear import upcast_linear


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def leaves(gen, lead, n_in, n_out, dtype, bias, requires):
    x = torch.randn(*lead, n_in, generator=gen).to(dtype).requires_grad_(requires[0])
    w = (0.1 * torch.randn(n_out, n_in, generator=gen)).requires_grad_(requires[1])
    b = torch.randn(n_out, generator=gen).requires_grad_(requires[2]) if bias else None
    return x, w, b


def grads(ts):
    return [None if t is None or t.grad is None else t.grad.clone() for t in ts]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("lead", [(7,), (2, 5)], ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("requires", [(True, True, True), (True, False, False), (False, True, True)], ids=str)
def test_same_values_and_gradients_as_the_upcast_linear(dtype, lead, bias, requires, gen):
    x, w, b = leaves(gen, lead, 24, 16, dtype, bias, requires)
    dy = torch.randn(*lead, 16, generator=gen)
    expected = F.linear(x.to(torch.float32), w, b)
    expected.backward(dy)
    ref = grads((x, w, b))
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    out = upcast_linear(x, w, b)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    assert torch.equal(out, expected), "forward is not the same fp32 linear of the same upcast values"
    out.backward(dy)
    for name, g, r, t in zip(("x", "weight", "bias"), grads((x, w, b)), ref, (x, w, b), strict=True):
        if r is None:
            assert g is None, f"d{name} formed but not asked for"
            continue
        assert g.dtype == t.dtype, f"d{name} of dtype {g.dtype}"
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6, msg=f"d{name}")
    # and against fp64 (the fp32 path is as accurate as eager's: x is exact in fp32)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    F.linear(x64, w64, None if b is None else b.detach().double()).backward(dy.double())
    if requires[1]:
        torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)


def test_saves_the_half_precision_input_not_its_upcast_copy(gen):
    x, w, b = leaves(gen, (2, 5), 24, 16, torch.bfloat16, False, (True, True, False))
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        upcast_linear(x, w).sum().backward()
    assert (torch.bfloat16, (2, 5, 24)) in saved, saved
    assert (torch.float32, (2, 5, 24)) not in saved and (torch.float32, (10, 24)) not in saved, saved
    # what eager keeps, for contrast: the fp32 copy
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.linear(x.float(), w).sum().backward()
    assert any(dt == torch.float32 and shape[-1] == 24 for dt, shape in saved), saved


# ---------------------------------------------------------------------------------------------------------
# upcast_linear_gated: the same op on a gated MLP's product, recomputed in the backward instead of saved
# ---------------------------------------------------------------------------------------------------------


def gated_leaves(gen, dtype, activation="silu"):
    import fuser.kernels.gated_activation  # noqa: F401  (registers torch.ops.fuser.gated_activation)

    gate = torch.randn(2, 5, 24, generator=gen).to(dtype).requires_grad_()
    up = torch.randn(2, 5, 24, generator=gen).to(dtype).requires_grad_()
    w = (0.1 * torch.randn(16, 24, generator=gen)).requires_grad_()
    return gate, up, w, lambda g, u: torch.ops.fuser.gated_activation(g, u, None, None, 1.0, 1.0, activation)[0]


@pytest.mark.parametrize("path", ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    not (HAS_TRITON and interpreting()), reason="needs the Triton interpreter"))])  # fmt: skip
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_input_recomputed_gives_the_same_gradients(path, activation, gen, triton_on_cpu):
    """``upcast_linear_gated(x, gate, up, W)`` with ``x = gated_activation(gate, up)``: the same output as
    ``upcast_linear(x, W)`` and the same gradients for gate, up (through x) and W, bit for bit (x is recomputed by
    the gated op's own forward), while gate and up, not x, are what it saves (fp16: the interpreter's bf16 is
    broken)."""
    if path == "triton":
        triton_on_cpu()
    dtype = torch.float16 if path == "triton" else torch.bfloat16
    gate, up, w, act = gated_leaves(gen, dtype, activation)
    dy = torch.randn(2, 5, 16, generator=gen)
    x = act(gate, up)
    expected = upcast_linear(x, w)
    expected.backward(dy)
    ref = grads((gate, up, w))
    for t in (gate, up, w):
        t.grad = None
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        x = act(gate, up)
        n_saved_by_gated = len(saved)
        out = torch.ops.fuser.upcast_linear_gated(x, gate, up, w, None, 1.0, 1.0, activation)
    assert torch.equal(out, expected)
    mine = saved[n_saved_by_gated:]
    assert not any(t.data_ptr() == x.data_ptr() for t in mine), "x was saved"
    assert {t.data_ptr() for t in mine} >= {gate.data_ptr(), up.data_ptr()}
    out.backward(dy)
    for name, g, r in zip(("gate", "up", "weight"), grads((gate, up, w)), ref, strict=True):
        assert g is not None and torch.equal(g, r), f"d{name} differs from upcast_linear's"


def test_gated_input_opcheck(gen):
    gate, up, w, act = gated_leaves(gen, torch.bfloat16)
    x = act(gate, up).detach().requires_grad_()
    dy = torch.randn(2, 5, 16, generator=gen)
    args = (x, gate.detach(), up.detach(), w, None, 1.0, 1.0, "silu")
    torch.library.opcheck(torch.ops.fuser.upcast_linear_gated.default, args)
    grads_args = (dy, gate.detach(), up.detach(), w.detach(), 1.0, 1.0, "silu", True, True)
    torch.library.opcheck(torch.ops.fuser.upcast_linear_gated_grads.default, grads_args)


def test_rejects_bad_arguments():
    x = torch.randn(3, 8).bfloat16()
    with pytest.raises(ValueError, match=r"weight \[out, in\] with in = x.shape\[-1\] = 8, got \(4, 7\)"):
        upcast_linear(x, torch.randn(4, 7))
    with pytest.raises(ValueError, match=r"bias \[4\] of the weight's dtype torch.float32, got \(5,\)"):
        upcast_linear(x, torch.randn(4, 8), torch.randn(5))
    with pytest.raises(ValueError, match="floating-point"):
        upcast_linear(torch.ones(3, 8, dtype=torch.long), torch.randn(4, 8))


# --- the Triton path (on by default on a GPU; here through the interpreter, fp16 only) -------------------------

interpreter = pytest.mark.skipif(
    not (HAS_TRITON and interpreting()), reason="the Triton path runs on CPU only through the Triton interpreter"
)


@interpreter
@pytest.mark.parametrize(
    "lead, n_in, n_out, row_pad",
    [((37,), 40, 8, 0), ((3, 100), 96, 24, 0), ((2, 150), 64, 16, 24), ((5,), 33, 64, 7)],
    ids=str,
)
def test_triton_kernels_match_fp64(lead, n_in, n_out, row_pad, gen, triton_path):
    """fp32 products and sums: within fp32 rounding of the fp64 result; x may have a row stride wider than its
    row (a slice of a wider tensor); rows, inputs and outputs off the block sizes."""
    wide = torch.randn(*lead, n_in + row_pad, generator=gen).to(torch.float16)
    x = wide[..., :n_in].requires_grad_()
    w = (0.1 * torch.randn(n_out, n_in, generator=gen)).requires_grad_()
    b = torch.randn(n_out, generator=gen).requires_grad_()
    dy = torch.randn(*lead, n_out, generator=gen)
    out = upcast_linear(x, w, b)
    out.backward(dy)
    assert triton_path == ["_forward_triton", "_dx_triton", "_dw_triton"], triton_path
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = F.linear(x64, w64, b64)
    ref.backward(dy.double())
    assert out.dtype == torch.float32 and x.grad.dtype == torch.float16 and w.grad.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)
    # dx: fp32 sums rounded once to fp16, as eager's (dy @ W).to(fp16)
    torch.testing.assert_close(x.grad, x64.grad.to(torch.float16), rtol=2.0**-10, atol=2.0**-14)
    torch.testing.assert_close(b.grad.double(), b64.grad, rtol=1e-5, atol=1e-5)  # fp32 sums of up to 300 rows


@interpreter
def test_triton_kernels_with_the_gpu_tiles_match_fp64(gen, triton_path, monkeypatch):
    """The GPU's launch configurations (tile sizes, row splits) through the interpreter: rows, inputs and outputs
    off every tile edge. The interpreter ignores the dots' precision (tf32x3 on a GPU: the GPU test checks it)."""
    monkeypatch.setattr(module, "_CPU_CONFIGS", module.CONFIGS)
    x = torch.randn(3, 100, 200, generator=gen).to(torch.float16).requires_grad_()  # 300 rows
    w = (0.1 * torch.randn(24, 200, generator=gen)).requires_grad_()
    dy = torch.randn(3, 100, 24, generator=gen)
    out = upcast_linear(x, w)
    out.backward(dy)
    assert triton_path == ["_forward_triton", "_dx_triton", "_dw_triton"], triton_path
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    F.linear(x64, w64).backward(dy.double())
    torch.testing.assert_close(out.double(), F.linear(x64, w64).detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x64.grad.to(torch.float16), rtol=2.0**-10, atol=2.0**-14)


@interpreter
@pytest.mark.parametrize("split_k", [2, 3, 7])
def test_forward_with_the_inputs_split_matches_fp64(split_k, gen, triton_path, monkeypatch):
    """The forward with its inputs in splits (summed after, in a fixed order): 200 inputs in 32-wide tiles leave
    a short last tile and, at 7 splits, splits of one tile; every row written, none twice."""
    monkeypatch.setitem(module._CPU_CONFIGS, "fwd", {**module._CPU_CONFIGS["fwd"], "SPLIT_K": split_k})
    x = torch.randn(3, 30, 200, generator=gen).to(torch.float16)
    w = 0.1 * torch.randn(24, 200, generator=gen)
    out = upcast_linear(x, w)
    assert triton_path == ["_forward_triton"]
    torch.testing.assert_close(out.double(), F.linear(x.double(), w.double()), rtol=1e-5, atol=1e-5)
    monkeypatch.setitem(module._CPU_CONFIGS, "fwd", {**module._CPU_CONFIGS["fwd"], "SPLIT_K": 1})
    assert torch.equal(upcast_linear(x, w), upcast_linear(x, w))  # deterministic at one split as well


@interpreter
@pytest.mark.parametrize("gpu_tiles", [False, True], ids=["cpu tiles", "gpu tiles"])
def test_triton_kernels_with_a_half_weight_match_fp64(gpu_tiles, gen, triton_path, monkeypatch):
    """A weight in x's half dtype (an adapter autocast rounded): the dots take both operands as they are (each
    product exact), fp32 sums, each result rounded once to the half dtype, as autocast's matmuls round."""
    if gpu_tiles:
        monkeypatch.setattr(module, "_CPU_CONFIGS", module.CONFIGS)
    x = torch.randn(3, 100, 200, generator=gen).to(torch.float16).requires_grad_()
    w = (0.1 * torch.randn(24, 200, generator=gen)).to(torch.float16).requires_grad_()
    dy = torch.randn(3, 100, 24, generator=gen).to(torch.float16)
    out = upcast_linear(x, w)
    out.backward(dy)
    assert triton_path == ["_forward_triton", "_dx_triton", "_dw_triton"], triton_path
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.linear(x64, w64)
    ref.backward(dy.double())
    assert out.dtype == x.grad.dtype == w.grad.dtype == torch.float16
    for got, want in ((out, ref.detach()), (x.grad, x64.grad), (w.grad, w64.grad)):
        torch.testing.assert_close(got, want.to(torch.float16), rtol=2.0**-10, atol=2.0**-14)


@interpreter
def test_triton_kernels_are_deterministic(gen, triton_path):
    x = torch.randn(300, 48, generator=gen).to(torch.float16).requires_grad_()  # 3 row splits of the weight grad
    w = (0.1 * torch.randn(16, 48, generator=gen)).requires_grad_()
    dy = torch.randn(300, 16, generator=gen)
    results = []
    for _ in range(2):
        x.grad = w.grad = None
        out = upcast_linear(x, w)
        out.backward(dy)
        results.append((out.clone(), x.grad.clone(), w.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_triton_path_is_on_by_default_and_only_for_narrow_fp32_or_matching_half_weights(triton_on_cpu):
    x = torch.randn(4, 8).half()
    assert not module.triton_path(x, torch.randn(16, 8))  # CPU tensors: the reference, unless asked
    triton_on_cpu()
    assert module.triton_path(x, torch.randn(16, 8)) == (HAS_TRITON and interpreting())
    assert not module.triton_path(x, torch.randn(16, 8), allow_triton=False)  # switched off
    assert not module.triton_path(x, torch.randn(65, 8))  # wider than a LoRA rank
    assert not module.triton_path(x.float(), torch.randn(16, 8))  # nothing to upcast
    assert module.triton_path(x, torch.randn(16, 8).half()) == (HAS_TRITON and interpreting())  # autocast's copy
    assert not module.triton_path(x, torch.randn(16, 8).bfloat16())  # a half weight of another dtype


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n_in, n_out", [(4096, 16), (14336, 16), (4096, 64), (4096, 8)], ids=str)
def test_gpu_triton_path_at_lora_shapes(dtype, n_in, n_out):
    """The Triton kernels on the GPU (the default; tf32x3 dots) at Llama-3-8B LoRA-A shapes, 8192 rows, against
    fp64, and cuBLAS's fp32 path (``allow_triton=False``) to the same bounds (dx: one bf16/fp16 rounding)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4, 2048, n_in, device="cuda", generator=gen).to(dtype).requires_grad_()
    w = (0.02 * torch.randn(n_out, n_in, device="cuda", generator=gen)).requires_grad_()
    dy = torch.randn(4, 2048, n_out, device="cuda", generator=gen)
    results = {}
    for flag in (False, True):
        x.grad = w.grad = None
        out = upcast_linear(x, w, allow_triton=flag)
        out.backward(dy)
        results[flag] = (out.double(), x.grad.double(), w.grad.double())
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.linear(x64, w64)
    ref.backward(dy.double())
    for flag, (out, dx, dw) in results.items():
        for name, got, want, tol in (("y", out, ref, 1e-5), ("dW", dw, w64.grad, 1e-5), ("dx", dx, x64.grad, 4e-3)):
            err = ((got - want).norm() / want.norm()).item()
            assert err < tol, f"allow_triton={flag}: {name} relative error {err:.2e}"


TRITON_OR_REFERENCE = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    not (HAS_TRITON and interpreting()), reason="needs the Triton interpreter"))]  # fmt: skip


def big_gated_inputs(gen, dtype, rows=1000, n_in=40, n_out=8):
    gate = torch.randn(rows, n_in, generator=gen).to(dtype)
    up = torch.randn(rows, n_in, generator=gen).to(dtype)
    w = 0.1 * torch.randn(n_out, n_in, generator=gen)
    dy = torch.randn(rows, n_out, generator=gen)
    return dy, gate, up, w


@pytest.mark.parametrize("path", TRITON_OR_REFERENCE)
def test_gated_weight_gradient_in_row_slices(path, gen, monkeypatch, triton_on_cpu):
    """With a small ``GATED_RECOMPUTE_BYTES`` the product is recomputed 256 rows at a time (4 slices, the last one
    short): dW within fp32 rounding of the unsliced one and of fp64 (of the same fp16 product), dx unchanged."""
    if path == "triton":
        triton_on_cpu()
    dy, gate, up, w = big_gated_inputs(gen, torch.float16)
    whole = torch.ops.fuser.upcast_linear_gated_grads(dy, gate, up, w, 1.0, 1.0, "silu", True, True)
    monkeypatch.setattr(module, "GATED_RECOMPUTE_BYTES", 256 * 40 * 2)
    sliced = torch.ops.fuser.upcast_linear_gated_grads(dy, gate, up, w, 1.0, 1.0, "silu", True, True)
    assert torch.equal(sliced[0], whole[0])
    x = torch.ops.fuser.gated_activation(gate, up, None, None, 1.0, 1.0, "silu")[0]  # the product as the forward had it
    dw64 = dy.double().t() @ x.double()
    for dw in (whole[1], sliced[1]):
        assert ((dw.double() - dw64).norm() / dw64.norm()).item() < 1e-6
    assert ((sliced[1] - whole[1]).norm() / whole[1].norm()).item() < 1e-6


@pytest.mark.parametrize("path", TRITON_OR_REFERENCE)
@pytest.mark.parametrize("need_w", [True, False])
def test_gated_grads_accumulated_into_the_base_gradient(path, need_w, gen, triton_on_cpu):
    """``upcast_linear_gated_grads_acc_(acc, ...)``: ``acc`` becomes exactly ``acc + dx`` as the ``add`` it
    replaces rounds it, and the returned dW is the out-of-place op's."""
    if path == "triton":
        triton_on_cpu()
    dy, gate, up, w = big_gated_inputs(gen, torch.float16, rows=77)
    dx, dw = torch.ops.fuser.upcast_linear_gated_grads(dy, gate, up, w, 1.0, 1.0, "gelu_tanh", True, need_w)
    acc = torch.randn(77, 40, generator=gen).to(torch.float16)
    expected = acc + dx
    dw_acc = torch.ops.fuser.upcast_linear_gated_grads_acc_(acc, dy, gate, up, w, 1.0, 1.0, "gelu_tanh", need_w)
    assert torch.equal(acc, expected)
    assert torch.equal(dw_acc, dw) if need_w else dw_acc.numel() == 0


def test_gated_grads_acc_opcheck(gen):
    dy, gate, up, w = big_gated_inputs(gen, torch.bfloat16, rows=9)
    args = (torch.randn(9, 40, generator=gen).bfloat16(), dy, gate, up, w, 1.0, 1.0, "silu", True)
    torch.library.opcheck(torch.ops.fuser.upcast_linear_gated_grads_acc_.default, args)


# --- fuser::upcast_linear_normed: x an RMSNorm's output, rebuilt from the norm's input in the backward ----------


def normed_leaves(gen, dtype, lead=(3, 50), n_in=40, n_out=12, weight=True, offset=0.0):
    """h, the norm weight, and x = fuser's rms_norm(h) with its rstd (the op's inputs as the refinement wires them)."""
    h = torch.randn(*lead, n_in, generator=gen).to(dtype)
    nw = (1.0 + 0.1 * torch.randn(n_in, generator=gen)).to(dtype) if weight else None
    x, rstd = torch.ops.fuser.rms_norm(h, nw, 1e-6, offset, None, None)
    w = (0.1 * torch.randn(n_out, n_in, generator=gen)).requires_grad_()
    return h, nw, x.detach().requires_grad_(), rstd, w


@pytest.mark.parametrize("weight, offset", [(True, 0.0), (True, 1.0), (False, 0.0)], ids=["llama", "gemma", "none"])
@pytest.mark.parametrize("path", ["reference", "triton"])
def test_normed_op_rebuilds_the_norms_output_and_matches_upcast_linear(path, weight, offset, gen, request):
    """The rebuilt x is the norm's output bit for bit; forward, dx and dW equal upcast_linear's on that x (dW on the
    Triton path rebuilt inside its kernel: equal to the kernel fed the rebuilt x)."""
    if path == "triton":
        if not (HAS_TRITON and interpreting()):
            pytest.skip("the Triton path runs on CPU only through the Triton interpreter")
        launched = request.getfixturevalue("triton_path")
    h, nw, x, rstd, w = normed_leaves(gen, torch.float16, weight=weight, offset=offset)
    assert torch.equal(module.normed_reference(h, rstd, nw, offset), x.detach())
    dy = torch.randn(3, 50, 12, generator=gen)
    out = torch.ops.fuser.upcast_linear_normed(x, h, rstd, nw, offset, w, None)
    out.backward(dy)
    got = (out.detach(), x.grad, w.grad)
    x.grad = w.grad = None
    ref = upcast_linear(x, w)
    ref.backward(dy)
    assert torch.equal(got[0], ref.detach()) and torch.equal(got[1], x.grad)
    assert torch.equal(got[2], w.grad)
    if path == "triton":
        assert launched.count("_dw_triton") == 2, launched
    # and against fp64: the weight gradient of the norm's output within fp32 rounding
    exact = dy.double().reshape(-1, 12).t() @ x.detach().double().reshape(-1, 40)
    torch.testing.assert_close(got[2].double(), exact, rtol=1e-5, atol=1e-5)


def test_normed_op_saves_the_norms_input_not_its_output(gen):
    h, nw, x, rstd, w = normed_leaves(gen, torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.ops.fuser.upcast_linear_normed(x, h, rstd, nw, 0.0, w, None)
    assert any(t is h for t in saved) and not any(t.data_ptr() == x.data_ptr() for t in saved)


def test_normed_op_opcheck(gen):
    h, nw, x, rstd, w = normed_leaves(gen, torch.bfloat16)
    torch.library.opcheck(torch.ops.fuser.upcast_linear_normed.default, (x, h, rstd, nw, 0.0, w, None))


@pytest.mark.gpu
@pytest.mark.parametrize("rank, offset", [(48, 0.0), (32, 1.0)], ids=["q/k/v r16 grouped", "gate/up, (1 + w)"])
def test_gpu_normed_op_at_llama_shapes(rank, offset):
    """On the GPU at Llama-3-8B widths (8192 rows × 4096): the norm's output rebuilt in the weight-gradient kernel
    gives the very dW of the kernel fed the norm's output (the same rounded values, the same dot), within fp32
    rounding of fp64."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(4, 2048, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    nw = (1.0 + 0.1 * torch.randn(4096, device="cuda", generator=gen)).to(torch.bfloat16)
    y, rstd = torch.ops.fuser.rms_norm(h, nw, 1e-5, offset, None, None)
    assert torch.equal(module.normed_reference(h, rstd, nw, offset), y)
    w = 0.02 * torch.randn(rank, 4096, device="cuda", generator=gen)
    dy = torch.randn(4, 2048, rank, device="cuda", generator=gen)
    dx, dw = torch.ops.fuser.upcast_linear_normed_grads(dy, h, rstd, nw, offset, w, True, True)
    dx_ref, dw_ref = torch.ops.fuser.upcast_linear_grads(dy, y, w, True, True)
    assert torch.equal(dx, dx_ref) and torch.equal(dw, dw_ref)
    exact = dy.double().reshape(-1, rank).t() @ y.double().reshape(-1, 4096)
    err = ((dw.double() - exact).norm() / exact.norm()).item()
    assert err < 1e-5, err


@interpreter
def test_normed_op_allow_triton_false_keeps_the_reference_path(gen, triton_path):
    """``allow_triton=False`` reaches the backward (the op's last argument): no Triton kernel runs either way."""
    h, nw, x, rstd, w = normed_leaves(gen, torch.float16)
    out = torch.ops.fuser.upcast_linear_normed(x, h, rstd, nw, 0.0, w, None, allow_triton=False)
    out.backward(torch.randn(out.shape, generator=gen))
    assert triton_path == [] and x.grad is not None and w.grad is not None
