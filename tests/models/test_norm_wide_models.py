"""Tier 3: an RMSNorm fed by a LoRA sum reads that sum's fp32 value (issue 16), as Inductor computes the norm fused
with peft's cast: the norm after a residual add over the o/down LoRA sums takes the fp32 add, Qwen3's q/k norms and
Gemma-style norms right after a projection take ``fuser::lora_sum_wide``'s fp32 sum. The norm's cast of its
normalised value before the weight multiply (Llama's ``.to(in_dtype)``) is computed in fp32 too. Every case: the
graph is checked, and the bf16 step is at least as close to fp32 as eager bf16's."""

from __future__ import annotations

import copy
import operator

import pytest
import torch

import fuser
import fuser.refinements.lora_sums as lora_refinements
from fuser.kernels._triton import HAS_TRITON, interpreting
from tests.models.tiny import N_LAYERS, batch, build, grads, rel, with_lora

peft = pytest.importorskip("peft")

AOT = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
# the norms' own subject: the v sums' fp32 bases (tests/models/test_fp32_base_models.py) off, so that a gradient
# compared one by one with eager's moves only by what the norms change
AOT_NORMS = fuser.FuserConfig(strict=True, inner_compiler="aot_eager", experimental={"lora_sum": {"fp32_base": False}})


def wide_norms(monkeypatch) -> list[str]:
    """Record, for every rewritten graph, how each ``fuser::rms_norm`` gets its fp32 input (after the last of
    lora_sum's refinements)."""
    seen: list[str] = []
    real = lora_refinements.sum_into_norms

    def spy(graph):
        n = real(graph)
        for node in graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.fuser.add_rms_norm.default:
                seen.append("absorbed add")
                assert node.args[5] is None, node.args  # the normalised value is not rounded before the weight
            if node.op == "call_function" and node.target is torch.ops.fuser.rms_norm.default:
                wide = node.kwargs.get("x_wide")
                if wide is None:
                    seen.append("none")
                elif wide.op == "call_function" and wide.target in lora_refinements._ADDS:
                    seen.append("residual add")
                else:
                    seen.append("lora sum")
                assert node.args[4] is None, node.args  # the normalised value is not rounded before the weight
        return n

    monkeypatch.setattr(lora_refinements, "sum_into_norms", spy)
    return seen


def step(model, config=None, compile_inductor=False):
    run = torch.compile(model) if compile_inductor else model if config is None else fuser.optimize(model, config)
    out = run(**batch())
    out.loss.backward()
    return out.loss.detach(), grads(model)


def test_llama_norms_read_the_residual_adds_and_the_step_is_as_close_to_fp32_as_eager(monkeypatch):
    seen = wide_norms(monkeypatch)
    model = with_lora(build("llama", torch.bfloat16))
    loss32, grads32 = step(copy.deepcopy(model).float())
    loss16, grads16 = step(copy.deepcopy(model))
    loss, got = step(model, AOT_NORMS)
    # the first layer's input norm reads the embeddings; every other norm absorbs the residual add over a LoRA sum
    assert {k: seen.count(k) for k in set(seen)} == {"none": 1, "absorbed add": 2 * N_LAYERS}, seen
    assert abs(loss - loss32) <= 2 * abs(loss16 - loss32) + 1e-3 * abs(loss32), (loss, loss16, loss32)
    for name, g in got.items():
        err, err_eager = rel(g, grads32[name]), rel(grads16[name], grads32[name])
        assert err <= 1.5 * err_eager + 1e-3, f"{name}: fuser {err:.2e}, eager bf16 {err_eager:.2e} vs fp32"


def test_qwen3_qk_norms_read_the_fp32_sums_and_the_step_is_as_close_to_fp32_as_inductor(monkeypatch):
    """Qwen3's q/k norms take the q/k LoRA sums through the head view. Computing a norm over 16 values from the
    unrounded sum moves the q/k adapters' gradients away from eager's (rounded, self-consistent) ones and towards
    Inductor's, which fuses the sum into the norm the same way: on this tiny model the q_proj LoRA A gradient is
    3.3e-2 from fp32's in eager, 1.2e-1 through fuser and 1.9e-1 through Inductor (CPU). So the bar is Inductor's
    distance from fp32 where it is larger than eager's."""
    seen = wide_norms(monkeypatch)
    model = with_lora(build("qwen3", torch.bfloat16))
    loss32, grads32 = step(copy.deepcopy(model).float())
    loss16, grads16 = step(copy.deepcopy(model))
    loss_ind, grads_ind = step(copy.deepcopy(model), compile_inductor=True)
    loss, got = step(model, AOT)
    assert {k: seen.count(k) for k in set(seen)} == {"none": 1, "absorbed add": 2 * N_LAYERS, "lora sum": 2 * N_LAYERS}
    bar = max(abs(loss16 - loss32), abs(loss_ind - loss32))
    assert abs(loss - loss32) <= 2 * bar + 1e-3 * abs(loss32), (loss, loss16, loss_ind, loss32)
    for name, g in got.items():
        err = rel(g, grads32[name])
        err_eager, err_ind = rel(grads16[name], grads32[name]), rel(grads_ind[name], grads32[name])
        assert err <= max(1.5 * err_eager, err_ind) + 1e-3, (
            f"{name}: fuser {err:.2e}, eager {err_eager:.2e}, Inductor {err_ind:.2e} vs fp32"
        )


def test_fp32_model_is_unchanged(monkeypatch):
    """In fp32 there is no cast to keep: no norm gets an fp32 copy, and the step equals eager's. The residual adds
    still join their norms (``experimental.rms_norm.residual_add``), which in fp32 reads the same sum eager's add
    writes."""
    seen = wide_norms(monkeypatch)
    model = with_lora(build("qwen3", torch.float32))
    loss_ref, grads_ref = step(copy.deepcopy(model))
    loss, got = step(model, AOT)
    # the first input norm and the q/k norms read their inputs as they are; every other norm takes its residual add
    assert {k: seen.count(k) for k in set(seen)} == {"none": 1 + 2 * N_LAYERS, "absorbed add": 2 * N_LAYERS}, seen
    assert torch.allclose(loss, loss_ref, rtol=1e-5, atol=1e-6)
    for name, g in got.items():
        assert rel(g, grads_ref[name]) <= 1e-4, name


def test_a_sum_with_another_user_keeps_its_rounding():
    """A LoRA sum read by a norm and by something else (here: added to the norm's output) is not widened: the other
    user must see peft's rounded sum."""
    from torch.fx.experimental.proxy_tensor import make_fx

    import fuser.kernels.lora_sum  # noqa: F401
    import fuser.kernels.rms_norm  # noqa: F401

    def f(base, a, w, nw):
        s = torch.ops.fuser.lora_sum(base, a, w, 2.0)
        y, _ = torch.ops.fuser.rms_norm(s, nw, 1e-6, 0.0, None, torch.bfloat16)
        return y + s

    args = (torch.randn(4, 8).bfloat16(), torch.randn(4, 2), torch.randn(8, 2), torch.ones(8).bfloat16())
    gm = make_fx(f)(*args)
    assert lora_refinements.sum_into_norms(gm.graph) == 0
    assert not any(n.target is torch.ops.fuser.lora_sum_wide.default for n in gm.graph.nodes)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(3, 5, 64), (7, 96), (2048, 4096)])
def test_op_computes_from_x_wide_and_takes_the_gradient_through_x(shape, device):
    """``fuser::rms_norm(x, …, x_wide=)``: y is the norm of x_wide (rounded once), rstd x_wide's, and dx is the
    backward at x with that rstd. Reference in fp64, outputs checked against NaN pre-fills by construction."""
    from fuser.kernels.rms_norm import Norm, rms_norm_backward

    torch.manual_seed(0)
    wide = torch.randn(shape, device=device) * 3
    x = wide.bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], device=device)).bfloat16().requires_grad_()
    y, rstd = torch.ops.fuser.rms_norm(x, w, 1e-6, 0.0, None, None, x_wide=wide)
    assert y.dtype == torch.bfloat16 and rstd.dtype == torch.float32
    w64 = wide.double()
    rstd64 = torch.rsqrt(w64.pow(2).mean(-1) + 1e-6)
    ref = (w64 * rstd64.unsqueeze(-1) * w.double()).to(torch.bfloat16)
    assert torch.allclose(rstd.double(), rstd64, rtol=1e-5)
    assert (y.double() - ref.double()).abs().max() <= 2**-7 * ref.double().abs().max()
    dy = torch.randn(shape, device=device).bfloat16()
    y.backward(dy)
    dx_ref, dw_ref = rms_norm_backward(dy, x.detach(), Norm(w.detach(), 1e-6), rstd=rstd, impl="reference")
    assert x.grad is not None and w.grad is not None
    assert torch.allclose(x.grad.float(), dx_ref.float(), rtol=2e-2, atol=1e-2)
    assert torch.allclose(w.grad.float(), dw_ref.float(), rtol=2e-2, atol=1e-2)
    with pytest.raises(ValueError, match="x_wide in fp32"):
        torch.ops.fuser.rms_norm(x, w, 1e-6, 0.0, None, None, x_wide=wide.bfloat16())


def test_a_norm_right_after_the_projection_reads_the_fp32_sum():
    """A norm straight on a LoRA sum (Gemma-3's post-projection norms, no view between): lora_sum_wide feeds it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    import fuser.kernels.lora_sum  # noqa: F401
    import fuser.kernels.rms_norm  # noqa: F401

    def f(base, a, w, nw):
        s = torch.ops.fuser.lora_sum(base, a, w, 2.0)
        return torch.ops.fuser.rms_norm(s, nw, 1e-6, 0.0, None, torch.bfloat16)[0]

    torch.manual_seed(0)
    args = (torch.randn(4, 8).bfloat16(), torch.randn(4, 2), torch.randn(8, 2), torch.ones(8).bfloat16())
    gm = make_fx(f)(*args)
    assert lora_refinements.sum_into_norms(gm.graph) == 1
    gm.recompile()
    norm = next(n for n in gm.graph.nodes if n.target is torch.ops.fuser.rms_norm.default)
    wide = norm.kwargs["x_wide"]
    assert wide.target is operator.getitem and wide.args[0].target is torch.ops.fuser.lora_sum_wide.default
    base, a, w, nw = args
    s64 = base.double() + 2.0 * a.double() @ w.double().t()
    ref = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-6)
    got = gm(*args)
    assert (got.double() - ref).abs().max() <= 2**-8 * ref.abs().max()


@pytest.mark.parametrize("device", DEVICES)
def test_the_gradient_goes_to_x_wide_in_fp32_when_it_wants_one(device):
    """x_wide requiring a gradient takes it, unrounded (fp32): what the adapters' gradients are then computed
    from; x, its rounding, gets none (autograd passes a cast's gradient through, so the total is the same)."""
    from fuser.kernels.rms_norm import Norm, rms_norm_backward

    torch.manual_seed(1)
    wide = (torch.randn(512, 4096, device=device) * 2).requires_grad_()
    x = wide.detach().bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(4096, device=device)).bfloat16()
    y, rstd = torch.ops.fuser.rms_norm(x, w, 1e-6, 0.0, None, None, x_wide=wide)
    dy = torch.randn(512, 4096, device=device).bfloat16()
    y.backward(dy)
    assert x.grad is None and wide.grad is not None and wide.grad.dtype == torch.float32
    dx_ref, _ = rms_norm_backward(dy, x.detach(), Norm(w, 1e-6), dx_dtype=torch.float32, rstd=rstd, impl="reference")
    assert torch.allclose(wide.grad, dx_ref, rtol=1e-4, atol=1e-5)
    # and it is not the bf16 gradient upcast: the fp32 one carries bits a bf16 one cannot
    assert not torch.equal(wide.grad, wide.grad.bfloat16().float())


def _add_norm_case(device, dtype, shape=(3, 7, 96)):
    torch.manual_seed(2)
    x = (torch.randn(shape, device=device) * 2).to(dtype).requires_grad_()
    r = (torch.randn(shape, device=device) * 1e-2).requires_grad_()  # a small fp32 term: the rounding would erase it
    w = (1 + 0.1 * torch.randn(shape[-1], device=device)).to(dtype).requires_grad_()
    return x, r, w


def _check_add_rms_norm(x, r, w):
    y, rstd, h = torch.ops.fuser.add_rms_norm(x, r, w, 1e-6, 0.0, None, None)
    wide64 = x.double() + r.double()
    rstd64 = torch.rsqrt(wide64.pow(2).mean(-1) + 1e-6)
    ref = wide64 * rstd64.unsqueeze(-1) * w.double()
    assert y.dtype == h.dtype == x.dtype and rstd.dtype == torch.float32
    assert torch.equal(h, (x.float() + r).to(x.dtype))  # the residual stream: the add, rounded once
    assert torch.allclose(rstd.double(), rstd64, rtol=1e-5)
    ulp = 2.0**-7 if x.dtype == torch.bfloat16 else 2.0**-10
    assert (y.double() - ref).abs().max() <= ulp * ref.abs().max()
    # the norm is of the unrounded sum: closer to fp64 than the norm of the rounded h
    rounded64 = h.double()
    of_rounded = rounded64 * torch.rsqrt(rounded64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert (y.double() - ref).abs().mean() < (of_rounded.to(x.dtype).double() - ref).abs().mean()
    dy = torch.randn_like(y)
    dh = torch.randn_like(h)
    torch.autograd.backward([y, h], [dy, dh])
    hd = h.detach().double()
    n = hd * rstd.double().unsqueeze(-1)
    g = dy.double() * w.double()
    d64 = rstd.double().unsqueeze(-1) * (g - n * (g * n).mean(-1, keepdim=True)) + dh.double()
    assert r.grad.dtype == torch.float32 and x.grad.dtype == x.dtype
    assert torch.allclose(r.grad.double(), d64, rtol=1e-4, atol=1e-4)
    assert torch.equal(x.grad, r.grad.to(x.dtype))  # one gradient, in two dtypes
    dw64 = (dy.double() * n).reshape(-1, n.shape[-1]).sum(0)
    # an fp32 sum of 21 products, rounded once to w's dtype: within one ulp of it
    ulp_w = 2.0**-7 if w.dtype == torch.bfloat16 else 2.0**-10
    assert ((w.grad.double() - dw64).abs() <= ulp_w * dw64.abs() + 1e-6).all()


@pytest.mark.parametrize("device", DEVICES)
def test_add_rms_norm_op(device):
    _check_add_rms_norm(*_add_norm_case(device, torch.bfloat16))


@pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="needs the Triton interpreter")
def test_add_rms_norm_kernels_through_the_interpreter(monkeypatch, triton_on_cpu):
    """The forward kernel's residual load and sum store, the backward's added gradient and second store (fp16: the
    interpreter's bf16 is broken)."""
    triton_on_cpu()
    import fuser.kernels.rms_norm as R

    launched = []
    for name in ("_launch_forward", "_launch_backward"):
        real = getattr(R, name)
        monkeypatch.setattr(R, name, lambda *a, _real=real, _name=name: launched.append(_name) or _real(*a))
    _check_add_rms_norm(*_add_norm_case("cpu", torch.float16))
    assert launched == ["_launch_forward", "_launch_backward"], launched
