"""Tier 3: peft's fp32 LoRA outputs on a half-precision tiny Llama become ``lora_sum`` (7 per layer) by default, the
gated MLP still fuses (taking the gate and up sums as inputs), and a training step equals eager's — bit for bit
with that rewrite alone (the same computation), and with every pattern on as close to an fp32 reference as eager
bf16 is; through the Triton interpreter (fp16) as well."""

from __future__ import annotations

import copy

import pytest
import torch

import fuser
from fuser.kernels._triton import HAS_TRITON, interpreting
from tests.models.tiny import N_LAYERS, assert_step_as_close_to_fp32_as_eager, batch, lora_model, lora_step, rel

peft = pytest.importorskip("peft")


def test_on_by_default_and_counted():
    model = lora_model()
    assert "lora_sum" in fuser.DEFAULT_PATTERNS and fuser.FuserConfig().enabled("lora_sum")
    without = tuple(p for p in fuser.DEFAULT_PATTERNS if p != "lora_sum")
    assert "lora_sum" not in fuser.explain(model, config=fuser.FuserConfig(patterns=without), **batch()).counts
    report = fuser.explain(model, **batch())
    assert report.counts.get("lora_sum") == 7 * N_LAYERS, str(report)
    # the gated MLP takes the gate and up sums as plain inputs, and every adapter's input cast still fuses
    assert report.counts.get("swiglu") == N_LAYERS and report.counts.get("upcast_linear") == 7 * N_LAYERS
    assert not [m for m in report.near_misses if m.pattern in ("swiglu", "lora_sum")], str(report)


def test_alone_it_is_eager_except_the_residual_sums_kept_fp32():
    """Alone (no gated op, no RoPE op to feed), lora_sum computes peft's sums as eager does, except that the o and
    down sums, which feed residual adds, stay fp32 and the add rounds once, as Inductor computes them, and every
    other sum adds its term to its base's fp32 output and rounds once (``experimental.lora_sum.fp32_base``; issue 16).
    So the step is no longer eager's bit for bit: it is at least as close to fp32's."""
    config = fuser.FuserConfig(patterns=("lora_sum",), strict=True, inner_compiler="aot_eager")
    model = lora_model()
    loss32, grads32 = lora_step(copy.deepcopy(model).float())
    loss_ref, grads_ref = lora_step(copy.deepcopy(model))
    loss, grads = lora_step(model, config)
    assert fuser.backend(config).counts == {"lora_sum": 7 * N_LAYERS}
    assert fuser.backend(config).results[-1].refined == {"lora_sum": 7 * N_LAYERS}
    assert abs(loss - loss32) <= 1.5 * abs(loss_ref - loss32) + 1e-3 * abs(loss32)
    for name, g in grads.items():
        assert g.dtype == torch.float32, name
        err, err_eager = rel(g, grads32[name]), rel(grads_ref[name], grads32[name])
        assert err <= 1.5 * err_eager + 1e-3, f"{name}: fuser {err:.2e}, eager {err_eager:.2e} vs fp32"


def close_to_fp32_as_eager(dtype, config):
    assert_step_as_close_to_fp32_as_eager(dtype, config)
    counts = fuser.backend(config).counts
    assert counts.get("lora_sum") == 7 * N_LAYERS and counts.get("swiglu") == N_LAYERS, counts


def test_with_every_pattern_as_close_to_fp32_as_eager_bf16():
    close_to_fp32_as_eager(torch.bfloat16, fuser.FuserConfig(strict=True, inner_compiler="aot_eager"))


@pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="needs the Triton interpreter")
def test_triton_path_through_the_interpreter_as_close_to_fp32_as_eager_fp16(monkeypatch, triton_on_cpu):
    """Every fused op's Triton kernels (lora_sum's and upcast_linear's included), fp16 (the interpreter's bf16
    arithmetic is broken)."""
    triton_on_cpu()
    import fuser.kernels.upcast_linear as U

    launched = []
    real = U._dx_triton
    # lora_sum's forward is the dx kernel with a base (6 arguments); upcast_linear's backward calls it with 3
    monkeypatch.setattr(U, "_dx_triton", lambda *a, **kw: launched.append(len(a)) or real(*a, **kw))
    close_to_fp32_as_eager(torch.float16, fuser.FuserConfig(strict=True, inner_compiler="aot_eager"))
    assert launched.count(6) == 7 * N_LAYERS, launched  # lora_sum's forward kernel ran for every adapter


@pytest.mark.parametrize("targets", [["gate_proj"], ["up_proj"]], ids=["gate alone", "up alone"])
def test_an_adapter_on_one_half_of_the_gated_mlp(targets):
    """LoRA on gate_proj or up_proj alone: the gated op gets one fp32 sum and the other half as it is (its fp32 copy
    is exact). Until 2026-12-02 the op refused the mixed pair ("expects up of gate's dtype"), so a strict compile
    failed and a default one fell back to the unrewritten graph."""
    import peft as peft_module

    from tests.models.tiny import build, grads

    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
    lora = peft_module.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False)
    model = peft_module.get_peft_model(build("llama", torch.bfloat16), lora)

    def step(m, cfg=None):
        out = (m if cfg is None else fuser.optimize(m, cfg))(**batch())
        out.loss.backward()
        return out.loss.detach(), grads(m)

    loss32, grads32 = step(copy.deepcopy(model).float())
    loss16, grads16 = step(copy.deepcopy(model))
    loss, got = step(model, config)
    counts = fuser.backend(config).counts
    assert counts.get("swiglu") == N_LAYERS and counts.get("lora_sum") == N_LAYERS, counts
    assert abs(loss - loss32) <= 2 * abs(loss16 - loss32) + 1e-3 * abs(loss32), (loss, loss16, loss32)
    assert got.keys() == grads32.keys() and len(got) == 2 * N_LAYERS
    for name, g in got.items():
        err, err_eager = rel(g, grads32[name]), rel(grads16[name], grads32[name])
        assert err <= 2 * err_eager + 1e-3, f"{name}: fuser {err:.2e}, eager {err_eager:.2e} vs fp32"
