"""Tier 3: the LoRA A of a gated MLP's down projection reads the fused gated product; after the rewrite it becomes
``fuser::upcast_linear_gated``, whose backward recomputes that product from gate and up instead of saving it. On
tiny LoRA Llamas: one per layer, the training step bit for bit what it is without the refinement, and the
partitioner saves one ``[tokens, intermediate]`` tensor per layer fewer."""

from __future__ import annotations

import pytest
import torch

import fuser
from tests.models.tiny import N_LAYERS, lora_model, lora_step, rel, saved_wide_tensors, small_llama

peft = pytest.importorskip("peft")

AOT = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
NO_RECOMPUTE = {"upcast_linear": {"recompute_gated_input": False}}
AOT_NO_RECOMPUTE = fuser.FuserConfig.from_options({"strict": True, "inner_compiler": "aot_eager", **NO_RECOMPUTE})


def refined(config, since: int = 0) -> dict[str, int]:
    """What ``after_apply`` refined in the backend's compiles from the ``since``-th on (equal configs share one
    backend, and its results accumulate)."""
    total: dict[str, int] = {}
    for result in fuser.backend(config).results[since:]:
        for name, n in result.refined.items():
            total[name] = total.get(name, 0) + n
    return total


def checkpointed_lora_model():
    model = lora_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


@pytest.mark.parametrize("build", [lora_model, checkpointed_lora_model], ids=["plain", "gradient checkpointing"])
def test_one_per_layer_and_the_step_is_unchanged_bit_for_bit(build):
    """One per layer (under checkpointing: inside the layers' nested graphs), and the training step is what it is
    without the refinement: bit for bit, except the down adapter's LoRA A gradient. The forward's product comes
    from the unrounded gate/up LoRA sums (lora_sum_wide, issue 16), the recompute from the rounded ones it saves:
    that gradient then differs by the rounding of gate and up: within about two bf16 ulps (silu amplifies a
    negative gate's rounding)."""
    since = len(fuser.backend(AOT).results)
    loss, grads = lora_step(build(), AOT)
    # lora_sum's refinements (issue 16), per layer: the gate and up sums keep their fp32 value for the gated op, the
    # o and down sums stay fp32 into their residual adds, the q and k sums into RoPE, and the v sum, stored
    # rounded for attention, adds to the base's fp32 output (experimental.lora_sum.fp32_base); besides the recompute,
    # the LoRA A of q/k/v and of gate/up share one op each (experimental.upcast_linear.group_shared_inputs): 5 per layer
    assert refined(AOT, since) == {"upcast_linear": N_LAYERS + 5 * N_LAYERS, "lora_sum": 7 * N_LAYERS}
    torch._dynamo.reset()
    loss_off, grads_off = lora_step(build(), AOT_NO_RECOMPUTE)
    assert refined(AOT_NO_RECOMPUTE) == {"upcast_linear": 5 * N_LAYERS, "lora_sum": 7 * N_LAYERS}
    assert torch.equal(loss, loss_off) and grads.keys() == grads_off.keys()
    for name, g in grads.items():
        if "down_proj.lora_A" in name:
            # gate and up rounded: ≤ half an ulp each, and silu's relative sensitivity |1 + g·(1 − σ(g))| reaches
            # ~3 at gates near −4, so the product moves by up to (1 + 3)·2⁻⁹ = 2⁻⁷
            assert rel(g, grads_off[name]) <= 2.0**-7, name
        else:
            assert torch.equal(g, grads_off[name]), name


def test_not_when_the_gated_op_absorbed_the_lora_sums():
    # without lora_sum the gated op takes the sums in and saves them, not its inputs: nothing to recompute from
    config = fuser.FuserConfig(patterns=tuple(p for p in fuser.DEFAULT_PATTERNS if p != "lora_sum"), strict=True,
                               inner_compiler="aot_eager")  # fmt: skip
    since = len(fuser.backend(config).results)
    lora_step(lora_model(), config)
    assert sum(r.counts.get("swiglu", 0) for r in fuser.backend(config).results[since:]) == N_LAYERS
    # the shared-input groups only (rms_norm's own refinement, the residual adds it absorbs, counts apart)
    assert {k: v for k, v in refined(config, since).items() if k != "rms_norm"} == {"upcast_linear": 5 * N_LAYERS}


@pytest.mark.parametrize("recompute", [True, False], ids=["refined", "not refined"])
def test_the_product_is_no_longer_saved(recompute):
    config = fuser.FuserConfig(upcast_linear={"recompute_gated_input": recompute})
    lora = peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    wide = saved_wide_tensors(peft.get_peft_model(small_llama(96), lora).train(), 96, config)
    # gate and up (for the gated op's backward), and without the refinement the product too
    assert len(wide) == (2 if recompute else 3) * 2, wide
