"""Tier 3: under full fine-tuning the down projection's gradients and the gated backward are one op
(``fuser::gated_down_grads``, ``fuser.inductor.gated_down_grads``), whose backward kernel writes the product the
weight gradient needs instead of a separate recompute. Through Inductor on CPU (its caches off, so the post-grad
passes run): one per layer, out of place where gate and up are saved activations, in place (``gated_down_grads_``)
in a checkpointed layer; the training step is what it is with the pass switched off, bit for bit."""

from __future__ import annotations

import pytest
import torch

import fuser
from tests.models.inductor_steps import XDIST_GROUP, inductor_step
from tests.models.tiny import ARCHS as TINY_ARCHS
from tests.models.tiny import N_LAYERS, assert_same_step, batch, build, checkpointed, from_config, grads

# one worker runs the module under pytest-xdist (``--dist loadgroup``), beside the other modules that read the steps
# of tests/models/inductor_steps.py (each computed once there)
pytestmark = XDIST_GROUP

INDUCTOR = fuser.FuserConfig(strict=True)
OFF = fuser.FuserConfig.from_options({"strict": True, "experimental.gated_mlp.backward_writes_product": False})
ARCHS = [("llama", "swiglu"), ("gemma", "geglu")]


@pytest.fixture(autouse=True)
def _no_inductor_cache():
    # a graph from Inductor's (or AOT autograd's) cache skips the post-grad passes, and with them the count
    import torch._functorch.config as functorch_config

    with torch._inductor.config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


def full_step(model, config, device="cpu"):
    """(loss, gradients) of one full fine-tuning step of ``model`` through fuser with ``config``, and what the
    post-grad passes rewrote in its graphs."""
    backend = fuser.backend(config)
    before = dict(backend.post_grad_counts)
    out = fuser.optimize(model, config)(**{k: v.to(device) for k, v in batch().items()})
    out.loss.backward()
    counts = {k: v - before.get(k, 0) for k, v in backend.post_grad_counts.items()}
    torch._dynamo.reset()
    return (out.loss.detach(), grads(model)), counts


@pytest.mark.parametrize(("arch", "pattern"), ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_per_layer_and_the_step_is_unchanged_bit_for_bit(arch, pattern, dtype):
    shared = inductor_step(arch if dtype == torch.float32 else f"{arch} bf16", INDUCTOR)  # build(arch, dtype).train()
    on, counts = shared.loss_and_grads(), shared.post_grad_counts
    assert counts.get("gated_down_grads") == N_LAYERS
    off, counts_off = full_step(build(arch, dtype).train(), OFF)
    assert "gated_down_grads" not in counts_off
    assert_same_step(on, off)


def test_checkpointed_layers_take_the_in_place_form():
    # gate and up are recomputed in the backward graph and nothing reads them after: the gated backward is in place,
    # and the fused op writes dgate and dup over them
    shared = inductor_step("checkpointed llama", INDUCTOR)  # checkpointed(build("llama"))
    on, counts = shared.loss_and_grads(), shared.post_grad_counts
    assert counts.get("gated_down_grads") == N_LAYERS
    assert counts.get("gated_backward_in_place") == N_LAYERS
    off, counts_off = full_step(checkpointed(build("llama")), OFF)
    assert "gated_down_grads" not in counts_off and counts_off.get("gated_backward_in_place") == N_LAYERS
    assert_same_step(on, off)


def test_not_without_the_down_projections_recompute():
    # the product saved (recompute_for_down_weight off): no linear_gated, nothing to join
    config = fuser.FuserConfig.from_options({"strict": True, "gated_mlp": {"recompute_for_down_weight": False}})
    _, counts = full_step(build("llama").train(), config)
    assert counts.get("gated_down_grads", 0) == 0


@pytest.mark.gpu
@pytest.mark.parametrize(("arch", "pattern"), ARCHS)
def test_gpu_step_unchanged_at_width(arch, pattern):
    """bf16 on the GPU at a real width (the Triton kernels): the step with the product from the backward kernel
    equals the one with the forward kernel's recompute."""
    extra = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 8, "head_dim": 128}

    def make():
        model = from_config(TINY_ARCHS[arch][0], {"attn_implementation": "sdpa", **extra})
        return model.to(torch.bfloat16).cuda().train()

    on, counts = full_step(make(), INDUCTOR, "cuda")
    assert counts.get("gated_down_grads") == N_LAYERS
    off, _ = full_step(make(), OFF, "cuda")
    assert_same_step(on, off)
