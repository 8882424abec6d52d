"""Tier 2: ``fuser::linear_normed`` — a trainable projection of an RMSNorm's output whose backward rebuilds that
output from the norm's input and rstd instead of saving it: the values and gradients of ``F.linear`` on the norm's
output, what it saves, and (compiled) one rebuild for the several projections of one norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

import fuser.kernels.linear_normed  # noqa: F401  (registers torch.ops.fuser.linear_normed)
from fuser.kernels.upcast_linear import normed_reference

NORMS = {"llama": (True, 0.0), "gemma": (True, 1.0), "no weight": (False, 0.0)}


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def normed(gen, dtype, lead=(3, 20), n_in=40, norm="llama"):
    """h, the norm weight and offset, and y = fuser's rms_norm(h) with its rstd, as the refinement wires them."""
    weight, offset = NORMS[norm]
    h = torch.randn(*lead, n_in, generator=gen).to(dtype)
    nw = (1.0 + 0.1 * torch.randn(n_in, generator=gen)).to(dtype) if weight else None
    y, rstd = torch.ops.fuser.rms_norm(h, nw, 1e-6, offset, None, None)
    return h, nw, offset, y.detach().requires_grad_(), rstd


def projection(gen, n_out, n_in, dtype, bias):
    w = (0.1 * torch.randn(n_out, n_in, generator=gen)).to(dtype).requires_grad_()
    b = (0.1 * torch.randn(n_out, generator=gen)).to(dtype).requires_grad_() if bias else None
    return w, b


@pytest.mark.parametrize("norm", sorted(NORMS))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "dtype, weight_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)],
    ids=["fp32", "bf16", "fp16"],
)
def test_same_values_and_gradients_as_the_linear_of_the_norms_output(dtype, weight_dtype, bias, norm, gen):
    """Forward, dy, dW and db bit for bit those of ``F.linear`` on the norm's output: the rebuilt value is that
    output exactly (the same formula, the same rounding), and the matmuls are the same calls."""
    h, nw, offset, y, rstd = normed(gen, dtype, norm=norm)
    assert torch.equal(normed_reference(h, rstd, nw, offset), y.detach())
    w, b = projection(gen, 24, 40, weight_dtype, bias)
    dout = torch.randn(3, 20, 24, generator=gen).to(dtype)
    out = torch.ops.fuser.linear_normed(y, h, rstd, nw, offset, w, b, dtype)
    assert out.dtype == dtype
    out.backward(dout)
    got = [out.detach(), y.grad, w.grad, None if b is None else b.grad]
    y.grad = w.grad = None
    if b is not None:
        b.grad = None
    ref = F.linear(y, w, b)
    ref.backward(dout)
    expected = [ref.detach(), y.grad, w.grad, None if b is None else b.grad]
    for name, g, r in zip(("out", "dy", "dW", "db"), got, expected, strict=True):
        assert (g is None) == (r is None), name
        if r is not None:
            assert g.dtype == r.dtype and torch.equal(g, r), name
    # and against fp64: dW of the norm's output within the dtype's rounding of the matmul
    exact = dout.double().reshape(-1, 24).t() @ y.detach().double().reshape(-1, 40)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[2].double(), exact, rtol=tol, atol=tol)


@pytest.mark.parametrize("bias", [False, True])
def test_autocast_fp32_master_weights(bias, gen):
    """An fp32 norm output and fp32 weights computed in bf16 (autocast's linear): the op casts y, W and b to bf16
    as autocast does, and the gradients come back fp32, equal to autocast's."""
    h, nw, offset, y, rstd = normed(gen, torch.float32)
    w, b = projection(gen, 24, 40, torch.float32, bias)
    dout = torch.randn(3, 20, 24, generator=gen).to(torch.bfloat16)
    out = torch.ops.fuser.linear_normed(y, h, rstd, nw, offset, w, b, torch.bfloat16)
    out.backward(dout)
    got = [out.detach(), y.grad, w.grad, None if b is None else b.grad]
    y.grad = w.grad = None
    if b is not None:
        b.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.linear(y, w, b)
    ref.backward(dout)
    expected = [ref.detach(), y.grad, w.grad, None if b is None else b.grad]
    for name, g, r in zip(("out", "dy", "dW", "db"), got, expected, strict=True):
        if r is not None:
            assert g.dtype == r.dtype and torch.equal(g, r), name
    assert got[2].dtype == torch.float32 and got[1].dtype == torch.float32


def test_saves_the_norms_input_not_its_output(gen):
    h, nw, offset, y, rstd = normed(gen, torch.bfloat16)
    w, _ = projection(gen, 24, 40, torch.bfloat16, False)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.ops.fuser.linear_normed(y, h, rstd, nw, offset, w, None, torch.bfloat16)
    assert any(t is h for t in saved) and any(t is rstd for t in saved)
    assert not any(t.data_ptr() == y.data_ptr() for t in saved)


def test_opcheck(gen):
    h, nw, offset, y, rstd = normed(gen, torch.bfloat16)
    w, b = projection(gen, 24, 40, torch.bfloat16, True)
    torch.library.opcheck(torch.ops.fuser.linear_normed.default, (y, h, rstd, nw, offset, w, b, torch.bfloat16))


def three_projections(h, nw, ws):
    """q/k/v-like: one norm, three projections of its output, each through linear_normed."""
    y, rstd = torch.ops.fuser.rms_norm(h, nw, 1e-6, 0.0, None, None)
    outs = [torch.ops.fuser.linear_normed(y, h, rstd, nw, 0.0, w, None, h.dtype) for w in ws]
    return sum(o.float().square().sum() for o in outs)


def test_compiled_backward_rebuilds_once_for_the_projections_of_one_norm(gen):
    """AOT autograd traces the op's backward into aten: under Inductor's partitioner the three projections' rebuilds
    (the same ops on the same inputs) are merged into one by common-subexpression elimination, and the forward saves
    neither the norm's output nor a rebuilt copy."""
    h = torch.randn(2, 8, 40, generator=gen).to(torch.bfloat16).requires_grad_()
    nw = (1.0 + 0.1 * torch.randn(40, generator=gen)).to(torch.bfloat16).requires_grad_()
    ws = [projection(gen, n, 40, torch.bfloat16, False)[0] for n in (24, 8, 8)]
    graphs = {}

    def keep(name):
        def compiler(gm, _):
            graphs[name] = gm
            return make_boxed_func(gm.forward)

        return compiler

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"),
                           partition_fn=min_cut_rematerialization_partition)  # Inductor's  # fmt: skip
    loss = torch.compile(three_projections, backend=backend)(h, nw, ws)
    loss.backward()
    got = [h.grad, nw.grad, *(w.grad for w in ws)]
    for t in (h, nw, *ws):
        t.grad = None
    three_projections(h, nw, ws).backward()
    for g, t in zip(got, (h, nw, *ws), strict=True):
        assert torch.equal(g, t.grad)
    bw_nodes = [n for n in graphs["bw"].graph.nodes if n.op == "call_function"]
    rstd_unsqueezes = [n for n in bw_nodes if n.target is torch.ops.aten.unsqueeze.default]
    weight_grads = [n for n in bw_nodes if n.target is torch.ops.aten.mm.default]
    assert len(rstd_unsqueezes) == 1, rstd_unsqueezes  # one rebuild
    assert len(weight_grads) == 6, weight_grads  # dW and dy of each projection
    fw_out = next(n for n in graphs["fw"].graph.nodes if n.op == "output").args[0]
    saved = [n.meta["val"] for n in fw_out[1:] if isinstance(n, torch.fx.Node)]
    wide = [v for v in saved if v.dtype == torch.bfloat16 and tuple(v.shape) == (2, 8, 40)]
    assert len(wide) == 1, [tuple(v.shape) for v in saved]  # h alone, not y


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma (1 + w)"])
def test_gpu_compiled_rebuild_is_the_norms_output_at_llama_shapes(offset):
    """On the GPU at Llama-3-8B widths (4×2048 tokens, hidden 4096, q/k/v 4096/1024/1024), compiled by Inductor:
    the weight gradients read the rebuilt value (Inductor's pointwise kernel) and equal, bit for bit, those of the
    linears fed the norm's Triton output; so do the gradients of h and the norm weight."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(4, 2048, 4096, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    nw = (1.0 + 0.1 * torch.randn(4096, device="cuda", generator=gen)).to(torch.bfloat16).requires_grad_()
    ws = [(0.02 * torch.randn(n, 4096, device="cuda", generator=gen)).to(torch.bfloat16).requires_grad_()
          for n in (4096, 1024, 1024)]  # fmt: skip

    def fused(h, nw, ws):
        y, rstd = torch.ops.fuser.rms_norm(h, nw, 1e-5, offset, None, None)
        outs = [torch.ops.fuser.linear_normed(y, h, rstd, nw, offset, w, None, h.dtype) for w in ws]
        return sum(o.float().square().sum() for o in outs)

    def plain(h, nw, ws):
        y, _ = torch.ops.fuser.rms_norm(h, nw, 1e-5, offset, None, None)
        return sum(F.linear(y, w).float().square().sum() for w in ws)

    results = []
    for fn in (fused, plain):
        torch._dynamo.reset()
        torch.compile(fn)(h, nw, ws).backward()
        results.append([t.grad.clone() for t in (h, nw, *ws)])
        for t in (h, nw, *ws):
            t.grad = None
    for name, a, b in zip(("h", "norm weight", "q", "k", "v"), *results, strict=True):
        assert torch.equal(a, b), name
