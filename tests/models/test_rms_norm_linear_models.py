"""Tier 3: ``rms_norm_linear`` (on by default; peft's half-precision-model LoRA A adapters only with
``rms_norm_linear.lora``) on tiny models of five families. A norm whose output only linear projections read (frozen
bases, trainable weights under full fine-tuning, peft's LoRA A) counts there, and the weight gradients of trainable
projections and LoRA A adapters rebuild the normalised value from the norm's input instead of saving it; a norm
read by anything else stays ``rms_norm``, with the reason in ``fuser.explain``."""

from __future__ import annotations

import copy

import peft
import pytest
import torch

import fuser
from tests.models.tiny import (
    N_LAYERS,
    assert_step_as_close_to_fp32_as_eager,
    assert_training_step_equals_eager,
    batch,
    from_config,
    grads,
    lora_step,
    rel,
    saved_wide_tensors,
    small_llama,
)

ON = fuser.DEFAULT_PATTERNS
WITHOUT = tuple(name for name in ON if name != "rms_norm_linear")
LORA_ON = {"rms_norm_linear": {"lora": True}}  # the LoRA A rebuild (off by default)

# family → (config class, extra fields, norms per layer that feed only projections, other norms per layer)
FAMILIES = {
    "llama": ("LlamaConfig", {}, 2, 0),  # input norm → q/k/v, post-attention norm → gate/up
    "qwen3": ("Qwen3Config", {}, 2, 2),  # q/k norms feed RoPE
    "gemma": ("GemmaConfig", {}, 2, 0),  # (1 + w) norms
    "phi3": ("Phi3Config", {"pad_token_id": 0}, 2, 0),  # packed qkv_proj and gate_up_proj
    "olmo2": ("Olmo2Config", {}, 0, 4),  # post-norms read by residual adds, q/k norms by RoPE
}


def lora(model: torch.nn.Module) -> torch.nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    return peft.get_peft_model(model, config)


def build(family: str, dtype=torch.bfloat16) -> torch.nn.Module:
    cls, extra, _, _ = FAMILIES[family]
    return from_config(cls, {"attn_implementation": "sdpa", **extra}).to(dtype)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient checkpointing"])
@pytest.mark.parametrize("method", ["LoRA", "full"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_explain_counts_the_norms_that_feed_only_projections(family, method, checkpointing):
    """With LoRA and under full fine-tuning: the norms that feed only projections count as rms_norm_linear, every
    other norm (and the final one, whose output the lm_head reads through a slice) as rms_norm."""
    model = lora(build(family)) if method == "LoRA" else build(family)
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
    report = fuser.explain(lora(build("llama")), **batch())
    assert "rms_norm_linear" not in report.counts and report.counts["rms_norm"] == 2 * N_LAYERS + 1, report.counts
    reasons = {m.reason for m in report.near_misses if m.pattern == "rms_norm_linear"}
    assert any("off by default (rms_norm_linear.lora)" in r for r in reasons), reasons


def test_a_norm_with_another_reader_declines_and_says_why():
    report = fuser.explain(build("llama", torch.float32).train(), **batch())
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
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager", patterns=ON, experimental=STORED_SUMS)
    without = fuser.FuserConfig(strict=True, inner_compiler="aot_eager", patterns=WITHOUT, experimental=STORED_SUMS)
    model = build(family, dtype).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def step(model, config):
        run = fuser.optimize(model, config)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = run(**batch())
        out.loss.backward()
        return out.loss.detach(), grads(model)

    since = len(fuser.backend(config).results)
    loss, got = step(copy.deepcopy(model), config)
    assert sum(r.counts.get("rms_norm_linear", 0) for r in fuser.backend(config).results[since:]) == 2 * N_LAYERS
    torch._dynamo.reset()
    loss_ref, ref = step(model, without)
    assert torch.equal(loss, loss_ref) and got.keys() == ref.keys() and len(got) == len(list(model.parameters()))
    for name, g in got.items():
        assert torch.equal(g, ref[name]), name


def test_full_fine_tuning_fp32_step_equals_eager():
    model = build("qwen3", torch.float32).train()
    assert_training_step_equals_eager(model, fuser.FuserConfig(strict=True, inner_compiler="aot_eager", patterns=ON))


def test_autocast_projections_take_their_inputs_cast_by_the_graph(monkeypatch):
    """fp32 weights under bf16 autocast: each ``linear_normed`` receives the normalised value and its weight already
    in bf16, cast by the graph (Inductor then casts the norm's output once for its projections, and each weight
    once for the forward and the backward's saved copy), so the op's body casts nothing; the step itself is the
    step without rms_norm_linear bit for bit (``test_full_fine_tuning_step_equals_the_step_without_it``)."""
    from fuser.dynamo_backend import FuserBackend
    from fuser.engine.canonical import tensor_meta

    graphs = []
    real = FuserBackend.compile_inner
    monkeypatch.setattr(FuserBackend, "compile_inner", lambda self, gm, ex: graphs.append(gm) or real(self, gm, ex))
    model = build("llama", torch.float32).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fuser.optimize(model, fuser.FuserConfig(strict=True, inner_compiler="aot_eager"))(**batch())
    out.loss.backward()
    ops = [n for gm in graphs for n in gm.graph.nodes if n.target is torch.ops.fuser.linear_normed.default]
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
        strict=True, inner_compiler="aot_eager", patterns=ON, experimental=STORED_SUMS, **LORA_ON
    )
    without = fuser.FuserConfig(strict=True, inner_compiler="aot_eager", patterns=WITHOUT, experimental=STORED_SUMS)
    model = lora(build(family))
    if checkpointing:  # the norms and their projections inside each layer's nested graph
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    since = len(fuser.backend(config).results)
    loss, got = lora_step(copy.deepcopy(model), config)
    assert sum(r.counts.get("rms_norm_linear", 0) for r in fuser.backend(config).results[since:]) == 2 * N_LAYERS
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
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager", patterns=ON, **LORA_ON)
    since = len(fuser.backend(config).results)
    assert_step_as_close_to_fp32_as_eager(torch.bfloat16, config)
    assert sum(r.counts.get("rms_norm_linear", 0) for r in fuser.backend(config).results[since:]) == 2 * N_LAYERS


@pytest.mark.parametrize("method", ["LoRA", "full"])
def test_the_normalised_values_are_no_longer_saved(method):
    """Inductor's partitioner on a 2-layer Llama (hidden 32): the two normalised values per layer, saved for
    the LoRA A weight gradients without the pattern, are not saved with it (``rms_norm_linear.lora``). One tensor
    per model comes back: the first norm's input, the embedding output, which the partitioner recomputed from the
    ids for the norm's backward and now saves, as the first rebuild reads it too (at Llama-3-8B widths: 2 tensors
    fewer per layer, ``benchmarks/saved_activations.py``). Under full fine-tuning the q/k/v and gate/up weight
    gradients saved them too, and the embedding output is saved either way: 2 fewer per layer."""
    model = small_llama(96)
    if method == "LoRA":
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    saved = saved_wide_tensors(model.train(), 32, fuser.FuserConfig(patterns=ON, **LORA_ON))
    saved_without = saved_wide_tensors(model, 32, fuser.FuserConfig(patterns=WITHOUT))
    assert len(saved_without) - len(saved) == (2 * 2 - 1 if method == "LoRA" else 2 * 2), (saved, saved_without)


@pytest.mark.parametrize("lora_on", [False, True], ids=["lora off", "lora on"])
def test_a_trained_base_beside_lora_adapters_is_rebuilt_only_with_the_lora_switch(lora_on):
    """One base weight trained beside peft's adapters (layer 0's q_proj): with ``rms_norm_linear.lora`` off the
    adapters save the norm's output anyway, so the norm stays rms_norm and the trained base keeps its plain linear
    (a rebuild there would only add work); with it on, that base is rebuilt too (one ``linear_normed``)."""
    model = lora(build("llama"))
    model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.requires_grad_(True)
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager", rms_norm_linear={"lora": lora_on})
    since = len(fuser.backend(config).results)
    fuser.optimize(model, config)(**batch()).loss.backward()
    results = fuser.backend(config).results[since:]
    assert sum(r.counts.get("rms_norm_linear", 0) for r in results) == (2 * N_LAYERS if lora_on else 0)
    assert sum(r.refined.get("rms_norm_linear", 0) for r in results) == (1 if lora_on else 0)


def test_lora_adapters_upcast_linear_declines_leave_the_norm_to_rms_norm():
    """With ``rms_norm_linear.lora``: peft's fp32 adapters on a bf16 model run under bf16 autocast, so their
    ``linear(y.float(), A)`` returns bf16, which upcast_linear declines (the op computes the fp32 linear). The norm's
    output is then saved for them as before: the norm must not count as rms_norm_linear, and says why."""
    model = lora(build("llama")).train()
    config = fuser.FuserConfig(**LORA_ON)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = fuser.explain(model, config=config, **batch())
    assert "rms_norm_linear" not in report.counts and report.counts["rms_norm"] == 2 * N_LAYERS + 1, report.counts
    reasons = {m.reason for m in report.near_misses if m.pattern == "rms_norm_linear"}
    assert any("which upcast_linear declines: the linear returns torch.bfloat16 (autocast?)" in r for r in reasons)
