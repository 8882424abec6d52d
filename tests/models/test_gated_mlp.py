"""Tier 3: gated MLPs (SwiGLU, GeGLU) in tiny Hugging Face models, and every option of the block.

- The gated activation (``swiglu``, ``geglu``): ``fuser.explain`` counts one per layer (peft's LoRA sums absorbed,
  none in an un-gated MLP), fp32 steps equal eager's; under QLoRA, where the down projection is bitsandbytes' custom
  autograd.Function, and the same rule on toy autograd.Functions.
- The down projection's weight gradient recomputes the product (``fuser::linear_gated``,
  ``gated_mlp.recompute_for_down_weight``), and the down adapter's LoRA A does too (``fuser::upcast_linear_gated``,
  ``upcast_linear.recompute_gated_input``): one per layer, the step bit for bit the step without it, one saved
  ``[tokens, intermediate]`` tensor per layer fewer.
- Post-grad passes through Inductor on CPU (caches off, so they run): the down projection's gradients and the gated
  backward as one op (``gated_down_grads``), the gated backward in place and the down adapter's dx accumulated
  (``gated_backward_in_place``, ``gated_dx_accumulated``), a LoRA model's gate/up sums in row slices
  (``gated_sums_in_slices``): each step bit for bit the step with the pass off.
"""

from __future__ import annotations

import copy
import dataclasses

import peft
import pytest
import torch
import torch.nn.functional as F

import fuser
import fuser.kernels.linear_gated  # noqa: F401  (registers the ops)
import fuser.kernels.lora_sum as lora_sum_kernels
from fuser.patterns.gated_mlp import GATED, SWIGLU
from tests.models import tiny
from tests.models.harness import assert_equals_eager, post_grad_step, refined, train_step
from tests.models.inductor_steps import MODELS, N_LAYERS, XDIST_GROUP, inductor_step, isolated_compile
from tests.models.tiny import ARCHS as TINY_ARCHS
from tests.models.tiny import (
    GATED_ARCHS,
    assert_same_step,
    assert_training_step_equals_eager,
    batch,
    checkpointed,
    from_config,
    grads,
    lora_step,
    rel,
    saved_wide_tensors,
    small_llama,
    with_lora,
)

# One decoder layer (N_LAYERS, the shared Inductor steps' count): every check here is of a gated MLP, which sits
# inside one layer (its count per layer, its recomputes and post-grad rewrites, the step against eager's or against
# the step with the option off), and the layers are identical, so a second layer only doubled each Dynamo trace and
# compile. The residual stream between layers is the norms' subject (test_rms_norm.py, with two layers).


def build(arch: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """``tiny.build`` with ``N_LAYERS`` layers."""
    return tiny.build(arch, dtype, layers=N_LAYERS)


def build_any(arch: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """``tiny.build_any`` with ``N_LAYERS`` layers."""
    return tiny.build_any(arch, dtype, layers=N_LAYERS)


def lora_model() -> torch.nn.Module:
    """``tiny.lora_model()`` (bf16, fp32 adapters) with ``N_LAYERS`` layers."""
    return tiny.lora_model(layers=N_LAYERS)


def expected_mlp_counts(arch: str) -> dict[str, int]:
    return tiny.expected_mlp_counts(arch, N_LAYERS)


# ---------------------------------------------------------------------------------------------------------
# The gated activation: counts, and fp32 training steps equal to eager's
# ---------------------------------------------------------------------------------------------------------


MLP_PATTERNS = ("swiglu", "geglu")
DENSE_LORA = ("llama", "qwen3", "mistral", "phi3", "gemma")
STRICT = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
INDUCTOR = fuser.FuserConfig(strict=True)  # the default inner compiler


def _mlp_counts(counts):
    return {k: v for k, v in counts.items() if k in MLP_PATTERNS}


# Qwen3-MoE with LoRA is test_fp32_training_step_equals_eager's qwen3_moe-lora step below (the same model), which
# asserts this count too, through the backend, besides the step against eager; capturing it again here only repeated
# its Dynamo traces through peft's graph breaks at the router (15 graphs, the file's longest trace). Mixtral with LoRA,
# the other MoE, keeps its explain case.
EXPLAIN_CASES = [(arch, lora) for lora in (False, True) for arch in GATED_ARCHS if not (lora and arch == "qwen3_moe")]


@pytest.mark.parametrize(
    "arch, lora", EXPLAIN_CASES, ids=[f"{'lora' if lora else 'plain'}-{arch}" for arch, lora in EXPLAIN_CASES]
)
def test_explain_counts_one_gated_activation_per_layer(arch, lora):
    model = build_any(arch)
    if lora:
        model = with_lora(model)
    report = fuser.explain(model, **batch())
    assert _mlp_counts(report.counts) == expected_mlp_counts(arch), str(report)
    if lora and arch in DENSE_LORA:
        # peft's base + lora_B(lora_A(x)) * s sums feeding the activation are absorbed into the op (MoE experts
        # are 3-D parameters: peft adapts those weights, so their activations see no LoRA sum to absorb)
        absorbed = [m for m in report.matches if m.pattern in MLP_PATTERNS]
        assert absorbed and all(any(k.endswith("_lora") for k in m.found.bindings) for m in absorbed), str(report)


# Llama's and Gemma's full fine-tuning fp32 steps are linear_gated's below (the same step), which asserts this
# test's counts and its comparison with eager too
FP32_STEPS = [(arch, lora) for arch in ("llama", "phi3", "qwen3_moe", "gemma") for lora in (False, True)
              if lora or arch in ("phi3", "qwen3_moe")]  # fmt: skip


@pytest.mark.parametrize("arch, lora", FP32_STEPS, ids=[f"{a}-{'lora' if lo else 'full'}" for a, lo in FP32_STEPS])
def test_fp32_training_step_equals_eager(arch, lora):
    model = build_any(arch)
    assert_training_step_equals_eager(with_lora(model) if lora else model, STRICT)
    assert _mlp_counts(fuser.backend(STRICT).counts) == expected_mlp_counts(arch)


# ---------------------------------------------------------------------------------------------------------
# SwiGLU under QLoRA, where the down projection is a custom autograd.Function (bitsandbytes' 4-bit MatMul4Bit,
# recorded by Dynamo as autograd_function_apply), and the same rule on toy autograd.Functions. The QLoRA tests need
# bitsandbytes (not a CI dependency: they skip there); the toy tests need nothing.
# ---------------------------------------------------------------------------------------------------------


AUTOGRAD_FUNCTION_APPLY = torch.ops.higher_order.autograd_function_apply


def _feeds_autograd_function(node: torch.fx.Node, depth: int = 0) -> bool:
    """Whether ``node`` reaches an ``autograd_function_apply`` call, directly or through a cast (proof that the
    test exercises that path, not a plain linear Dynamo inlined)."""
    return any(
        u.target is AUTOGRAD_FUNCTION_APPLY or (u.op == "call_method" and depth < 2 and _feeds_autograd_function(u, 1))
        for u in node.users
    )


# --- toy graphs: the product consumed by a custom autograd.Function -------------------------------------------

INTER, H = 24, 16


class LinearFunction(torch.autograd.Function):
    """A hand-written linear: ``x @ w.T`` (what bitsandbytes' MatMul4Bit is, with w dequantised)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w, grad.flatten(0, -2).t() @ x.flatten(0, -2)


class RowSumScale(torch.autograd.Function):
    """``x.sum(-1, keepdim=True) * w``: shaped like a projection to ``w``'s size, but no matrix product of x."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x.sum(-1, keepdim=True) * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return (grad * w).sum(-1, keepdim=True).expand_as(x), (grad * x.sum(-1, keepdim=True)).flatten(0, -2).sum(0)


class Scale(torch.autograd.Function):
    """Elementwise ``x * w``."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).flatten(0, -2).sum(0)


def _toy_mlp(down: type[torch.autograd.Function]):
    def mlp(x, wg, wu, wd):
        return down.apply(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)

    mlp.__name__ = f"mlp_into_{down.__name__}"
    return mlp


def _toy_inputs(down_shape: tuple[int, ...]):
    torch.manual_seed(0)
    x = torch.randn(2, 5, H)
    wg, wu = torch.randn(INTER, H) / 4, torch.randn(INTER, H) / 4
    wd = torch.randn(*down_shape) / 5
    # gradients required, or Dynamo inlines the Function's forward instead of recording autograd_function_apply
    return [t.requires_grad_(True) for t in (x, wg, wu, wd)]


def test_autograd_function_multiplying_the_product_by_a_matrix_is_a_projection():
    fn, inputs = _toy_mlp(LinearFunction), _toy_inputs((H, INTER))
    report = fuser.explain(fn, *inputs)
    assert report.counts == {"swiglu": 1}, str(report)
    assert _feeds_autograd_function(report.matches[0].found.root), str(report)
    ref_inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = torch.compile(fn, backend=fuser.backend(STRICT))(*inputs)
    assert fuser.backend(STRICT).counts == {"swiglu": 1}
    ref = fn(*ref_inputs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(ref)
    out.backward(dy)
    ref.backward(dy)
    for t, r in zip(inputs, ref_inputs, strict=True):
        torch.testing.assert_close(t.grad, r.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "down, down_shape, use",
    [(RowSumScale, (H,), "`return x.sum(-1, keepdim=True) * w`"), (Scale, (INTER,), "`return x * w`")],
    ids=["row_sum", "elementwise"],
)
def test_autograd_function_without_a_matrix_product_is_a_near_miss(down, down_shape, use):
    fn, inputs = _toy_mlp(down), _toy_inputs(down_shape)
    report = fuser.explain(fn, *inputs)
    assert report.counts == {}, str(report)
    reasons = [nm.reason for nm in report.near_misses if nm.pattern == "swiglu"]
    assert any(
        "custom autograd.Function" in r and "not as the input of a matrix product" in r and use in r for r in reasons
    ), str(report)
    out = torch.compile(fn, backend=fuser.backend(STRICT))(*inputs)
    torch.testing.assert_close(out, fn(*inputs), rtol=1e-5, atol=1e-5)


# --- QLoRA: bitsandbytes NF4 base linears + peft LoRA -----------------------------------------------------------


@pytest.fixture
def bnb():
    return pytest.importorskip("bitsandbytes")


def build_qlora_llama(bnb, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny Llama (``N_LAYERS`` layers, hidden 64) built as ``benchmarks/train_step.py`` builds its QLoRA job:
    every decoder ``nn.Linear`` replaced by an NF4 ``bnb.nn.Linear4bit`` computing in ``dtype`` (the model's), marked
    as a 4-bit load so that peft wraps them with its bitsandbytes LoRA layer, then LoRA on all linears (fp32
    adapters)."""
    import peft

    model = from_config("LlamaConfig", {"attn_implementation": "sdpa", "num_hidden_layers": N_LAYERS}).to(dtype)
    for layer in model.model.layers:
        for name, linear in list(layer.named_modules()):
            if type(linear) is not torch.nn.Linear:
                continue
            quantized = bnb.nn.Linear4bit(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                compute_dtype=dtype,
                quant_type="nf4",
                device="meta",
            )
            weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4", module=quantized)
            quantized.weight = weight.to("cpu")  # Params4bit quantises on its first move to a device
            parent, _, child = name.rpartition(".")
            setattr(layer.get_submodule(parent) if parent else layer, child, quantized)
    model.is_loaded_in_4bit = True
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    return peft.get_peft_model(model, config)


def test_qlora_llama_fuses_one_swiglu_per_layer(bnb):
    model = build_qlora_llama(bnb)
    assert isinstance(model.base_model.model.model.layers[0].mlp.down_proj.base_layer, bnb.nn.Linear4bit)
    report = fuser.explain(model, **batch())
    assert report.counts.get("swiglu") == N_LAYERS, str(report)
    swiglus = [m for m in report.matches if m.pattern == "swiglu"]
    # the down projection is bitsandbytes' MatMul4Bit, and peft's LoRA sums on gate and up are absorbed
    assert all(_feeds_autograd_function(m.found.root) for m in swiglus), str(report)
    assert all({"gate_lora", "up_lora"} <= set(m.found.bindings) for m in swiglus), str(report)


def test_qlora_llama_training_step_equals_eager(bnb):
    model = build_qlora_llama(bnb)
    # bitsandbytes computes in fp32 here (compute_dtype), from the same NF4 weights in both runs: the only
    # difference from eager is the fused activation, so fp32 tolerances hold
    out, _ = assert_training_step_equals_eager(model, STRICT)
    assert fuser.backend(STRICT).counts.get("swiglu") == N_LAYERS
    assert torch.isfinite(out.loss)


def test_qlora_llama_dynamic_shape_recompile_still_fuses(bnb):
    """Once the sequence length is dynamic, Dynamo keeps bitsandbytes' ``A.numel() == 0`` check in MatMul4Bit's
    forward graph: a read of the product's shape, which must not make it look like a non-projection."""
    model = build_qlora_llama(bnb)
    compiled = fuser.optimize(model, STRICT)
    for seq in (8, 12, 20):
        compiled(**batch(seq=seq)).loss.backward()
    results = fuser.backend(STRICT).results
    assert len(results) == 2  # the static compile and the dynamic-shape one
    assert [r.counts.get("swiglu") for r in results] == [N_LAYERS, N_LAYERS]


def test_qlora_bf16_lora_sums_take_the_bitsandbytes_order_bit_for_bit(bnb):
    """A bf16 QLoRA model: peft's bitsandbytes layers cast the scaled LoRA term to bf16 before adding it, and
    ``lora_sum`` (on by default) matches each as its "peft bitsandbytes" variant; alone, the step is eager's bit
    for bit."""
    model = build_qlora_llama(bnb, torch.bfloat16)
    report = fuser.explain(model, **batch())
    assert report.counts.get("lora_sum") == 7 * N_LAYERS and report.counts.get("swiglu") == N_LAYERS, str(report)
    assert {m.variant for m in report.matches if m.pattern == "lora_sum"} == {"peft bitsandbytes"}
    reference = copy.deepcopy(model)
    out_ref = reference(**batch())
    out_ref.loss.backward()
    alone = fuser.FuserConfig(patterns=("lora_sum",), strict=True, inner_compiler="aot_eager")
    out = fuser.optimize(model, alone)(**batch())
    out.loss.backward()
    assert fuser.backend(alone).counts == {"lora_sum": 7 * N_LAYERS}
    assert torch.equal(out.loss, out_ref.loss)
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert grads and all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters() if p.grad is not None)


# ---------------------------------------------------------------------------------------------------------
# Under full fine-tuning the down projection fed a gated MLP's fused product becomes fuser::linear_gated, whose
# backward recomputes the product for the weight gradient instead of saving it. On tiny models: one per layer (swiglu
# and geglu), none for a frozen base (LoRA), the training step bit for bit what it is without the refinement, and the
# partitioner saves one [tokens, intermediate] tensor per layer fewer.
# ---------------------------------------------------------------------------------------------------------


NO_DOWN_RECOMPUTE = {"gated_mlp": {"recompute_for_down_weight": False}}
STRICT_NO_DOWN_RECOMPUTE = fuser.FuserConfig.from_options(
    {"strict": True, "inner_compiler": "aot_eager", **NO_DOWN_RECOMPUTE}
)


@pytest.mark.parametrize(("arch", "pattern"), [("llama", "swiglu"), ("gemma", "geglu")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_gated_one_per_layer_and_the_step_is_unchanged_bit_for_bit(arch, pattern, dtype):
    since = len(fuser.backend(STRICT).results)
    loss, g = train_step(build_any(arch, dtype), STRICT)
    assert refined(STRICT, since)[pattern] == N_LAYERS  # (rms_norm_linear refines the q/k/v and gate/up projections)
    if dtype == torch.float32:  # the gated activation's fp32 step (test_fp32_training_step_equals_eager's): eager's
        assert _mlp_counts(fuser.backend(STRICT).counts) == expected_mlp_counts(arch)
        assert_equals_eager((loss, g), train_step(build_any(arch)), loss_tol=1e-5, grad_tol=1e-4)
    torch._dynamo.reset()
    loss_off, g_off = train_step(build_any(arch, dtype), STRICT_NO_DOWN_RECOMPUTE)
    assert fuser.backend(STRICT_NO_DOWN_RECOMPUTE).results and pattern not in refined(STRICT_NO_DOWN_RECOMPUTE)
    assert torch.equal(loss, loss_off) and g.keys() == g_off.keys()
    for name in g:
        assert torch.equal(g[name], g_off[name]), name


def test_not_for_a_frozen_down_projection():
    # LoRA's base weight needs no gradient: nothing saves the product for it
    since = len(fuser.backend(STRICT).results)
    lora_step(lora_model(), STRICT)
    assert "swiglu" not in refined(STRICT, since)


def test_op_gradients_are_linears_with_bias():
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(2, 5, 24, generator=gen, dtype=torch.float64) for _ in range(2))
    w = torch.randn(16, 24, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(16, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64)
    x = torch.ops.fuser.gated_activation(gate, up, None, None, 1.0, 1.0, "silu")[0].requires_grad_()
    F.linear(x, w, b).backward(dy)
    expected = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    out = torch.ops.fuser.linear_gated(x, gate, up, w, b, 1.0, 1.0, "silu")
    assert torch.equal(out, F.linear(x, w, b))
    out.backward(dy)
    for name, t, e in zip(("x", "weight", "bias"), (x, w, b), expected, strict=True):
        torch.testing.assert_close(t.grad, e, rtol=1e-12, atol=1e-12, msg=f"d{name}")


def test_linear_gated_opcheck():
    gen = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(3, 24, generator=gen) for _ in range(2))
    x = torch.ops.fuser.gated_activation(gate, up, None, None, 1.0, 1.0, "gelu_tanh")[0]
    w, b = torch.randn(8, 24, generator=gen), torch.randn(8, generator=gen)
    torch.library.opcheck(torch.ops.fuser.linear_gated.default, (x, gate, up, w, b, 1.0, 1.0, "gelu_tanh"))
    dy = torch.randn(3, 8, generator=gen)
    args = (dy, gate, up, w, 1.0, 1.0, "gelu_tanh", True, True, True)
    torch.library.opcheck(torch.ops.fuser.linear_gated_grads.default, args)


@pytest.mark.parametrize("recompute", [True, False], ids=["refined", "not refined"])
def test_linear_gated_the_product_is_no_longer_saved(recompute):
    config = fuser.FuserConfig(gated_mlp={"recompute_for_down_weight": recompute})
    wide = saved_wide_tensors(small_llama(96, layers=N_LAYERS).train(), 96, config)
    # gate and up (for the gated op's backward), and without the refinement the product too, per layer
    assert len(wide) == (2 if recompute else 3) * N_LAYERS, wide


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("need_b", [True, False])
def test_gated_down_grads_is_the_two_ops_it_replaces(activation, need_b):
    """``fuser::gated_down_grads`` (and its in-place form) gives what ``linear_gated_grads`` and the gated backward
    of its dx give, bit for bit: the product comes from the backward's own formula, not a recompute."""
    gen = torch.Generator().manual_seed(2)
    gate, up = (torch.randn(2, 5, 24, generator=gen) for _ in range(2))
    w, dy = torch.randn(16, 24, generator=gen), torch.randn(2, 5, 16, generator=gen)
    scales = (1.0, 1.0, activation)
    dx, dw, db = torch.ops.fuser.linear_gated_grads(dy, gate, up, w, *scales, True, True, need_b)
    dgate, dup, *_ = torch.ops.fuser.gated_activation_backward(
        dx, gate, up, 1.0, 1.0, True, True, False, False, activation
    )
    fused = torch.ops.fuser.gated_down_grads(dy, gate, up, w, *scales, need_b)
    for name, a, b in zip(("dgate", "dup", "dW", "db"), fused, (dgate, dup, dw, db), strict=True):
        assert torch.equal(a, b), name
    g, u = gate.clone(), up.clone()
    dw_, db_ = torch.ops.fuser.gated_down_grads_(dy, g, u, w, *scales, need_b)
    for name, a, b in (("dgate", g, dgate), ("dup", u, dup), ("dW", dw_, dw), ("db", db_, db)):
        assert torch.equal(a, b), name
    torch.library.opcheck(torch.ops.fuser.gated_down_grads.default, (dy, gate, up, w, *scales, need_b))
    torch.library.opcheck(torch.ops.fuser.gated_down_grads_.default, (dy, gate.clone(), up.clone(), w, *scales, need_b))


# ---------------------------------------------------------------------------------------------------------
# The LoRA A of a gated MLP's down projection reads the fused gated product; after the rewrite it becomes
# fuser::upcast_linear_gated, whose backward recomputes that product from gate and up instead of saving it. On tiny
# LoRA Llamas: one per layer, the training step bit for bit what it is without the refinement, and the partitioner
# saves one [tokens, intermediate] tensor per layer fewer.
# ---------------------------------------------------------------------------------------------------------


NO_GATED_INPUT_RECOMPUTE = {"upcast_linear": {"recompute_gated_input": False}}
STRICT_NO_GATED_INPUT_RECOMPUTE = fuser.FuserConfig.from_options(
    {"strict": True, "inner_compiler": "aot_eager", **NO_GATED_INPUT_RECOMPUTE}
)


def checkpointed_lora_model():
    return checkpointed(lora_model())


@pytest.mark.parametrize("build", [lora_model, checkpointed_lora_model], ids=["plain", "gradient checkpointing"])
def test_upcast_linear_gated_one_per_layer_and_the_step_is_unchanged_bit_for_bit(build):
    """One per layer (under checkpointing: inside the layers' nested graphs), and the training step is what it is
    without the refinement: bit for bit, except the down adapter's LoRA A gradient. The forward's product comes
    from the unrounded gate/up LoRA sums (lora_sum_wide, issue 16), the recompute from the rounded ones it saves:
    that gradient then differs by the rounding of gate and up: within about two bf16 ulps (silu amplifies a
    negative gate's rounding)."""
    since = len(fuser.backend(STRICT).results)
    loss, grads = lora_step(build(), STRICT)
    # lora_sum's refinements (issue 16), per layer: the gate and up sums keep their fp32 value for the gated op, the
    # o and down sums stay fp32 into their residual adds, the q and k sums into RoPE, and the v sum, stored
    # rounded for attention, adds to the base's fp32 output (experimental.lora_sum.fp32_base); besides the recompute,
    # the LoRA A of q/k/v and of gate/up share one op each (experimental.upcast_linear.group_shared_inputs): 5 per layer
    assert refined(STRICT, since) == {"upcast_linear": N_LAYERS + 5 * N_LAYERS, "lora_sum": 7 * N_LAYERS}
    torch._dynamo.reset()
    loss_off, grads_off = lora_step(build(), STRICT_NO_GATED_INPUT_RECOMPUTE)
    assert refined(STRICT_NO_GATED_INPUT_RECOMPUTE) == {"upcast_linear": 5 * N_LAYERS, "lora_sum": 7 * N_LAYERS}
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
def test_upcast_linear_gated_the_product_is_no_longer_saved(recompute):
    config = fuser.FuserConfig(upcast_linear={"recompute_gated_input": recompute})
    lora = peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    wide = saved_wide_tensors(peft.get_peft_model(small_llama(96, layers=N_LAYERS), lora).train(), 96, config)
    # gate and up (for the gated op's backward), and without the refinement the product too, per layer
    assert len(wide) == (2 if recompute else 3) * N_LAYERS, wide


# ---------------------------------------------------------------------------------------------------------
# Under full fine-tuning the down projection's gradients and the gated backward are one op (fuser::gated_down_grads,
# fuser.inductor.gated_down_grads), whose backward kernel writes the product the weight gradient needs instead of a
# separate recompute. Through Inductor on CPU (its caches off, so the post-grad passes run): one per layer, out of
# place where gate and up are saved activations, in place (gated_down_grads_) in a checkpointed layer; the training
# step is what it is with the pass switched off, bit for bit.
# ---------------------------------------------------------------------------------------------------------


DOWN_GRADS_OFF = fuser.FuserConfig.from_options(
    {"strict": True, "experimental.gated_mlp.backward_writes_product": False}
)
GATED_PAIRS = [("llama", "swiglu"), ("gemma", "geglu")]


@XDIST_GROUP
@pytest.mark.usefixtures("inductor_caches_off")
@pytest.mark.parametrize(("arch", "pattern"), GATED_PAIRS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gated_down_grads_one_per_layer_and_the_step_is_unchanged_bit_for_bit(arch, pattern, dtype):
    shared = inductor_step(arch if dtype == torch.float32 else f"{arch} bf16", INDUCTOR)  # build(arch, dtype).train()
    on, counts = shared.loss_and_grads(), shared.post_grad_counts
    assert counts.get("gated_down_grads") == N_LAYERS
    off, counts_off = post_grad_step(build(arch, dtype).train(), DOWN_GRADS_OFF)
    assert "gated_down_grads" not in counts_off
    assert_same_step(on, off)


@XDIST_GROUP
@pytest.mark.usefixtures("inductor_caches_off")
def test_checkpointed_layers_take_the_in_place_form():
    # gate and up are recomputed in the backward graph and nothing reads them after: the gated backward is in place,
    # and the fused op writes dgate and dup over them
    shared = inductor_step("checkpointed llama", INDUCTOR)  # checkpointed(build("llama"))
    on, counts = shared.loss_and_grads(), shared.post_grad_counts
    assert counts.get("gated_down_grads") == N_LAYERS
    assert counts.get("gated_backward_in_place") == N_LAYERS
    off, counts_off = post_grad_step(checkpointed(build("llama")), DOWN_GRADS_OFF)
    assert "gated_down_grads" not in counts_off and counts_off.get("gated_backward_in_place") == N_LAYERS
    assert_same_step(on, off)


@pytest.mark.usefixtures("inductor_caches_off")
def test_not_without_the_down_projections_recompute():
    # the product saved (recompute_for_down_weight off): no linear_gated, nothing to join
    config = fuser.FuserConfig.from_options({"strict": True, "gated_mlp": {"recompute_for_down_weight": False}})
    _, counts = post_grad_step(build("llama").train(), config)
    assert counts.get("gated_down_grads", 0) == 0


@pytest.mark.gpu
@pytest.mark.usefixtures("inductor_caches_off")
@pytest.mark.parametrize(("arch", "pattern"), GATED_PAIRS)
def test_gpu_gated_down_grads_step_unchanged_at_width(arch, pattern):
    """bf16 on the GPU at a real width (the Triton kernels): the step with the product from the backward kernel
    equals the one with the forward kernel's recompute."""
    extra = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 8, "head_dim": 128,
             "num_hidden_layers": N_LAYERS}  # fmt: skip

    def make():
        model = from_config(TINY_ARCHS[arch][0], {"attn_implementation": "sdpa", **extra})
        return model.to(torch.bfloat16).cuda().train()

    on, counts = post_grad_step(make(), INDUCTOR, device="cuda")
    assert counts.get("gated_down_grads") == N_LAYERS
    off, _ = post_grad_step(make(), DOWN_GRADS_OFF, device="cuda")
    assert_same_step(on, off)


# ---------------------------------------------------------------------------------------------------------
# In a checkpointed layer the gated MLP's backward writes dgate and dup over the recomputed gate and up, and the down
# adapter's dx is added into the base projection's gradient (fuser.inductor.gated_mlp_inplace). Through Inductor on
# CPU (its caches off, so the post-grad pass runs): one of each per layer under gradient checkpointing; without it the
# gated backward stays out of place (gate and up are then saved activations) while the dx is still accumulated; the
# training step is what it is with the passes switched off, bit for bit, and eager's within fp32 rounding.
# ---------------------------------------------------------------------------------------------------------


# the module-scoped steps with the passes off (step_off, checkpointed_step_off) are read by tests of one pytest-xdist
# group (XDIST_GROUP), which also read the steps of inductor_steps.py: one worker computes each once

INDUCTOR_LENIENT = fuser.FuserConfig()
# the same with the passes switched off, by name as a trainer's options= would
NOT_IN_PLACE = {"experimental.gated_mlp.backward_in_place": False}
IN_PLACE_OFF = fuser.FuserConfig.from_options({"strict": True, **NOT_IN_PLACE})
# the gated MLP's own passes; lora_sum's gated_sums_in_slices (its own tests: the last section) runs
# beside them in every config here
GATED_PASSES = ("gated_backward_in_place", "gated_dx_accumulated")


def gated_counts(backend) -> dict[str, int]:
    """What the gated MLP's post-grad passes rewrote in ``backend``'s graphs."""
    return only_gated(backend.post_grad_counts)


def only_gated(post_grad_counts: dict[str, int]) -> dict[str, int]:
    """The gated MLP's passes' of what fuser's post-grad passes rewrote (``FuserBackend.post_grad_counts``)."""
    return {k: v for k, v in post_grad_counts.items() if k in GATED_PASSES}


def step_without_the_pass(make):
    """(loss, grads) with the passes switched off; asserts that they rewrote nothing."""
    off = lora_step(make(), IN_PLACE_OFF)
    assert gated_counts(fuser.backend(IN_PLACE_OFF)) == {}
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


@XDIST_GROUP
@pytest.mark.usefixtures("inductor_caches_off")
def test_checkpointed_lora_llama_one_per_layer_step_unchanged(checkpointed_step_off):
    on, counts = step_with_the_pass("checkpointed lora")  # checkpointed(lora_model())
    assert counts == {"gated_backward_in_place": N_LAYERS, "gated_dx_accumulated": N_LAYERS}
    assert_same_step(on, checkpointed_step_off)


@XDIST_GROUP
@pytest.mark.usefixtures("inductor_caches_off")
def test_not_in_place_without_checkpointing(step_off):
    # gate and up are saved for the backward: graph inputs of the backward graph, which autograd owns
    on, counts = step_with_the_pass("lora")  # lora_model()
    assert counts["gated_backward_in_place"] == 0 and counts["gated_dx_accumulated"] == N_LAYERS
    assert_same_step(on, step_off)


@XDIST_GROUP
@pytest.mark.usefixtures("inductor_caches_off")
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
@pytest.mark.usefixtures("inductor_caches_off")
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
    off = step(IN_PLACE_OFF)
    assert gated_counts(fuser.backend(IN_PLACE_OFF)) == {}
    assert_same_step(on, off)


def _failing_plan(graph):
    raise RuntimeError("an analysis that fails")


def _fail_every_plan(monkeypatch):
    """The gated MLP's post-grad passes (every gated pattern's, the same) with an analysis that raises."""
    failing = tuple(dataclasses.replace(one, plan=_failing_plan) for one in SWIGLU.post_grad)
    for pattern in GATED.values():
        monkeypatch.setattr(pattern, "post_grad", failing)


@XDIST_GROUP
@pytest.mark.usefixtures("inductor_caches_off")
def test_a_failing_gated_pass_leaves_the_graph_and_warns(monkeypatch, checkpointed_step_off):
    # the backward graph compiles at the first backward call, outside the rewrite's own fallback: the pass itself
    # must not take the step down: the step is the one with the passes switched off (strict or not: nothing fails
    # there to raise or warn about)
    _fail_every_plan(monkeypatch)
    with pytest.warns(RuntimeWarning, match="post-grad pass gated_dx_accumulated failed"):
        loss, g = lora_step(checkpointed(lora_model()), INDUCTOR_LENIENT)
    assert gated_counts(fuser.backend(INDUCTOR_LENIENT)) == {}
    assert_same_step((loss, g), checkpointed_step_off)


@pytest.mark.usefixtures("inductor_caches_off")
def test_a_failing_gated_pass_raises_under_strict(monkeypatch):
    _fail_every_plan(monkeypatch)
    with pytest.raises(Exception, match="post-grad pass gated_dx_accumulated failed"):
        lora_step(checkpointed(lora_model()), INDUCTOR)


# ---------------------------------------------------------------------------------------------------------
# A LoRA model's gated MLP computes its fp32 gate/up sums and their product in row slices
# (experimental.lora_sum.gated_in_slices, the post-grad pass gated_sums_in_slices): one
# fuser::gated_activation_of_lora_sums per layer in the forward graph, and one more per layer in the backward graph's
# recomputation under gradient checkpointing. Through Inductor on CPU (its graph caches off, so the post-grad passes
# run), with slices of a few rows: the training step is the one with the pass switched off, bit for bit.
# ---------------------------------------------------------------------------------------------------------


SLICES_ON = fuser.FuserConfig.from_options({"strict": True, "experimental.lora_sum.gated_in_slices": True})
SLICES_PASS = "gated_sums_in_slices"


@pytest.fixture
def small_slices(monkeypatch, inductor_caches_off):
    """Slices of 5 rows: the tiny batch's 32 rows in 7 slices, the last one short (and Inductor's caches off: a
    cached graph skips the post-grad passes)."""
    monkeypatch.setattr(lora_sum_kernels, "WIDE_SLICE_BYTES", 5 * 4 * 96)


def step_on_and_off(model, monkeypatch):
    """(step with the pass, step without it, the pass's count, rows of each gated forward kernel call with it) of
    ``inductor_steps.MODELS[model]``; the step without the pass (INDUCTOR, the default) is read from there."""
    import fuser.kernels.gated_activation as gated

    shared = inductor_step(model, INDUCTOR)
    off = shared.loss_and_grads()
    assert SLICES_PASS not in shared.post_grad_counts
    rows, real = [], gated.gated_activation_forward
    monkeypatch.setattr(
        gated, "gated_activation_forward", lambda g, *a, **k: rows.append(g.shape[0]) or real(g, *a, **k)
    )
    on = lora_step(MODELS[model](), SLICES_ON)
    counts = dict(fuser.backend(SLICES_ON).post_grad_counts)
    return on, off, counts, rows


@XDIST_GROUP
@pytest.mark.usefixtures("small_slices")
@pytest.mark.parametrize("with_checkpointing", [False, True], ids=["saved", "checkpointed"])
def test_lora_llama_gated_sums_in_slices_step_unchanged(with_checkpointing, monkeypatch):
    # checkpointed(lora_model()), or lora_model()
    on, off, counts, rows = step_on_and_off("checkpointed lora" if with_checkpointing else "lora", monkeypatch)
    # the forward graph's, and under checkpointing the backward's recomputation of each layer
    assert counts[SLICES_PASS] == N_LAYERS * (2 if with_checkpointing else 1), counts
    # 32 rows (2 × 16 tokens) in slices of 5: six whole slices and one of 2, per call
    assert rows == ([5] * 6 + [2]) * counts[SLICES_PASS], rows
    assert_same_step(on, off)


@pytest.mark.gpu
@pytest.mark.usefixtures("small_slices")
def test_gpu_checkpointed_lora_llama_gated_sums_in_slices_step_unchanged(monkeypatch):
    """On CUDA the fused op runs the Triton kernels (the LoRA sums' and the gated forward's) on each slice: the
    checkpointed bf16 step equals the one without the pass, bit for bit."""

    def step(config):
        model = checkpointed(lora_model().cuda())
        data = {k: v.cuda() for k, v in batch().items()}
        out = fuser.optimize(model, config)(**data)
        out.loss.backward()
        return out.loss.detach(), grads(model)

    on = step(SLICES_ON)
    assert fuser.backend(SLICES_ON).post_grad_counts[SLICES_PASS] == 2 * N_LAYERS
    torch._dynamo.reset()
    assert_same_step(on, step(INDUCTOR))
