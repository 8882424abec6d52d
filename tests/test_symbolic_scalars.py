"""Scalars Dynamo makes symbolic are op arguments taken from the graph, not matched literals.

A second model whose float differs (``rms_norm_eps``, peft's ``scaling`` from ``lora_alpha``, Gemma-2's softcap,
Granite's ``logits_scaling``) compiled in the same process (no ``torch._dynamo.reset()``) recompiles with the
float as a graph input: a 0-d fp64 placeholder and ``.item()``, a SymFloat node where the literal was. fuser must
fuse every block of both models, and each training step must equal eager's. Under AOT autograd the op's
``float`` argument is specialised by torch's tensorify pass (Dynamo restarts the analysis with the literal), so
the backend must let that restart through; the ``eager`` inner compiler keeps it symbolic and reuses the graph.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fuser
from fuser.engine.match import is_symbolic_scalar, scalar_hint
from fuser.engine.rewrite import count_by_pattern
from tests.models.tiny import (
    ARCHS,
    NORM_PATTERNS,
    assert_training_step_equals_eager,
    batch,
    from_config,
    fused_norms,
    grads,
    rel,
)

# one decoder layer: what is checked is that a scalar becomes a graph input and every block of the layer still fuses,
# the same in each layer, so a second layer only doubled the Dynamo traces (the longest part of these tests)
N_LAYERS = 1
NORMS = 2 * N_LAYERS + 1  # a Llama: input and post-attention norm per layer, and the final norm
# the layers' norms feed only projections (rms_norm_linear); the final one is read through a slice
LLAMA_COUNTS = {"rms_norm_linear": 2 * N_LAYERS, "rms_norm": 1, "rope": N_LAYERS, "swiglu": N_LAYERS,
                "linear_cross_entropy": 1}  # fmt: skip


def llama(eps: float) -> torch.nn.Module:
    return from_config(
        "LlamaConfig", {"rms_norm_eps": eps, "attn_implementation": "sdpa", "num_hidden_layers": N_LAYERS}
    )


def build(arch: str, dtype: torch.dtype) -> torch.nn.Module:
    """``tiny.build(arch, dtype)`` with ``N_LAYERS`` layers: random norm weights around 1."""
    model = from_config(ARCHS[arch][0], {"attn_implementation": "sdpa", "num_hidden_layers": N_LAYERS}).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return model


def _compiled_once(model: torch.nn.Module) -> dict[str, int]:
    """Run ``model`` once through fuser (eager inner compiler): Dynamo records the scalars its code ran with, and
    the next model's other value makes them symbolic. (``fuser.explain`` alone leaves no such record behind.)"""
    backend = fuser.backend(fuser.FuserConfig(inner_compiler="eager"))
    before = len(backend.results)  # the backend is shared with any other test's equal config
    fuser.optimize(model, backend.config)(**batch())
    return count_by_pattern(m for result in backend.results[before:] for m in result.matches)


def test_explain_binds_a_symbolic_eps_and_fuses_every_norm():
    assert _compiled_once(llama(1e-6)) == LLAMA_COUNTS
    second = fuser.explain(llama(1e-5), **batch())  # same process: Dynamo recompiles with eps as a graph input
    assert second.counts == LLAMA_COUNTS, str(second)
    norms = [m for m in second.matches if m.pattern in NORM_PATTERNS]
    assert len(norms) == NORMS
    assert all(is_symbolic_scalar(m.found.bindings["eps"]) for m in norms), "the second model's eps is not symbolic"
    assert {scalar_hint(m.found.bindings["eps"]) for m in norms} == {1e-5}
    assert not [nm for nm in second.near_misses if nm.pattern == "rms_norm"], str(second)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor", "eager"])
def test_models_with_different_eps_fuse_every_norm_and_train_as_eager(inner):
    config = fuser.FuserConfig(strict=True, inner_compiler=inner)
    backend = fuser.backend(config)
    eps_values = (1e-6, 1e-5) if inner == "inductor" else (1e-6, 1e-5, 1e-4)  # a third: fusing keeps on
    for i, eps in enumerate(eps_values):
        compiled_before = len(backend.results)
        assert_training_step_equals_eager(llama(eps), config)
        # the second model recompiles (eps is new); the eager inner compiler then reuses that symbolic graph
        reused = inner == "eager" and i == 2
        if reused:
            assert len(backend.results) == compiled_before, f"eps={eps} compiled again"
        else:
            assert len(backend.results) > compiled_before, f"eps={eps} compiled no new graph"
        assert backend.results[-1].counts == LLAMA_COUNTS, (eps, backend.results[-1].counts)
        assert not [nm for nm in backend.results[-1].near_misses if nm.pattern == "rms_norm"]
    # every graph the backend compiled fused every norm (the symbolic ones included)
    assert all(fused_norms(r.counts) == NORMS for r in backend.results)


def lora(alpha: int, dtype: torch.dtype) -> torch.nn.Module:
    import peft

    config = peft.LoraConfig(
        r=4, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False
    )
    return peft.get_peft_model(build("llama", dtype), config)


def _step(model: torch.nn.Module, config: fuser.FuserConfig | None) -> tuple[torch.Tensor, dict]:
    run = model if config is None else fuser.optimize(model, config)
    out = run(**batch())
    out.loss.backward()
    return out.loss.detach(), grads(model)


def test_explain_binds_a_symbolic_lora_scaling():
    pytest.importorskip("peft")
    assert _compiled_once(lora(8, torch.bfloat16)).get("lora_sum") == 7 * N_LAYERS
    report = fuser.explain(lora(16, torch.bfloat16), **batch())
    assert report.counts.get("lora_sum") == 7 * N_LAYERS, str(report)
    sums = [m for m in report.matches if m.pattern == "lora_sum"]
    assert all(is_symbolic_scalar(m.found.bindings["scale"]) for m in sums), "peft's scaling is not symbolic"
    assert {scalar_hint(m.found.bindings["scale"]) for m in sums} == {16 / 4}


def test_lora_sum_with_a_changed_lora_alpha_uses_each_models_scale():
    """bf16 base, fp32 adapters (lora_sum's case), lora_alpha 8 then 16 in one process: each model's step is
    eager's (up to the o/down sums kept fp32 into their residual adds, issue 16), far closer to it than to the
    other alpha's. The other sums' fp32 bases (``experimental.lora_sum.fp32_base``) are off: they move the step away
    from eager's on purpose (towards fp32's), and this test's subject is the scale."""
    pytest.importorskip("peft")
    config = fuser.FuserConfig(
        patterns=("lora_sum",), strict=True, inner_compiler="aot_eager", experimental={"lora_sum": {"fp32_base": False}}
    )
    backend = fuser.backend(config)
    eager = {alpha: _step(copy.deepcopy(lora(alpha, torch.bfloat16)), None) for alpha in (8, 16)}
    apart = abs(eager[8][0] - eager[16][0]).item()
    assert apart > 1e-3, "the two alphas must give different losses for the test to tell them apart"
    for alpha in (8, 16):
        loss, found = _step(lora(alpha, torch.bfloat16), config)
        assert backend.results[-1].counts == {"lora_sum": 7 * N_LAYERS}, (alpha, backend.results[-1].counts)
        loss_ref, grads_ref = eager[alpha]
        assert abs(loss - loss_ref).item() <= 0.1 * apart, (alpha, loss, loss_ref, apart)
        assert found.keys() == grads_ref.keys() and found
        for name, g in found.items():
            assert rel(g, grads_ref[name]) <= 5e-2, (alpha, name)


def test_gated_mlp_absorbs_lora_sums_with_a_changed_lora_alpha():
    """fp32 base: the gate and up LoRA sums (scaled by peft's scaling) go into the gated op."""
    pytest.importorskip("peft")
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
    backend = fuser.backend(config)
    for alpha in (8, 16):
        assert_training_step_equals_eager(lora(alpha, torch.float32), config)
        result = backend.results[-1]
        assert result.counts.get("swiglu") == N_LAYERS and fused_norms(result.counts) == NORMS, result.counts
        swiglus = [m for m in result.matches if m.pattern == "swiglu"]
        assert all({"gate_lora", "up_lora"} <= set(m.found.bindings) for m in swiglus)


@pytest.mark.parametrize(
    "cls_name, field, values",
    [
        ("Gemma2Config", "final_logit_softcapping", (0.1, 0.2)),  # tanh(z / cap) * cap: one symbolic cap
        ("GraniteConfig", "logits_scaling", (2.0, 4.0)),  # z / scaling: the op takes 1 / scaling from the graph
    ],
)
def test_loss_with_a_changed_logit_constant_fuses_and_trains_as_eager(cls_name, field, values):
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
    backend = fuser.backend(config)
    second = None
    for value in values:
        model = from_config(cls_name, {"num_hidden_layers": 1, field: value})
        report = fuser.explain(model, **batch())
        assert report.counts.get("linear_cross_entropy") == 1, str(report)
        second = report
        assert_training_step_equals_eager(model, config)
        assert backend.results[-1].counts.get("linear_cross_entropy") == 1, (value, backend.results[-1].counts)
    (loss,) = [m for m in second.matches if m.pattern == "linear_cross_entropy"]
    name = "cap_in" if field == "final_logit_softcapping" else "inverse_scale"
    assert is_symbolic_scalar(loss.found.bindings[name]), f"{field} is not symbolic in the second model"
