"""Tier 3: RMSNorm in tiny Hugging Face models, and every option that joins it to its neighbours.

- The norm (``rms_norm``): ``fuser.explain`` counts every norm and names its form (Llama, Gemma's 1 + w, OLMo-2's),
  graphs and recompiles equal the eager backend's, fp32 steps equal eager's (plain, LoRA, gradient checkpointing,
  Inductor), bf16 and autocast steps no less accurate against fp64 than eager's.
- The norm + projection join (``rms_norm_linear``): a norm only linear projections read counts there, its output
  rebuilt for the weight gradients instead of saved; steps equal to those without it, or as close to fp32.
- The residual add in the norm (``experimental.rms_norm.residual_add``, ``fuser::add_rms_norm``), on models and
  toy graphs.
- A norm fed by a LoRA sum reads that sum's fp32 value (``x_wide``, ``lora_sum_wide``; issue 16), and the ops'
  own checks (``rms_norm(x_wide=)``, ``add_rms_norm``, its kernels through the Triton interpreter).
- The norm's backward sums its output gradient's terms (``experimental.rms_norm.gradient_sums``, the post-grad pass
  ``norm_grad_sums``; under autocast ``norm_grad_upcasts``), through Inductor and on toy post-grad graphs.
"""

from __future__ import annotations

import copy
import logging
import operator

import peft
import pytest
import torch

import fuser
import fuser.refinements.lora_sums as lora_refinements
from fuser import _compat
from fuser.engine.canonical import tensor_meta
from fuser.engine.rewrite import subgraph_modules
from fuser.kernels._triton import HAS_TRITON, interpreting
from tests.models import tiny
from tests.models.harness import (
    WIDE_LLAMA,
    assert_equals_eager,
    assert_no_further_than_eager,
    calls,
    fused,
    post_grad_step,
    refined,
    train_step,
)
from tests.models.inductor_steps import N_LAYERS, XDIST_GROUP, inductor_step
from tests.models.tiny import (
    ARCHS,
    NORM_PATTERNS,
    assert_same_step,
    assert_step_as_close_to_fp32_as_eager,
    assert_training_step_equals_eager,
    batch,
    checkpointed,
    from_config,
    fused_norms,
    grads,
    lora_step,
    rel,
    saved_wide_tensors,
    small_llama,
    with_lora,
)

# One decoder layer (N_LAYERS, the shared Inductor steps' count) but in the residual-add section (two layers: the
# add between layers): what the other tests check is per norm (its count and form, its join with the projections it
# feeds, the fp32 value it reads, its backward's sums), the same in every layer, so a second layer only doubled each
# Dynamo trace and compile. The layer's own residual adds (before its post-attention norm and the final norm) are in
# every model. Expectations follow N_LAYERS.


def build(arch: str, dtype: torch.dtype = torch.float32, layers: int = N_LAYERS) -> torch.nn.Module:
    """``tiny.build`` with ``N_LAYERS`` layers, or ``layers``."""
    return tiny.build(arch, dtype, layers=layers)


def expected_norms(arch: str, layers: int = N_LAYERS) -> int:
    return tiny.expected_norms(arch, layers)


def lora_model() -> torch.nn.Module:
    """``tiny.lora_model()`` (bf16, fp32 adapters) with ``N_LAYERS`` layers."""
    return tiny.lora_model(layers=N_LAYERS)


# ---------------------------------------------------------------------------------------------------------
# The norm: counts, forms, recompiles, training steps
# ---------------------------------------------------------------------------------------------------------


ARCH_NAMES = list(ARCHS)
STRICT = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")


# Under gradient checkpointing only: the plain and LoRA models of every architecture (the same _prepare(arch, ...)
# models) have this count asserted through the backend, by the same matcher on the same Dynamo graphs:
# test_graph_and_recompile_counts_equal_eager_backend[<arch>-plain] and test_fp32_training_step_equals_eager[<arch>-
# lora]. Capturing them again here only repeated their traces. fuser.explain's own counting stays covered here, in
# test_explain_names_the_norm_form and in test_explain_counts_the_norms_that_feed_only_projections.
@pytest.mark.parametrize("arch", ARCH_NAMES)
@pytest.mark.parametrize("variant", ["checkpointing"])
def test_explain_counts_every_norm(arch, variant):
    report = fuser.explain(_prepare(arch, variant), **batch())
    assert fused_norms(report.counts) == expected_norms(arch), str(report)


# the RMSNorm form fuser.explain names for each tiny model's norms (VARIANTS.md: OLMo-2 multiplies the weight in
# fp32 before the downcast, Llama after it; Gemma adds 1 to the weight)
FORMS = {"llama": "llama", "mistral": "llama", "qwen3": "llama", "gemma": "gemma", "olmo2": "olmo2"}


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_explain_names_the_norm_form(arch):
    report = fuser.explain(build(arch, torch.bfloat16), **batch())
    assert {m.variant for m in report.matches if m.pattern in NORM_PATTERNS} == {FORMS[arch]}, str(report)


def _prepare(arch, variant):
    """``build(arch)``, with peft's LoRA (``variant`` "lora") or gradient checkpointing ("checkpointing")."""
    model = build(arch)
    if variant == "lora":
        model = with_lora(model)
    if variant == "checkpointing":
        model = checkpointed(model)
    return model


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


# Llama's, Qwen3's and Gemma's full fine-tuning fp32 steps are the residual-add test's below (the same step, in
# training mode, whose dropout is 0): it asserts this test's counts and, more tightly, its loss and gradients
FP32_STEPS = [(arch, lora) for arch in ARCH_NAMES for lora in (False, True) if lora or arch in ("mistral", "olmo2")]


@pytest.mark.parametrize("arch, lora", FP32_STEPS, ids=[f"{a}-{'lora' if lo else 'full'}" for a, lo in FP32_STEPS])
def test_fp32_training_step_equals_eager(arch, lora):
    model = build(arch)
    assert_training_step_equals_eager(with_lora(model) if lora else model, STRICT)
    assert fused_norms(fuser.backend(STRICT).counts) == expected_norms(arch)


@XDIST_GROUP
def test_fp32_training_step_through_inductor():
    """The default inner compiler: Inductor compiles the graph around the fused op (CPU: C++ codegen). The step is
    inductor_steps.py's (the gradient-sum and gated-MLP tests read it too): ``build("llama").train()``, whose
    dropout is 0, so its training mode changes nothing it computes."""
    shared = inductor_step("llama")  # FuserConfig(strict=True)
    assert_equals_eager(shared.loss_and_grads(), train_step(build("llama").train()), loss_tol=1e-5, grad_tol=1e-4)
    assert fused_norms(shared.counts) == expected_norms("llama")


def test_gradient_checkpointing_training_step_equals_eager():
    assert_training_step_equals_eager(checkpointed(build("qwen3")), STRICT)
    assert fused_norms(fuser.backend(STRICT).counts) == expected_norms("qwen3")


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
    reference64 = train_step(copy.deepcopy(base).double(), data=data)
    if mode == "bf16":
        eager, fused, autocast = copy.deepcopy(base).bfloat16(), copy.deepcopy(base).bfloat16(), False
    else:  # fp32 weights, bf16 autocast: what HF Trainer(bf16=True) does
        eager, fused, autocast = copy.deepcopy(base), copy.deepcopy(base), True
    eager_step = train_step(eager, data=data, autocast=autocast)
    optimized = fuser.optimize(fused, STRICT)
    fused_step = train_step(fused, data=data, autocast=autocast, run=optimized)
    assert fused_norms(fuser.backend(STRICT).counts) == expected_norms(arch)
    assert_no_further_than_eager(fused_step, eager_step, reference64, BF16_FACTOR, BF16_FLOOR)
    if autocast:  # the same dtypes as eager under autocast: logits (computed in evaluation) and every gradient
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            assert optimized(**data).logits.dtype == eager(**data).logits.dtype
        for p_e, p_f in zip(eager.parameters(), fused.parameters(), strict=True):
            assert p_e.grad.dtype == p_f.grad.dtype


# ---------------------------------------------------------------------------------------------------------
# The norm + projection join (``rms_norm_linear``, on by default; peft's half-precision-model LoRA A adapters only
# with ``rms_norm_linear.lora``): a norm whose output only linear projections read (frozen bases, trainable weights
# under full fine-tuning, peft's LoRA A) counts there, and the weight gradients of trainable projections and LoRA A
# adapters rebuild the normalised value from the norm's input instead of saving it; a norm read by anything else stays
# ``rms_norm``, with the reason in ``fuser.explain``.
# ---------------------------------------------------------------------------------------------------------


ALL_PATTERNS = fuser.DEFAULT_PATTERNS
WITHOUT_NORM_LINEAR = tuple(name for name in ALL_PATTERNS if name != "rms_norm_linear")
LORA_ON = {"rms_norm_linear": {"lora": True}}  # the LoRA A rebuild (off by default)

# family → (config class, extra fields, norms per layer that feed only projections, other norms per layer)
FAMILIES = {
    "llama": ("LlamaConfig", {}, 2, 0),  # input norm → q/k/v, post-attention norm → gate/up
    "qwen3": ("Qwen3Config", {}, 2, 2),  # q/k norms feed RoPE
    "gemma": ("GemmaConfig", {}, 2, 0),  # (1 + w) norms
    "phi3": ("Phi3Config", {"pad_token_id": 0}, 2, 0),  # packed qkv_proj and gate_up_proj
    "olmo2": ("Olmo2Config", {}, 0, 4),  # post-norms read by residual adds, q/k norms by RoPE
}


def build_family(family: str, dtype=torch.bfloat16) -> torch.nn.Module:
    cls, extra, _, _ = FAMILIES[family]
    return from_config(cls, {"attn_implementation": "sdpa", "num_hidden_layers": N_LAYERS, **extra}).to(dtype)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient checkpointing"])
@pytest.mark.parametrize("method", ["LoRA", "full"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_explain_counts_the_norms_that_feed_only_projections(family, method, checkpointing):
    """With LoRA and under full fine-tuning: the norms that feed only projections count as rms_norm_linear, every
    other norm (and the final one, whose output the lm_head reads through a slice) as rms_norm."""
    model = with_lora(build_family(family)) if method == "LoRA" else build_family(family)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    config = fuser.FuserConfig(**LORA_ON) if method == "LoRA" else fuser.FuserConfig()
    counts = fuser.explain(model, config=config, **batch()).counts
    _, _, linear, other = FAMILIES[family]
    assert counts.get("rms_norm_linear", 0) == linear * N_LAYERS, counts
    assert counts.get("rms_norm", 0) == other * N_LAYERS + 1, counts


def test_lora_norms_off_by_default_and_why():
    """peft's fp32 adapters on a bf16 model: by default the norms their LoRA A read stay rms_norm, saying so."""
    report = fuser.explain(with_lora(build_family("llama")), **batch())
    assert "rms_norm_linear" not in report.counts and report.counts["rms_norm"] == 2 * N_LAYERS + 1, report.counts
    reasons = {m.reason for m in report.near_misses if m.pattern == "rms_norm_linear"}
    assert any("off by default (rms_norm_linear.lora)" in r for r in reasons), reasons


def test_a_norm_with_another_reader_declines_and_says_why():
    report = fuser.explain(build_family("llama", torch.float32).train(), **batch())
    assert report.counts["rms_norm_linear"] == 2 * N_LAYERS and report.counts["rms_norm"] == 1, report.counts
    reasons = {m.reason for m in report.near_misses if m.pattern == "rms_norm_linear"}
    assert len(reasons) == 1 and "also reads the normalised value: only linear projections may" in reasons.pop()


# a plain residual add stays Inductor's kernel, its sum stored rounded
STORED_SUMS = {"rms_norm": {"residual_add": False}}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient checkpointing"])
@pytest.mark.parametrize(
    "family, dtype, autocast",
    [
        ("llama", torch.bfloat16, False),
        ("gemma", torch.bfloat16, False),
        ("phi3", torch.bfloat16, False),
        ("llama", torch.float32, True),
        ("phi3", torch.float32, True),
    ],
    ids=[
        "llama bf16",
        "gemma bf16",
        "phi3 bf16",
        "llama fp32 weights, bf16 autocast",
        "phi3 fp32 weights, bf16 autocast",
    ],
)
def test_full_fine_tuning_step_equals_the_step_without_it(family, dtype, autocast, checkpointing):
    """Full fine-tuning, every pattern, against the same without rms_norm_linear: the loss and every gradient bit
    for bit. The q/k/v and gate/up weight gradients read the norm's output rebuilt from its input and rstd, which
    is that output exactly (the norm's formula, one rounding; no residual sum is kept wide:
    ``experimental.rms_norm.residual_add`` is off here, since with it the norm reads the unrounded sum and the rebuild
    from the rounded one moves these gradients by a rounding, as under LoRA below); under autocast the rebuilt fp32
    value is cast to bf16 as autocast casts the saved one."""
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager", patterns=ALL_PATTERNS, experimental=STORED_SUMS)
    without = fuser.FuserConfig(
        strict=True, inner_compiler="aot_eager", patterns=WITHOUT_NORM_LINEAR, experimental=STORED_SUMS
    )
    model = build_family(family, dtype).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    since = len(fuser.backend(config).results)
    loss, got = train_step(copy.deepcopy(model), config, autocast=autocast)
    assert fused(config, "rms_norm_linear", since) == 2 * N_LAYERS
    torch._dynamo.reset()
    loss_ref, ref = train_step(model, without, autocast=autocast)
    assert torch.equal(loss, loss_ref) and got.keys() == ref.keys() and len(got) == len(list(model.parameters()))
    for name, g in got.items():
        assert torch.equal(g, ref[name]), name


def test_full_fine_tuning_fp32_step_equals_eager():
    model = build_family("qwen3", torch.float32).train()
    assert_training_step_equals_eager(
        model, fuser.FuserConfig(strict=True, inner_compiler="aot_eager", patterns=ALL_PATTERNS)
    )


def test_autocast_projections_take_their_inputs_cast_by_the_graph(rewritten):
    """fp32 weights under bf16 autocast: each ``linear_normed`` receives the normalised value and its weight already
    in bf16, cast by the graph (Inductor then casts the norm's output once for its projections, and each weight
    once for the forward and the backward's saved copy), so the op's body casts nothing; the step itself is the
    step without rms_norm_linear bit for bit (``test_full_fine_tuning_step_equals_the_step_without_it``)."""
    model = build_family("llama", torch.float32).train()
    train_step(model, STRICT, autocast=True)
    ops = calls(rewritten, torch.ops.fuser.linear_normed.default)
    assert len(ops) == 5 * N_LAYERS  # q, k, v; gate, up
    for op in ops:
        y, weight, dtype = op.args[0], op.args[5], op.args[7]
        assert dtype == torch.bfloat16 and tensor_meta(y).dtype == tensor_meta(weight).dtype == dtype, op.format_node()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize(
    "family, checkpointing",
    [("llama", False), ("gemma", False), ("phi3", False), ("llama", True)],
    ids=["llama", "gemma", "phi3", "llama gradient checkpointing"],
)
def test_lora_step_equals_the_step_without_it_but_for_the_rebuilt_norms(family, checkpointing):
    """bf16 LoRA, every pattern, against the same without rms_norm_linear: the loss bit for bit, and every gradient
    but the LoRA A ones of the projections a norm feeds. Those read the norm rebuilt from its saved input: exact for
    a norm of a stored value (the first layer's), and where the norm read an unrounded residual sum (add_rms_norm,
    issue 16), the norm of its bf16 rounding (as eager computes it): each input within half an ulp (2⁻⁹), the
    normalised value within one more rounding, so the gradient moves by well under 2⁻⁷ relative. (Plain residual
    adds stay Inductor's here, ``experimental.rms_norm.residual_add`` off: Phi-3's pass through a dropout, no LoRA sum
    absorbs them, and they would otherwise join the norm too.)"""
    config = fuser.FuserConfig(
        strict=True, inner_compiler="aot_eager", patterns=ALL_PATTERNS, experimental=STORED_SUMS, **LORA_ON
    )
    without = fuser.FuserConfig(
        strict=True, inner_compiler="aot_eager", patterns=WITHOUT_NORM_LINEAR, experimental=STORED_SUMS
    )
    model = with_lora(build_family(family))
    if checkpointing:  # the norms and their projections inside each layer's nested graph
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    since = len(fuser.backend(config).results)
    loss, got = lora_step(copy.deepcopy(model), config)
    assert fused(config, "rms_norm_linear", since) == 2 * N_LAYERS
    torch._dynamo.reset()
    loss_ref, ref = lora_step(model, without)
    assert torch.equal(loss, loss_ref) and got.keys() == ref.keys()
    rebuilt = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj")
    moved = 0
    for name, g in got.items():
        if "lora_A" in name and any(f".{p}." in name for p in rebuilt):
            assert rel(g, ref[name]) <= 2.0**-7, name
            moved += not torch.equal(g, ref[name])
        else:
            assert torch.equal(g, ref[name]), name
    # Llama's and Gemma's residual norms read the unrounded sum (their rebuild moves some gradients: the comparison
    # sees the rebuild); Phi-3's residual adds pass through a dropout call, so its sums are stored rounded and
    # every norm is rebuilt exactly
    assert (moved == 0) if family == "phi3" else (moved > 0), moved


def test_lora_step_as_close_to_fp32_as_eager():
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager", patterns=ALL_PATTERNS, **LORA_ON)
    since = len(fuser.backend(config).results)
    assert_step_as_close_to_fp32_as_eager(torch.bfloat16, config, lora_model())
    assert fused(config, "rms_norm_linear", since) == 2 * N_LAYERS


@pytest.mark.parametrize("method", ["LoRA", "full"])
def test_the_normalised_values_are_no_longer_saved(method):
    """Inductor's partitioner on a Llama of N_LAYERS layers (hidden 32): the two normalised values per layer, saved
    for the LoRA A weight gradients without the pattern, are not saved with it (``rms_norm_linear.lora``). One tensor
    per model comes back: the first norm's input, the embedding output, which the partitioner recomputed from the
    ids for the norm's backward and now saves, as the first rebuild reads it too (at Llama-3-8B widths: 2 tensors
    fewer per layer, ``benchmarks/saved_activations.py``). Under full fine-tuning the q/k/v and gate/up weight
    gradients saved them too, and the embedding output is saved either way: 2 fewer per layer."""
    model = small_llama(96, layers=N_LAYERS)
    if method == "LoRA":
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    saved = saved_wide_tensors(model.train(), 32, fuser.FuserConfig(patterns=ALL_PATTERNS, **LORA_ON))
    saved_without = saved_wide_tensors(model, 32, fuser.FuserConfig(patterns=WITHOUT_NORM_LINEAR))
    fewer = 2 * N_LAYERS - 1 if method == "LoRA" else 2 * N_LAYERS
    assert len(saved_without) - len(saved) == fewer, (saved, saved_without)


@pytest.mark.parametrize("lora_on", [False, True], ids=["lora off", "lora on"])
def test_a_trained_base_beside_lora_adapters_is_rebuilt_only_with_the_lora_switch(lora_on):
    """One base weight trained beside peft's adapters (layer 0's q_proj): with ``rms_norm_linear.lora`` off the
    adapters save the norm's output anyway, so the norm stays rms_norm and the trained base keeps its plain linear
    (a rebuild there would only add work); with it on, that base is rebuilt too (one ``linear_normed``)."""
    model = with_lora(build_family("llama"))
    model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.requires_grad_(True)
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager", rms_norm_linear={"lora": lora_on})
    since = len(fuser.backend(config).results)
    fuser.optimize(model, config)(**batch()).loss.backward()
    assert fused(config, "rms_norm_linear", since) == (2 * N_LAYERS if lora_on else 0)
    assert refined(config, since).get("rms_norm_linear", 0) == (1 if lora_on else 0)


def test_lora_adapters_upcast_linear_declines_leave_the_norm_to_rms_norm():
    """With ``rms_norm_linear.lora``: peft's fp32 adapters on a bf16 model run under bf16 autocast, so their
    ``linear(y.float(), A)`` returns bf16, which upcast_linear declines (the op computes the fp32 linear). The norm's
    output is then saved for them as before: the norm must not count as rms_norm_linear, and says why."""
    model = with_lora(build_family("llama")).train()
    config = fuser.FuserConfig(**LORA_ON)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = fuser.explain(model, config=config, **batch())
    assert "rms_norm_linear" not in report.counts and report.counts["rms_norm"] == 2 * N_LAYERS + 1, report.counts
    reasons = {m.reason for m in report.near_misses if m.pattern == "rms_norm_linear"}
    assert any("which upcast_linear declines: the linear returns torch.bfloat16 (autocast?)" in r for r in reasons)


# ---------------------------------------------------------------------------------------------------------
# The residual add in the norm (``experimental.rms_norm.residual_add``, on by default) under full fine-tuning: the
# residual add that a fused RMSNorm reads (a decoder layer's ``h + attn_out`` before its post-attention norm, ``h +
# mlp_out`` before the next layer's input norm or the final norm) becomes one ``fuser::add_rms_norm`` with the norm,
# whichever of ``rms_norm`` and ``rms_norm_linear`` took the norm; the residual stream reads the op's rounded sum.
# Counted in the rewritten graphs the backend compiles; the step checked against eager fp32 (fp32 models) or against
# an fp32 copy, as close as the step without it (bf16 models).
# ---------------------------------------------------------------------------------------------------------


OPS = torch.ops.fuser
RESIDUAL_ARCHS = ["llama", "qwen3", "gemma"]  # Qwen3 adds per-head q/k norms, which read projections; Gemma's are 1 + w
U_BF16 = 2.0**-8  # bf16's unit roundoff: half an ulp, relative
# two decoder layers here, where the rest of the file has one: the second layer's input norm is the one that takes
# the previous layer's MLP residual add, with its q/k/v rebuilds reading the op's sum
RESIDUAL_LAYERS = 2


def residual_config(residual_add: bool = True, **fields) -> fuser.FuserConfig:
    return fuser.FuserConfig(
        strict=True, inner_compiler="aot_eager", experimental={"rms_norm": {"residual_add": residual_add}}, **fields
    )


def residual_norms(layers: int = RESIDUAL_LAYERS) -> int:
    """The norms that read a residual add: each layer's input and post-attention norms but the first layer's input
    norm (it reads the embeddings; Gemma's scaled by √hidden, a multiply), plus the final norm."""
    return 2 * layers - 1 + 1


@pytest.mark.parametrize("arch", RESIDUAL_ARCHS)
def test_fp32_step_equals_eager_with_every_residual_add_in_its_norm(arch, rewritten):
    """fp32: the op computes eager's formulas (the add, the norm of it, dx + dh) in fp32, only in another order of
    summation: loss within 1e-6 and every gradient within 1e-5 relative (measured ≤ 4e-7). The sum's other reader
    (the next residual add) takes the op's third output, and so do ``linear_normed``'s weight-gradient rebuilds of
    the projections after the norm. Every norm fused (``test_fp32_training_step_equals_eager``'s count)."""
    model = build(arch, layers=RESIDUAL_LAYERS).train()
    loss_ref, ref = train_step(copy.deepcopy(model))
    loss, got = train_step(model, residual_config())
    assert fused_norms(fuser.backend(residual_config()).counts) == expected_norms(arch, RESIDUAL_LAYERS)
    fused = calls(rewritten, OPS.add_rms_norm.default)
    assert len(fused) == residual_norms(), [n.args[:2] for n in fused]
    assert len(calls(rewritten, OPS.rms_norm.default)) == expected_norms(arch, RESIDUAL_LAYERS) - residual_norms()
    # the q/k/v (input norms) and gate/up (post-attention norms) weight gradients rebuild from the op's sum
    rebuilt = [n.args[1] for n in calls(rewritten, OPS.linear_normed.default)]
    from_sums = [h for h in rebuilt if h.target is operator.getitem and h.args[0] in fused and h.args[1] == 2]
    assert len(from_sums) == 3 * (RESIDUAL_LAYERS - 1) + 2 * RESIDUAL_LAYERS, rebuilt
    assert rel(loss, loss_ref) <= 1e-6, (loss, loss_ref)
    assert got.keys() == ref.keys() and len(got) == len(list(model.parameters()))
    for name, g in got.items():
        assert rel(g, ref[name]) <= 1e-5, name


@pytest.mark.parametrize("arch", RESIDUAL_ARCHS)
def test_bf16_step_as_close_to_fp32_as_without_it(arch, rewritten):
    """bf16, against an fp32 copy: with residual_add on and off, the loss and every gradient. The two runs differ in
    where values are rounded: with it the norm reads the sum before its rounding to bf16 (a difference of at most
    half an ulp, 2⁻⁹ relative, per element), and the residual stream's gradient is added to the norm's dx in fp32
    and rounded once, not rounded, added and rounded again. Each is one rounding, so a value's distance from fp32
    moves by at most one bf16 rounding of it, U_BF16 = 2⁻⁸ relative, and the loss's and each gradient's no more
    than that, as far as the step's arithmetic carries the difference on unamplified (the bar of
    test_gpu.py too). Measured by this test's steps (CPU, aot_eager, build seed 0, torch 2.13,
    2026-12-03): the largest rise of one gradient's relative error 1.7e-3, of the loss's 3e-5. With it off, no
    add_rms_norm at all."""
    model = build(arch, torch.bfloat16, layers=RESIDUAL_LAYERS).train()
    loss32, grads32 = train_step(copy.deepcopy(model).float())
    errors = {}
    for on in (True, False):
        torch._dynamo.reset()
        rewritten.clear()
        loss, got = train_step(copy.deepcopy(model), residual_config(on))
        assert len(calls(rewritten, OPS.add_rms_norm.default)) == (residual_norms() if on else 0)
        assert got.keys() == grads32.keys() and len(got) == len(list(model.parameters()))
        errors[on] = rel(loss, loss32), {name: rel(g, grads32[name]) for name, g in got.items()}
    (loss_on, grads_on), (loss_off, grads_off) = errors[True], errors[False]
    assert loss_on <= loss_off + U_BF16, (loss_on, loss_off)
    for name, err in grads_on.items():
        assert err <= grads_off[name] + U_BF16, f"{name}: {err:.2e} on, {grads_off[name]:.2e} off"


@pytest.mark.parametrize("arch", RESIDUAL_ARCHS)
def test_autocast_step_with_fp32_weights_equals_the_step_without_it(arch, rewritten):
    """fp32 weights under bf16 autocast (a trainer's ``bf16=True`` on an fp32 model): each residual add sums the fp32
    stream and a bf16 projection into fp32. The op computes that sum in fp32 as eager's add does, the norm of it,
    and in the backward the stream's gradient plus the norm's in fp32, handing the projection its bf16 rounding, as
    autograd's add does: so the step is the step without it, bit for bit (loss and every gradient)."""
    model = build(arch, layers=RESIDUAL_LAYERS).train()

    def autocast_step(cfg):
        copied = copy.deepcopy(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fuser.optimize(copied, cfg)(**batch())
        out.loss.backward()
        return out.loss.detach(), grads(copied)

    results = {}
    for on in (True, False):
        torch._dynamo.reset()
        rewritten.clear()
        results[on] = autocast_step(residual_config(on))
        fused = calls(rewritten, OPS.add_rms_norm.default)
        assert len(fused) == (residual_norms() if on else 0)
        assert all(tensor_meta(op.args[0]).dtype == torch.float32 for op in fused)
    (loss_on, grads_on), (loss_off, grads_off) = results[True], results[False]
    assert torch.equal(loss_on, loss_off), (loss_on, loss_off)
    assert grads_on.keys() == grads_off.keys() and len(grads_on) == len(list(model.parameters()))
    for name, g in grads_on.items():
        assert torch.equal(g, grads_off[name]), f"{name}: {rel(g, grads_off[name]):.2e}"


def test_checkpointed_layers_absorb_the_adds_inside_them(rewritten):
    """Gradient checkpointing: each layer is a nested graph whose input is a placeholder there, so only the add before
    its post-attention norm is inside it with its norm (one per layer); the step still equals eager's."""
    model = checkpointed(build("llama", layers=RESIDUAL_LAYERS))
    loss_ref, ref = train_step(copy.deepcopy(model))
    loss, got = train_step(model, residual_config())
    nested = [m for gm in rewritten for _, m in subgraph_modules(gm)]
    assert len(calls(nested, OPS.add_rms_norm.default)) == RESIDUAL_LAYERS
    assert rel(loss, loss_ref) <= 1e-6
    for name, g in got.items():
        assert rel(g, ref[name]) <= 1e-5, name


def test_rms_norm_linear_norms_alone_absorb_their_adds(rewritten):
    """With the rms_norm pattern off, the norms rms_norm_linear takes (every layer's two) still absorb their adds (its
    refinement runs it); the final norm, then not fused, keeps its add."""
    patterns = tuple(name for name in fuser.DEFAULT_PATTERNS if name != "rms_norm")
    model = build("llama", layers=RESIDUAL_LAYERS).train()
    loss_ref, ref = train_step(copy.deepcopy(model))
    loss, got = train_step(model, residual_config(patterns=patterns))
    assert len(calls(rewritten, OPS.add_rms_norm.default)) == 2 * RESIDUAL_LAYERS - 1
    assert len(calls(rewritten, OPS.rms_norm.default)) == 1  # the first layer's input norm
    assert rel(loss, loss_ref) <= 1e-6
    for name, g in got.items():
        assert rel(g, ref[name]) <= 1e-5, name


# ---------------------------------------------------------------------------------------------------------
# Which adds a norm absorbs: toy graphs
# ---------------------------------------------------------------------------------------------------------


class Norm(torch.nn.Module):
    """Llama's RMSNorm."""

    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden, dtype=dtype))

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class Residual(torch.nn.Module):
    """``h = a + b`` spelt as ``case`` says, a norm of it, and the residual stream's next add reading it too."""

    def __init__(self, case: str, hidden: int = 64, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.case = case
        self.norm, self.other_norm = Norm(hidden, dtype), Norm(hidden, dtype)
        self.bias = torch.nn.Parameter(torch.randn(hidden, dtype=dtype))

    def forward(self, a, b):
        if self.case == "operator.add":
            h = a + b
        elif self.case == "torch.add":
            h = torch.add(a, b)
        elif self.case == "Tensor.add":
            h = a.add(b)
        elif self.case == "alpha":
            h = torch.add(a, b, alpha=2)
        elif self.case == "broadcast":
            h = a + self.bias  # [hidden] over [batch, tokens, hidden]
        elif self.case == "dtypes":
            h = a + b.float()  # bf16 + fp32: an fp32 sum, as autocast's bf16 projection into an fp32 stream
        elif self.case == "mixed halves":
            h = a + b.half()  # bf16 + fp16: PyTorch promotes to fp32, a dtype neither operand has
        elif self.case == "in place":
            h = a + b
            h.mul_(2)  # the norm reads the sum modified: an op in the add's place would read it as added
        else:  # "two norms"
            h = a + b
            return self.norm(h) + self.other_norm(h), h + b
        return self.norm(h), h + b


def run_toy(case, dtype, rewritten):
    """(add_rms_norm calls, rms_norm calls) in the rewritten graph of ``Residual(case)``, whose results are eager's."""
    torch.manual_seed(0)
    module = Residual(case, dtype=dtype)
    a, b = (torch.randn(2, 5, 64, dtype=dtype) for _ in range(2))
    y_ref, h_ref = module(a, b)
    y, h = fuser.optimize(module, residual_config())(a, b)
    tol = 1e-5 if dtype == torch.float32 else 2.0**-7
    assert torch.allclose(y, y_ref, rtol=tol, atol=tol) and torch.equal(h, h_ref)
    return len(calls(rewritten, OPS.add_rms_norm.default)), len(calls(rewritten, OPS.rms_norm.default))


@pytest.mark.parametrize("case", ["operator.add", "torch.add", "Tensor.add"])
def test_a_plain_add_joins_the_norm(case, rewritten):
    assert run_toy(case, torch.float32, rewritten) == (1, 0)


def test_a_half_value_added_into_an_fp32_one_joins_the_norm(rewritten):
    """bf16 + fp32 into an fp32 sum (autocast's projection into the fp32 residual stream): the op takes the fp32
    operand as x, so its sum is fp32, eager's value bit for bit (run_toy checks it)."""
    assert run_toy("dtypes", torch.bfloat16, rewritten) == (1, 0)
    (op,) = calls(rewritten, OPS.add_rms_norm.default)
    assert [tensor_meta(a).dtype for a in op.args[:2]] == [torch.float32, torch.bfloat16]


@pytest.mark.parametrize(
    "case, dtype, reason",
    [
        ("broadcast", torch.float32, "broadcasts"),
        ("mixed halves", torch.bfloat16, "nor an fp32 and a half-precision one summed in fp32"),
        ("two norms", torch.float32, "feeds 2 norms"),
        ("alpha", torch.float32, "is not an add"),
        ("in place", torch.float32, "before the norm does"),
    ],
)
def test_an_add_the_op_cannot_take_stays_apart_and_says_why(case, dtype, reason, rewritten, caplog):
    caplog.set_level(logging.DEBUG, logger="fuser")
    absorbed, norms = run_toy(case, dtype, rewritten)
    assert absorbed == 0 and norms == (2 if case == "two norms" else 1)
    assert any("keeps its input apart" in r.message and reason in r.message for r in caplog.records), caplog.text


def test_off_leaves_every_add(rewritten):
    torch.manual_seed(0)
    module = Residual("operator.add")
    fuser.optimize(module, residual_config(False))(torch.randn(2, 5, 64), torch.randn(2, 5, 64))
    assert not calls(rewritten, OPS.add_rms_norm.default) and len(calls(rewritten, OPS.rms_norm.default)) == 1


# ---------------------------------------------------------------------------------------------------------
# GPU: the Triton kernels under Inductor
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_llama_1024_bf16_step_with_residual_add_as_close_to_fp32_as_without_it():
    """A 2-layer Llama at hidden 1024 in bf16 on the GPU, Inductor, one full fine-tuning step with residual_add on
    and off against an fp32 copy: each within eager bf16's bar (test_gpu.py: 1.5x eager bf16's
    error + U_BF16), and the on-run's error not above the off-run's by more than one bf16 ulp, 2⁻⁷ relative: the two
    compiled steps differ by the roundings the op removes (half an ulp each, U_BF16, as on CPU) and by Inductor's
    own kernels around the add (the off-run's add kernel, fused with its neighbours; the sums of the residual
    gradients it computes in another order), one more half-ulp-scale draw."""
    base = from_config("LlamaConfig", WIDE_LLAMA).cuda()
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    data = {k: v.cuda() for k, v in batch(seq=256, bsz=4).items()}

    def run(model, cfg=None):
        out = (model if cfg is None else fuser.optimize(model, cfg))(**data)
        out.loss.backward()
        return out.loss.detach(), grads(model)

    loss32, grads32 = run(copy.deepcopy(base))
    loss16, grads16 = run(copy.deepcopy(base).bfloat16())
    errors = {}
    for on in (True, False):
        torch._dynamo.reset()
        cfg = fuser.FuserConfig(strict=True, experimental={"rms_norm": {"residual_add": on}})
        loss, got = run(copy.deepcopy(base).bfloat16(), cfg)
        expected = residual_norms(tiny.N_LAYERS) if on else 0  # WIDE_LLAMA: tiny's layer count
        assert sum(r.refined.get("rms_norm", 0) for r in fuser.backend(cfg).results) == expected
        errors[on] = rel(loss, loss32), {name: rel(g, grads32[name]) for name, g in got.items()}
        assert errors[on][0] <= 1.5 * rel(loss16, loss32) + U_BF16
        for name, err in errors[on][1].items():
            assert err <= 1.5 * rel(grads16[name], grads32[name]) + U_BF16, (on, name, err)
    (loss_on, grads_on), (loss_off, grads_off) = errors[True], errors[False]
    assert loss_on <= loss_off + 2 * U_BF16, (loss_on, loss_off)
    for name, err in grads_on.items():
        assert err <= grads_off[name] + 2 * U_BF16, f"{name}: {err:.2e} on, {grads_off[name]:.2e} off"


# ---------------------------------------------------------------------------------------------------------
# A norm fed by a LoRA sum reads that sum's fp32 value (issue 16), as Inductor computes the norm fused with peft's
# cast: the norm after a residual add over the o/down LoRA sums takes the fp32 add, Qwen3's q/k norms and Gemma-style
# norms right after a projection take ``fuser::lora_sum_wide``'s fp32 sum. The norm's cast of its normalised value
# before the weight multiply (Llama's ``.to(in_dtype)``) is computed in fp32 too. Every case: the graph is checked,
# and the bf16 step is at least as close to fp32 as eager bf16's.
# ---------------------------------------------------------------------------------------------------------


# the norms' own subject: the v sums' fp32 bases (test_lora.py) off, so that a gradient
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


def test_llama_norms_read_the_residual_adds_and_the_step_is_as_close_to_fp32_as_eager(monkeypatch):
    seen = wide_norms(monkeypatch)
    model = with_lora(build("llama", torch.bfloat16))
    loss32, grads32 = train_step(copy.deepcopy(model).float())
    loss16, grads16 = train_step(copy.deepcopy(model))
    loss, got = train_step(model, AOT_NORMS)
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
    loss32, grads32 = train_step(copy.deepcopy(model).float())
    loss16, grads16 = train_step(copy.deepcopy(model))
    loss_ind, grads_ind = train_step(copied := copy.deepcopy(model), run=torch.compile(copied))
    loss, got = train_step(model, STRICT)
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
    loss_ref, grads_ref = train_step(copy.deepcopy(model))
    loss, got = train_step(model, STRICT)
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


# ---------------------------------------------------------------------------------------------------------
# The norm's backward sums its output gradient (``experimental.rms_norm.gradient_sums``, the post-grad pass
# ``norm_grad_sums``, on by default): a fused norm's output gradient, which the backward graph forms as the sum of the
# input gradients of the projections the norm feeds (q, k and v; gate and up), is summed by the norm's backward kernel
# instead of an add kernel before it. Through Inductor on CPU (its caches off, so the post-grad passes run): one
# rewrite per norm that feeds projections, fp32 steps equal bit for bit to the steps without it, bf16 steps as close
# to an fp32 copy as without it.
# ---------------------------------------------------------------------------------------------------------


# the tests that read inductor_steps.py's steps (each computed once there) are marked with its pytest-xdist group

SUMS_ON = fuser.FuserConfig.from_options({"strict": True, "experimental.rms_norm.gradient_sums": True})
SUMS_OFF = fuser.FuserConfig.from_options({"strict": True, "experimental.rms_norm.gradient_sums": False})
# Gemma's norms take 1 + w and feed GeGLU; Qwen3's q/k norms read projections instead of feeding them (no sums)
FP32_ARCHS = ["llama", "gemma"]
BF16_ARCHS = ["llama", "qwen3"]


def sums_step(model, config):
    """(loss, gradients) of one training step through fuser, and how many norm backwards took their sums."""
    step, counts = post_grad_step(model, config)
    return step, counts.get("norm_grad_sums", 0)


def shared_step(model, config):
    """``step`` of ``inductor_steps.MODELS[model]``, read from the one computed there."""
    shared = inductor_step(model, config)
    return shared.loss_and_grads(), shared.post_grad_counts.get("norm_grad_sums", 0)


@XDIST_GROUP
@pytest.mark.usefixtures("inductor_caches_off")
@pytest.mark.parametrize("arch", FP32_ARCHS)
def test_fp32_full_fine_tuning_takes_every_projection_sum_and_the_step_is_unchanged(arch):
    """Each layer's two norms feed projections (q/k/v, gate/up): two sums per layer. In fp32 the kernel adds the
    terms in fp32, left to right, as Inductor's add kernel did: the same step bit for bit."""
    model = build(arch).train()
    on, taken = shared_step(arch, SUMS_ON)  # of build(arch).train()
    off, taken_off = sums_step(copy.deepcopy(model), SUMS_OFF)
    assert taken == 2 * N_LAYERS and taken_off == 0
    assert_same_step(on, off)


@XDIST_GROUP
@pytest.mark.usefixtures("inductor_caches_off")
@pytest.mark.parametrize("arch", BF16_ARCHS)
def test_bf16_full_fine_tuning_is_as_close_to_fp32_as_without_it(arch):
    """bf16: the sum is no longer rounded to bf16 before the norm's backward reads it, one rounding fewer. So every
    gradient's relative error against an fp32 copy's step moves by at most one bf16 rounding (U_BF16) either way,
    and the loss (computed before the backward) is the same. (The fp32 copy's step is eager's: a reference, which an
    Inductor compile of its own only made longer.)"""
    model = build(arch, torch.bfloat16).train()
    _, grads32 = train_step(copy.deepcopy(model).float())
    (loss_on, grads_on), taken = shared_step(f"{arch} bf16", SUMS_ON)  # of build(arch, torch.bfloat16).train()
    (loss_off, grads_off), _ = sums_step(copy.deepcopy(model), SUMS_OFF)
    assert taken == 2 * N_LAYERS
    assert torch.equal(loss_on, loss_off)
    assert grads_on.keys() == grads32.keys() and len(grads_on) == len(list(model.parameters()))
    moved = 0
    for name, g in grads_on.items():
        err_on, err_off = rel(g, grads32[name]), rel(grads_off[name], grads32[name])
        assert err_on <= err_off + U_BF16, f"{name}: {err_on:.2e} with the sums, {err_off:.2e} without"
        moved += not torch.equal(g, grads_off[name])
    assert moved, "no gradient changed: the sums were rounded as before"


@XDIST_GROUP
@pytest.mark.usefixtures("inductor_caches_off")
def test_lora_takes_the_sums_of_the_adapted_projections():
    """peft's LoRA on every linear layer (bf16 base, fp32 adapters): the norms' output gradients are sums of the
    adapted projections' input gradients too; the step stays as close to fp32 as without it (the fp32 copy's step:
    eager's)."""
    model = lora_model()
    _, grads32 = train_step(copy.deepcopy(model).float())
    (_, grads_on), taken = shared_step("lora", SUMS_ON)  # of lora_model()
    (_, grads_off), _ = sums_step(copy.deepcopy(model), SUMS_OFF)
    # every norm but the first layer's input norm (the embeddings are frozen: its backward does not run)
    assert taken == 2 * N_LAYERS - 1
    for name, g in grads_on.items():
        assert rel(g, grads32[name]) <= rel(grads_off[name], grads32[name]) + U_BF16, name


@XDIST_GROUP
@pytest.mark.usefixtures("inductor_caches_off")
def test_checkpointed_layers_take_their_sums():
    model = checkpointed(build("llama"))
    on, taken = shared_step("checkpointed llama", SUMS_ON)
    off, _ = sums_step(copy.deepcopy(model), SUMS_OFF)
    assert taken == 2 * N_LAYERS
    assert_same_step(on, off)


CAST_PASSES = ("norm_grad_upcasts", "output_casts", "rope_grad_upcasts")


def autocast_step(model, config):
    """``sums_step`` under bf16 autocast; also how many calls each cast pass rewrote ({pass: calls})."""
    step, counts = post_grad_step(model, config, autocast=True)
    return step, {name: counts.get(name, 0) for name in CAST_PASSES}


@pytest.mark.usefixtures("inductor_caches_off")
def test_autocast_norm_backwards_read_the_bf16_terms_and_the_step_is_unchanged():
    """fp32 weights under bf16 autocast (a trainer's ``bf16=True`` on an fp32 model): every norm's output gradient
    terms are bf16 projection gradients (q/k/v, gate/up; the lm_head's for the final norm) widened to fp32 by
    autocast's casts. Each norm backward reads them as bf16 and widens them as it loads them: the same values, the
    same sum, so the step is the step with both passes off, bit for bit."""
    model = build("llama").train()
    model.config.use_cache = False  # a cache would read the rotated k in fp32: its cast then stays (and q's with it)
    on, taken = autocast_step(copy.deepcopy(model), SUMS_ON)
    off, taken_off = autocast_step(copy.deepcopy(model), SUMS_OFF)
    # every layer's two norms and the final norm; the casts of those norms' outputs and of each layer's rotation,
    # and the rotations' gradients (on either way)
    others = {"output_casts": 2 * N_LAYERS + 1 + N_LAYERS, "rope_grad_upcasts": N_LAYERS}
    assert taken == {"norm_grad_upcasts": 2 * N_LAYERS + 1, **others}
    assert taken_off == {"norm_grad_upcasts": 0, **others}
    assert_same_step(on, off)


# ---------------------------------------------------------------------------------------------------------
# Which sums the pass takes: toy post-grad graphs
# ---------------------------------------------------------------------------------------------------------


def _graph(case: str) -> torch.fx.Graph:
    """A post-grad-like graph: three projection gradients summed into the norm's backward, spelt as ``case`` says."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(a, b, c, x, w, rstd):
        s = a + b
        if case == "another reader":
            s2 = s + c
            dx, dw = torch.ops.fuser.rms_norm_backward(s2, x, w, rstd, 1e-6, 0.0, None, True)
            return dx, dw, s2
        if case == "in place between":
            s2 = s + c
            a.mul_(2)
            return torch.ops.fuser.rms_norm_backward(s2, x, w, rstd, 1e-6, 0.0, None, True)
        if case == "broadcast":
            s2 = s + c[0]
            return torch.ops.fuser.rms_norm_backward(s2, x, w, rstd, 1e-6, 0.0, None, True)
        if case == "four terms":
            s2 = s + c + x
            return torch.ops.fuser.rms_norm_backward(s2, x, w, rstd, 1e-6, 0.0, None, True)
        if case == "five terms":
            s2 = s + c + x + a
            return torch.ops.fuser.rms_norm_backward(s2, x, w, rstd, 1e-6, 0.0, None, True)
        s2 = s + c
        return torch.ops.fuser.rms_norm_backward(s2, x, w, rstd, 1e-6, 0.0, None, True)

    with FakeTensorMode() as mode:
        args = [mode.from_tensor(torch.randn(4, 8)) for _ in range(4)]
        args += [mode.from_tensor(torch.randn(8)), mode.from_tensor(torch.randn(4))]
        return make_fx(f, tracing_mode="fake")(*args).graph


def _norm_terms(graph: torch.fx.Graph) -> list[int]:
    from fuser.inductor.norm_grad_sums import apply_norm_grad_sums, plan_norm_grad_sums

    apply_norm_grad_sums(graph, plan_norm_grad_sums(graph))
    graph.lint()
    norms = [n for n in graph.nodes if n.target is torch.ops.fuser.rms_norm_backward.default]
    return [1 + sum(n.kwargs.get(k) is not None for k in ("dy2", "dy3", "dy4")) for n in norms]


def test_a_sum_of_three_terms_becomes_the_norms_own():
    assert _norm_terms(_graph("three")) == [3]


def test_four_terms_become_the_norms_own():
    # peft's LoRA on q, k and v: the three base projections' input gradients and the grouped A adapters'
    graph = _graph("four terms")
    assert _norm_terms(graph) == [4]
    assert not any(n.target is torch.ops.aten.add.Tensor for n in graph.nodes)


def test_five_terms_keep_one_add():
    # the kernel takes four terms: the first add of the chain stays, its result one of the four
    graph = _graph("five terms")
    assert _norm_terms(graph) == [4]
    assert sum(n.target is torch.ops.aten.add.Tensor for n in graph.nodes) == 1


@pytest.mark.parametrize("case", ["another reader", "in place between", "broadcast"])
def test_a_sum_it_cannot_take_stays(case):
    # another reader needs the sum; an op in place between the sum and the norm would change a term the norm reads
    # later; a broadcast term is not dy's shape
    assert _norm_terms(_graph(case)) == [1]


def _upcast_graph(case: str) -> torch.fx.Graph:
    """A post-grad-like graph: a norm backward reading terms that ``case`` spells as upcasts or not."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(a, b, x, w, rstd):
        up = torch.ops.prims.convert_element_type.default
        a32, b32 = up(a, torch.float32), up(b, torch.float32)
        if case == "one not upcast":
            b32 = b.float() * 2
        if case == "another reader":
            dx, dw = torch.ops.fuser.rms_norm_backward(a32, x, w, rstd, 1e-6, 0.0, None, True, dy2=b32)
            return dx, dw, a32
        if case == "one upcast twice":
            return torch.ops.fuser.rms_norm_backward(a32, x, w, rstd, 1e-6, 0.0, None, True, dy2=a32)
        if case == "fp16 and bf16":
            b32 = up(b.to(torch.float16), torch.float32)
        return torch.ops.fuser.rms_norm_backward(a32, x, w, rstd, 1e-6, 0.0, None, True, dy2=b32)

    with FakeTensorMode() as mode:
        args = [mode.from_tensor(torch.randn(4, 8, dtype=torch.bfloat16)) for _ in range(2)]
        args += [mode.from_tensor(torch.randn(*shape)) for shape in ((4, 8), (8,), (4,))]
        return make_fx(f, tracing_mode="fake")(*args).graph


def _upcasts_taken(graph: torch.fx.Graph) -> int:
    from fuser.inductor.norm_grad_sums import apply_norm_grad_upcasts, plan_norm_grad_upcasts

    taken = apply_norm_grad_upcasts(graph, plan_norm_grad_upcasts(graph))
    graph.lint()
    return taken


def test_a_norm_backward_reads_its_upcast_terms_as_they_were():
    graph = _upcast_graph("both upcast")
    assert _upcasts_taken(graph) == 1
    (norm,) = [n for n in graph.nodes if n.target is torch.ops.fuser.rms_norm_backward.default]
    from fuser.engine.protocol import call_args

    terms = call_args(norm)
    assert terms["dy"].op == terms["dy2"].op == "placeholder", norm.format_node()
    assert not any(n.target is torch.ops.prims.convert_element_type.default for n in graph.nodes)


@pytest.mark.parametrize("case", ["one not upcast", "another reader", "one upcast twice", "fp16 and bf16"])
def test_upcasts_stay_where_a_term_is_not_one_or_the_dtypes_differ(case):
    # every term or none (the op takes terms of one dtype); an upcast another node reads stays for it
    assert _upcasts_taken(_upcast_graph(case)) == 0


@pytest.mark.gpu
@pytest.mark.usefixtures("inductor_caches_off")
def test_gpu_llama_1024_bf16_step_with_gradient_sums_as_close_to_fp32_as_without_it():
    """A 2-layer Llama at hidden 1024 in bf16 on the GPU through Inductor (the Triton kernel), one full fine-tuning
    step with the sums on and off against an fp32 copy: two sums per layer taken, each gradient within one bf16
    rounding (U_BF16) of the off-run's distance from fp32, and within eager bf16's bar
    (test_gpu.py: 1.5× eager bf16's error + U_BF16)."""
    base = from_config("LlamaConfig", WIDE_LLAMA).cuda()
    data = {k: v.cuda() for k, v in batch(seq=256, bsz=4).items()}

    def run(model, config=None):
        backend = None if config is None else fuser.backend(config)
        before = 0 if backend is None else backend.post_grad_counts.get("norm_grad_sums", 0)
        out = (model if config is None else fuser.optimize(model, config))(**data)
        out.loss.backward()
        taken = 0 if backend is None else backend.post_grad_counts.get("norm_grad_sums", 0) - before
        torch._dynamo.reset()
        return grads(model), taken

    grads32, _ = run(copy.deepcopy(base))
    grads16, _ = run(copy.deepcopy(base).bfloat16())
    got_on, taken = run(copy.deepcopy(base).bfloat16(), SUMS_ON)
    got_off, _ = run(copy.deepcopy(base).bfloat16(), SUMS_OFF)
    assert taken == 2 * tiny.N_LAYERS  # WIDE_LLAMA: tiny's layer count
    for name, g in got_on.items():
        err_on, err_off = rel(g, grads32[name]), rel(got_off[name], grads32[name])
        assert err_on <= err_off + U_BF16, (name, err_on, err_off)
        assert err_on <= 1.5 * rel(grads16[name], grads32[name]) + U_BF16, (name, err_on)


@pytest.mark.gpu
@pytest.mark.usefixtures("inductor_caches_off")
def test_gpu_llama_1024_autocast_step_reads_bf16_terms_and_is_as_close_to_fp32_as_eager():
    """fp32 weights under bf16 autocast on the GPU (Inductor, the Triton kernels): every norm backward reads its bf16
    gradient terms (``norm_grad_upcasts``: each layer's two norms and the final norm), and the step's loss and
    gradients stay as close to the fp32 step's as eager autocast's, by test_gpu.py's bar
    (1.5× eager's error + U_BF16)."""
    base = from_config("LlamaConfig", {**WIDE_LLAMA, "use_cache": False}).cuda()
    data = {k: v.cuda() for k, v in batch(seq=256, bsz=4).items()}

    def run(model, config=None, amp=True):
        backend = None if config is None else fuser.backend(config)
        before = 0 if backend is None else backend.post_grad_counts.get("norm_grad_upcasts", 0)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            out = (model if config is None else fuser.optimize(model, config))(**data)
        out.loss.backward()
        taken = 0 if backend is None else backend.post_grad_counts.get("norm_grad_upcasts", 0) - before
        torch._dynamo.reset()
        return out.loss.detach(), grads(model), taken

    loss32, grads32, _ = run(copy.deepcopy(base), amp=False)
    loss_eager, grads_eager, _ = run(copy.deepcopy(base))
    loss, got, taken = run(copy.deepcopy(base), SUMS_ON)
    assert taken == 2 * tiny.N_LAYERS + 1  # WIDE_LLAMA: tiny's layer count
    assert rel(loss, loss32) <= 1.5 * rel(loss_eager, loss32) + U_BF16, (loss, loss_eager, loss32)
    assert got.keys() == grads32.keys() and got
    for name, g in got.items():
        err, err_eager = rel(g, grads32[name]), rel(grads_eager[name], grads32[name])
        assert err <= 1.5 * err_eager + U_BF16, (name, err, err_eager)
