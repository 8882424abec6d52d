"""Tier 3: a LoRA model's gated MLP computes its fp32 gate/up sums and their product in row slices
(``experimental.lora_sum.gated_in_slices``, the post-grad pass ``gated_sums_in_slices``): one
``fuser::gated_activation_of_lora_sums`` per layer in the forward graph, and one more per layer in the backward
graph's recomputation under gradient checkpointing. Through Inductor on CPU (its graph caches off, so the
post-grad passes run), with slices of a few rows: the training step is the one with the pass switched off, bit
for bit."""

from __future__ import annotations

import pytest
import torch

import fuser
import fuser.kernels.lora_sum as lora_sum_kernels
from tests.models.inductor_steps import MODELS, XDIST_GROUP, inductor_step
from tests.models.tiny import N_LAYERS, assert_same_step, batch, checkpointed, grads, lora_model, lora_step

pytest.importorskip("peft")
# one worker runs the module under pytest-xdist (``--dist loadgroup``), beside the other modules that read the steps
# of tests/models/inductor_steps.py (each computed once there)
pytestmark = XDIST_GROUP

ON = fuser.FuserConfig.from_options({"strict": True, "experimental.lora_sum.gated_in_slices": True})
OFF = fuser.FuserConfig(strict=True)  # the default: off until measured on a GPU
PASS = "gated_sums_in_slices"


@pytest.fixture(autouse=True)
def _no_inductor_cache_and_small_slices(monkeypatch):
    # a graph from Inductor's (or AOT autograd's) cache skips the post-grad passes; slices of 5 rows make the
    # tiny batch's 32 rows 7 slices, the last one short
    import torch._functorch.config as functorch_config

    monkeypatch.setattr(lora_sum_kernels, "WIDE_SLICE_BYTES", 5 * 4 * 96)
    with torch._inductor.config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


def step_on_and_off(model, monkeypatch):
    """(step with the pass, step without it, the pass's count, rows of each gated forward kernel call with it) of
    ``inductor_steps.MODELS[model]``; the step without the pass (OFF, the default) is read from there."""
    import fuser.kernels.gated_activation as gated

    shared = inductor_step(model, OFF)
    off = shared.loss_and_grads()
    assert PASS not in shared.post_grad_counts
    rows, real = [], gated.gated_activation_forward
    monkeypatch.setattr(
        gated, "gated_activation_forward", lambda g, *a, **k: rows.append(g.shape[0]) or real(g, *a, **k)
    )
    on = lora_step(MODELS[model](), ON)
    counts = dict(fuser.backend(ON).post_grad_counts)
    return on, off, counts, rows


@pytest.mark.parametrize("with_checkpointing", [False, True], ids=["saved", "checkpointed"])
def test_lora_llama_gated_sums_in_slices_step_unchanged(with_checkpointing, monkeypatch):
    # checkpointed(lora_model()), or lora_model()
    on, off, counts, rows = step_on_and_off("checkpointed lora" if with_checkpointing else "lora", monkeypatch)
    # the forward graph's, and under checkpointing the backward's recomputation of each layer
    assert counts[PASS] == N_LAYERS * (2 if with_checkpointing else 1), counts
    # 32 rows (2 × 16 tokens) in slices of 5: six whole slices and one of 2, per call
    assert rows == ([5] * 6 + [2]) * counts[PASS], rows
    assert_same_step(on, off)


@pytest.mark.gpu
def test_gpu_checkpointed_lora_llama_gated_sums_in_slices_step_unchanged(monkeypatch):
    """On CUDA the fused op runs the Triton kernels (the LoRA sums' and the gated forward's) on each slice: the
    checkpointed bf16 step equals the one without the pass, bit for bit."""

    def step(config):
        model = checkpointed(lora_model().cuda())
        data = {k: v.cuda() for k, v in batch().items()}
        out = fuser.optimize(model, config)(**data)
        out.loss.backward()
        return out.loss.detach(), grads(model)

    on = step(ON)
    assert fuser.backend(ON).post_grad_counts[PASS] == 2 * N_LAYERS
    torch._dynamo.reset()
    assert_same_step(on, step(OFF))
