"""Tier 3: RMSNorm in tiny Hugging Face models — counts, graph/recompile counts, loss and gradients vs eager."""

from __future__ import annotations

import copy

import pytest
import torch

import fuser
from fuser import _compat
from tests.models.tiny import (
    ARCHS,
    NORM_PATTERNS,
    assert_training_step_equals_eager,
    batch,
    build,
    expected_norms,
    fused_norms,
    grads,
    rel,
    with_lora,
)

ARCH_NAMES = list(ARCHS)
STRICT = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")


@pytest.mark.parametrize("arch", ARCH_NAMES)
@pytest.mark.parametrize("variant", ["plain", "lora", "checkpointing"])
def test_explain_counts_every_norm(arch, variant):
    model = build(arch)
    if variant == "lora":
        model = with_lora(model)
    if variant == "checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    report = fuser.explain(model, **batch())
    assert fused_norms(report.counts) == expected_norms(arch), str(report)


# the RMSNorm form fuser.explain names for each tiny model's norms (VARIANTS.md: OLMo-2 multiplies the weight in
# fp32 before the downcast, Llama after it; Gemma adds 1 to the weight)
FORMS = {"llama": "llama", "mistral": "llama", "qwen3": "llama", "gemma": "gemma", "olmo2": "olmo2"}


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_explain_names_the_norm_form(arch):
    report = fuser.explain(build(arch, torch.bfloat16), **batch())
    assert {m.variant for m in report.matches if m.pattern in NORM_PATTERNS} == {FORMS[arch]}, str(report)


def _count_compiles(model_fn, backend, seqs):
    calls = []

    def counting(gm, example_inputs):
        calls.append(len(gm.graph.nodes))
        return backend(gm, example_inputs)

    compiled = torch.compile(model_fn, backend=counting)
    per_seq = []
    # torch.compile gives a backend no hook around calls, so what fuser.optimize scopes to its calls
    # (checkpoint_side_effects: transformers >= 5.25 sets state in each checkpointed layer) is set here, for both
    with _compat.dynamo_allowing_checkpoint_side_effects():
        for s in seqs:
            compiled(**batch(seq=s)).loss.backward()
            per_seq.append(len(calls))
    return per_seq


def _prepare(arch, variant):
    model = build(arch)
    if variant == "lora":
        model = with_lora(model)
    if variant == "checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model


@pytest.mark.parametrize(
    "arch, variant", [(a, "plain") for a in ARCH_NAMES] + [("llama", "lora"), ("qwen3", "checkpointing")]
)
def test_graph_and_recompile_counts_equal_eager_backend(arch, variant):
    seqs = (8, 12, 20)
    fuser_counts = _count_compiles(_prepare(arch, variant), fuser.backend(STRICT), seqs)
    fused_per_compile = [fused_norms(r.counts) for r in fuser.backend(STRICT).results]
    torch._dynamo.reset()
    eager_counts = _count_compiles(_prepare(arch, variant), torch._dynamo.lookup_backend("eager"), seqs)
    assert fuser_counts == eager_counts
    # three sequence lengths in a row: each graph compiles at most once more than the first time (the
    # dynamic-shape recompile), and the third length compiles nothing new
    n_graphs = fuser_counts[0]
    assert fuser_counts[-1] <= 2 * n_graphs
    assert fuser_counts[2] == fuser_counts[1]
    # every compile (the static first ones and the dynamic-shape ones) fused every norm
    assert sum(fused_per_compile[:n_graphs]) == expected_norms(arch)
    if fuser_counts[-1] > n_graphs:
        assert sum(fused_per_compile[n_graphs:]) == expected_norms(arch)


def _train_step(model, data, autocast=None):
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        out = model(**data)
    out.loss.backward()
    return out.loss.detach()


@pytest.mark.parametrize("arch", ARCH_NAMES)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fp32_training_step_equals_eager(arch, lora):
    model = build(arch)
    assert_training_step_equals_eager(with_lora(model) if lora else model, STRICT)
    assert fused_norms(fuser.backend(STRICT).counts) == expected_norms(arch)


def test_fp32_training_step_through_inductor():
    """The default inner compiler: Inductor compiles the graph around the fused op (CPU: C++ codegen)."""
    config = fuser.FuserConfig(strict=True)
    assert_training_step_equals_eager(build("llama"), config)
    assert fused_norms(fuser.backend(config).counts) == expected_norms("llama")


def test_gradient_checkpointing_training_step_equals_eager():
    model = build("qwen3")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert_training_step_equals_eager(model, STRICT)
    assert fused_norms(fuser.backend(STRICT).counts) == expected_norms("qwen3")


def _errors_vs_fp64(model_lowp, reference64, data, autocast=None):
    loss = _train_step(model_lowp, data, autocast)
    g64 = grads(reference64)
    g = grads(model_lowp if not hasattr(model_lowp, "_orig_mod") else model_lowp._orig_mod)
    return rel(loss, reference64._loss), {n: rel(g[n], g64[n]) for n in g64}


# bf16 tolerance: bf16 keeps 8 significand bits (eps 7.8e-3), so eager bf16 itself is off from fp64 by roughly
# 1e-3..1e-2. fuser computes the norms in fp32 and must be no less accurate than eager: its error against the
# fp64 reference may exceed eager's by at most a factor 1.5 plus half a bf16 eps (rounding of the same values
# in a different order lands within that).
BF16_FACTOR, BF16_FLOOR = 1.5, 4e-3


@pytest.mark.parametrize("arch", ARCH_NAMES)
@pytest.mark.parametrize("mode", ["bf16", "autocast"])
def test_low_precision_training_step_no_less_accurate_than_eager(arch, mode):
    data = batch()
    base = build(arch)
    reference64 = copy.deepcopy(base).double()
    reference64._loss = _train_step(reference64, data)
    if mode == "bf16":
        eager, fused, autocast = copy.deepcopy(base).bfloat16(), copy.deepcopy(base).bfloat16(), None
    else:  # fp32 weights, bf16 autocast: what HF Trainer(bf16=True) does
        eager, fused, autocast = copy.deepcopy(base), copy.deepcopy(base), torch.bfloat16
    eager_loss_err, eager_grad_err = _errors_vs_fp64(eager, reference64, data, autocast)
    optimized = fuser.optimize(fused, STRICT)
    fused_loss_err, fused_grad_err = _errors_vs_fp64(optimized, reference64, data, autocast)
    assert fused_norms(fuser.backend(STRICT).counts) == expected_norms(arch)
    assert fused_loss_err <= BF16_FACTOR * eager_loss_err + BF16_FLOOR
    for name, err in eager_grad_err.items():
        assert fused_grad_err[name] <= BF16_FACTOR * err + BF16_FLOOR, (name, fused_grad_err[name], err)
    if autocast:  # the same dtypes as eager under autocast: logits (computed in evaluation) and every gradient
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            assert optimized(**data).logits.dtype == eager(**data).logits.dtype
        for p_e, p_f in zip(eager.parameters(), fused.parameters(), strict=True):
            assert p_e.grad.dtype == p_f.grad.dtype
