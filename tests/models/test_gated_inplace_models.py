"""Tier 3: in a checkpointed layer the gated MLP's backward writes dgate and dup over the recomputed gate and up,
and the down adapter's dx is added into the base projection's gradient (``fuser.inductor.gated_mlp_inplace``). Through
Inductor on CPU (its caches off, so the post-grad pass runs): one of each per layer under gradient checkpointing;
without it the gated backward stays out of place (gate and up are then saved activations) while the dx is still
accumulated; the training step is what it is with the passes switched off, bit for bit, and eager's within fp32
rounding."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fuser
from fuser.patterns.gated_mlp import GEGLU, REGLU, SWIGLU
from tests.models.inductor_steps import XDIST_GROUP, inductor_step, isolated_compile
from tests.models.tiny import (
    N_LAYERS,
    assert_same_step,
    batch,
    build,
    checkpointed,
    grads,
    lora_model,
    lora_step,
    rel,
)

pytest.importorskip("peft")
# one worker runs the module under pytest-xdist (``--dist loadgroup``): the tests share the steps with the passes off
# (step_off, checkpointed_step_off), and with the other modules of the group the steps of
# tests/models/inductor_steps.py (each computed once there)
pytestmark = XDIST_GROUP

INDUCTOR = fuser.FuserConfig(strict=True)  # the default inner compiler
INDUCTOR_LENIENT = fuser.FuserConfig()
# the same with the passes switched off, by name as a trainer's options= would
NOT_IN_PLACE = {"experimental.gated_mlp.backward_in_place": False}
INDUCTOR_OFF = fuser.FuserConfig.from_options({"strict": True, **NOT_IN_PLACE})
# the gated MLP's own passes; lora_sum's gated_sums_in_slices (its own tests: test_gated_sums_models.py) runs
# beside them in every config here
GATED_PASSES = ("gated_backward_in_place", "gated_dx_accumulated")


def gated_counts(backend) -> dict[str, int]:
    """What the gated MLP's post-grad passes rewrote in ``backend``'s graphs."""
    return only_gated(backend.post_grad_counts)


def only_gated(post_grad_counts: dict[str, int]) -> dict[str, int]:
    """The gated MLP's passes' of what fuser's post-grad passes rewrote (``FuserBackend.post_grad_counts``)."""
    return {k: v for k, v in post_grad_counts.items() if k in GATED_PASSES}


@pytest.fixture(autouse=True)
def _no_inductor_cache():
    # a graph from Inductor's (or AOT autograd's) graph cache skips the post-grad passes, and with them the count;
    # the kernels' own compile cache stays on (force_disable_caches would recompile every C++ kernel in a fresh
    # directory: a minute or more per test)
    import torch._functorch.config as functorch_config

    with torch._inductor.config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


def step_without_the_pass(make):
    """(loss, grads) with the passes switched off; asserts that they rewrote nothing."""
    off = lora_step(make(), INDUCTOR_OFF)
    assert gated_counts(fuser.backend(INDUCTOR_OFF)) == {}
    return off


def step_with_the_pass(model: str):
    """((loss, grads) of ``inductor_steps.MODELS[model]`` with the pass, what the pass rewrote in it)."""
    shared = inductor_step(model, INDUCTOR)
    return shared.loss_and_grads(), only_gated(shared.post_grad_counts)


def _computed_once_without_the_pass(make):
    """The step with the passes switched off, compiled once for the tests that compare with it (a Dynamo trace of a
    checkpointed peft model: 20-45 s on CPU). The step is a function of fixed seeds (``lora_model``, ``batch``), so
    it is the same whichever test computes it first; it is computed as each of those tests did, from a clean Dynamo
    cache with Inductor's graph caches off (``isolated_compile``), and the tests only read it."""
    with isolated_compile():
        return step_without_the_pass(make)


@pytest.fixture(scope="module")
def checkpointed_step_off():
    """The checkpointed LoRA Llama's step with the passes switched off."""
    return _computed_once_without_the_pass(lambda: checkpointed(lora_model()))


@pytest.fixture(scope="module")
def step_off():
    """The LoRA Llama's step (no checkpointing) with the passes switched off."""
    return _computed_once_without_the_pass(lora_model)


def test_checkpointed_lora_llama_one_per_layer_step_unchanged(checkpointed_step_off):
    on, counts = step_with_the_pass("checkpointed lora")  # checkpointed(lora_model())
    assert counts == {"gated_backward_in_place": N_LAYERS, "gated_dx_accumulated": N_LAYERS}
    assert_same_step(on, checkpointed_step_off)


def test_not_without_checkpointing(step_off):
    # gate and up are saved for the backward: graph inputs of the backward graph, which autograd owns
    on, counts = step_with_the_pass("lora")  # lora_model()
    assert counts["gated_backward_in_place"] == 0 and counts["gated_dx_accumulated"] == N_LAYERS
    assert_same_step(on, step_off)


def test_checkpointed_full_fine_tune_equals_eager():
    (loss, g), counts = step_with_the_pass("checkpointed llama")  # checkpointed(build("llama"))
    reference = checkpointed(build("llama"))
    data = batch()
    reference(**data).loss.backward()
    # no LoRA adapter on the down projection: nothing to accumulate
    assert counts == {"gated_backward_in_place": N_LAYERS, "gated_dx_accumulated": 0}
    assert rel(loss, reference(**data).loss) <= 1e-6
    g_ref = grads(reference)
    assert g.keys() == g_ref.keys()
    for name in g_ref:
        assert rel(g[name], g_ref[name]) <= 1e-5, name


@pytest.mark.gpu
def test_gpu_checkpointed_lora_llama_step_unchanged():
    """On CUDA the rewritten ops take their Triton paths (the gated backward kernel writing over its inputs, the
    dx kernel adding into the base gradient in its epilogue): the bf16 step equals the one without the passes."""
    make = lambda: checkpointed(lora_model().cuda())  # noqa: E731

    def step(config):
        model = make()
        data = {k: v.cuda() for k, v in batch().items()}
        out = fuser.optimize(model, config)(**data)
        out.loss.backward()
        return out.loss.detach(), grads(model)

    backend = fuser.backend(INDUCTOR)
    on = step(INDUCTOR)
    assert gated_counts(backend) == {"gated_backward_in_place": N_LAYERS, "gated_dx_accumulated": N_LAYERS}
    torch._dynamo.reset()
    off = step(INDUCTOR_OFF)
    assert gated_counts(fuser.backend(INDUCTOR_OFF)) == {}
    assert_same_step(on, off)


def _failing_plan(graph):
    raise RuntimeError("an analysis that fails")


def _fail_every_plan(monkeypatch):
    """The gated MLP's post-grad passes (swiglu's, geglu's and reglu's, the same) with an analysis that raises."""
    failing = tuple(dataclasses.replace(one, plan=_failing_plan) for one in SWIGLU.post_grad)
    for pattern in (SWIGLU, GEGLU, REGLU):
        monkeypatch.setattr(pattern, "post_grad", failing)


def test_a_failing_pass_leaves_the_graph_and_warns(monkeypatch, checkpointed_step_off):
    # the backward graph compiles at the first backward call, outside the rewrite's own fallback: the pass itself
    # must not take the step down: the step is the one with the passes switched off (strict or not: nothing fails
    # there to raise or warn about)
    _fail_every_plan(monkeypatch)
    with pytest.warns(RuntimeWarning, match="post-grad pass gated_dx_accumulated failed"):
        loss, g = lora_step(checkpointed(lora_model()), INDUCTOR_LENIENT)
    assert gated_counts(fuser.backend(INDUCTOR_LENIENT)) == {}
    assert_same_step((loss, g), checkpointed_step_off)


def test_a_failing_pass_raises_under_strict(monkeypatch):
    _fail_every_plan(monkeypatch)
    with pytest.raises(Exception, match="post-grad pass gated_dx_accumulated failed"):
        lora_step(checkpointed(lora_model()), INDUCTOR)
