"""Tier 3: a LoRA sum that must be stored rounded (v_proj's, read by attention) adds its term to the base linear's
unrounded fp32 output and rounds once (``experimental.lora_sum.fp32_base``, issue 16). Rounding the bf16 base first, as
peft's graph does under eager and Inductor, puts it on the bf16 grid, so a LoRA term below half an ulp never moves
the rounded sum: at LoRA learning rates most of v_proj's early update is lost to the forward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fuser
import fuser.kernels.lora_sum  # noqa: F401  (registers torch.ops.fuser.linear_wide and lora_sum)
from fuser.dynamo_backend import FuserBackend
from fuser.kernels._triton import HAS_TRITON, interpreting
from tests.models.tiny import N_LAYERS, batch, build, grads, rel, with_lora

OPS = torch.ops.fuser
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def sums(dtype, device, rows=4096, n_in=64, n_out=256, ulps=0.3):
    """x, W (dtype), LoRA a, B (fp32), scale, and the exact fp64 base and sum: the term is below ``ulps`` of the
    base's ulp almost everywhere."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n_in, generator=g).to(dtype)
    w = (torch.randn(n_out, n_in, generator=g) / n_in**0.5).to(dtype)
    base = F.linear(x.double(), w.double())
    a = torch.randn(rows, 4, generator=g)
    b = torch.randn(n_out, 4, generator=g)
    term = F.linear(a.double(), b.double())
    # scale the term to ``ulps`` of the base's typical ulp (|base| ~ 1, bf16 ulp 2^-7, fp16's 2^-10)
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    scale = ulps * ulp / term.abs().mean().item()
    moved = (x, w, a, b)
    return [t.to(device) for t in moved], scale, base.to(device), (base + scale * term).to(device)


def wide_sum(x, w, a, b, scale, dtype):
    return OPS.lora_sum(OPS.linear_wide(x, w), a, b, scale, False, dtype)


def rounded_sum(x, w, a, b, scale, dtype):  # peft's graph: the base rounded, the sum rounded again
    return OPS.lora_sum(F.linear(x, w), a, b, scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_sum_of_the_fp32_base_rounds_like_the_exact_sum(dtype, device):
    """Against the exact (fp64) sum rounded once: the fp32 base gives it almost everywhere (it differs only where
    fp32 accumulation lands on the other side of a rounding boundary); the rounded base misses the elements where
    the term is below half the base's ulp and should still have moved the rounding (here about a quarter)."""
    (x, w, a, b), scale, base, exact = sums(dtype, device)
    want = exact.to(dtype)
    got = torch.full_like(want, float("nan"))
    got.copy_(wide_sum(x, w, a, b, scale, dtype))
    old = rounded_sum(x, w, a, b, scale, dtype)
    should_move = (want != base.to(dtype)).double().mean().item()
    assert should_move > 0.1, should_move  # the case discriminates: the exact sum moves many elements
    assert (got != want).double().mean().item() <= 1e-3
    assert (old != want).double().mean().item() >= 0.1  # today's graph


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_equal_the_graphs(device):
    """The gradients of x, W, a and B through ``linear_wide`` + ``lora_sum`` equal those through peft's graph: the
    base's gradient is the rounded sum's (exact), so nothing in the backward changes."""
    (x, w, a, b), scale, _, _ = sums(torch.bfloat16, device, rows=256)
    g = torch.randn(256, 256, device=device).bfloat16()
    results = []
    for fn in (wide_sum, rounded_sum):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, a, b)]
        fn(*leaves, scale, torch.bfloat16).backward(g)
        results.append([t.grad for t in leaves])
    for name, got, want in zip("xwab", *results, strict=True):
        assert got.dtype == want.dtype, name
        assert torch.allclose(got.float(), want.float(), rtol=1e-5, atol=1e-6), name


def test_bias_and_its_gradient():
    x = torch.randn(3, 5, 16).bfloat16().requires_grad_()
    w = torch.randn(8, 16).bfloat16().requires_grad_()
    bias = torch.randn(8).bfloat16().requires_grad_()
    y = OPS.linear_wide(x, w, bias)
    assert y.dtype == torch.float32 and y.shape == (3, 5, 8)
    ref = F.linear(x.double(), w.double(), bias.double())
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)
    g = torch.randn(3, 5, 8)
    y.backward(g)
    assert torch.allclose(bias.grad.float(), g.sum((0, 1)), rtol=1e-2, atol=1e-2)
    assert torch.allclose(x.grad.double(), g.bfloat16().double() @ w.double(), rtol=1e-2, atol=1e-2)
    torch.library.opcheck(OPS.linear_wide.default, (x.detach(), w.detach(), bias.detach()))
    with pytest.raises(ValueError, match="of x's dtype"):
        OPS.linear_wide(x, w.float())


@pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="needs the Triton interpreter")
def test_the_kernel_sums_the_fp32_base(triton_on_cpu, monkeypatch):
    """Through the interpreter (fp16: its bf16 is broken): lora_sum's Triton kernel reads the fp32 base."""
    import fuser.kernels.upcast_linear as U

    triton_on_cpu()
    launched = []
    real = U._dx_triton
    monkeypatch.setattr(U, "_dx_triton", lambda *a, **kw: launched.append(1) or real(*a, **kw))
    (x, w, a, b), scale, _, exact = sums(torch.float16, "cpu", rows=256)
    got = wide_sum(x, w, a, b, scale, torch.float16)
    assert launched and got.dtype == torch.float16
    assert (got != exact.to(torch.float16)).double().mean().item() <= 1e-3


@pytest.fixture
def rewritten(monkeypatch):
    graphs = []
    real = FuserBackend.compile_inner
    monkeypatch.setattr(FuserBackend, "compile_inner", lambda self, gm, ex: graphs.append(gm) or real(self, gm, ex))
    return graphs


def step(model, config=None):
    run = model if config is None else fuser.optimize(model, config)
    out = run(**batch())
    out.loss.backward()
    return out.loss.detach(), grads(model)


@pytest.mark.parametrize("fp32_base", [True, False])
def test_llama_v_sums_round_once_and_the_step_is_as_close_to_fp32_as_eager(fp32_base, rewritten):
    """Every layer's v_proj sum (the one LoRA sum no fused consumer reads unrounded) takes an fp32 base; switched
    off, none does. The bf16 step stays at least as close to fp32 as eager bf16's: its loss, and its LoRA
    gradients summed over the model. One gradient's bf16 error is one draw of rounding noise: over build seeds 0-3
    its ratio to eager's reached 1.64 with the fp32 base and 1.62 without (CPU), so each is only held to 2x eager's,
    which a wrong gradient (an error near 1) fails by far."""
    model = with_lora(build("llama", torch.bfloat16))
    loss32, grads32 = step(copy.deepcopy(model).float())
    loss16, grads16 = step(copy.deepcopy(model))
    config = fuser.FuserConfig(
        strict=True, inner_compiler="aot_eager", experimental={"lora_sum": {"fp32_base": fp32_base}}
    )
    loss, got = step(model, config)
    wide = [n for gm in rewritten for n in gm.graph.nodes if n.target is OPS.linear_wide.default]
    assert len(wide) == (N_LAYERS if fp32_base else 0)
    assert all("v_proj" in str(n.args[1]) for n in wide), [n.args for n in wide]
    assert abs(loss - loss32) <= 2 * abs(loss16 - loss32) + 1e-3 * abs(loss32), (loss, loss16, loss32)
    errors = {name: (rel(g, grads32[name]), rel(grads16[name], grads32[name])) for name, g in got.items()}
    assert sum(e for e, _ in errors.values()) <= sum(e for _, e in errors.values())
    for name, (err, err_eager) in errors.items():
        assert err <= 2 * err_eager + 1e-3, f"{name}: fuser {err:.2e}, eager bf16 {err_eager:.2e} vs fp32"


def test_fp32_model_has_no_wide_base(rewritten):
    model = with_lora(build("llama", torch.float32))
    step(model, fuser.FuserConfig(strict=True, inner_compiler="aot_eager"))
    assert not any(n.target is OPS.linear_wide.default for gm in rewritten for n in gm.graph.nodes)
