"""One configuration surface: every behaviour switch is a FuserConfig field, reachable by name through
``torch.compile(..., backend="fuser", options={...})`` (nested dicts, one per pattern with options, or dotted names;
the switches kept to compare implementations under ``experimental``), validated when built, part of Inductor's cache
key by construction; no environment variable or module flag switches anything.

Each former switch is set here by name through ``options=`` and shown to change what fuser does: the arguments of
the fused op in the rewritten graph, what the rewrite refines, what is matched, or what the post-grad pass does.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import fuser
import fuser.dynamo_backend
import fuser.kernels.upcast_linear as U
from fuser.config import ExperimentalConfig
from fuser.dynamo_backend import FuserBackend
from fuser.kernels._triton import HAS_TRITON, interpreting, use_triton
from fuser.patterns.causal_attention import CausalAttentionConfig, CausalAttentionExperimental
from fuser.patterns.gated_mlp import GatedMLPConfig, GatedMLPExperimental
from fuser.patterns.linear_cross_entropy import LinearCrossEntropyExperimental
from fuser.patterns.lora_sum import LoraSumExperimental
from fuser.patterns.rms_norm import RmsNormExperimental, RmsNormLinearConfig
from fuser.patterns.upcast_linear import UpcastLinearConfig, UpcastLinearExperimental

OPS = torch.ops.fuser
BASE = {"strict": True, "inner_compiler": "aot_eager"}


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


@pytest.fixture
def rewritten(monkeypatch):
    """The graphs fuser's backends hand to their inner compiler (the rewritten ones), in order."""
    graphs = []
    real = FuserBackend.compile_inner

    def recording(self, gm, example_inputs):
        graphs.append(gm)
        return real(self, gm, example_inputs)

    monkeypatch.setattr(FuserBackend, "compile_inner", recording)
    return graphs


def compile_by_name(fn, options, *args):
    """``fn(*args)`` compiled as a trainer compiles it (``backend="fuser"``, ``options``), a backward of its
    output's sum when it needs one; returns the backend that compiled it."""
    out = torch.compile(fn, backend="fuser", options={**BASE, **options})(*args)
    out = out[0] if isinstance(out, tuple) else out
    if out.requires_grad:
        out.float().sum().backward()
    return fuser.backend(fuser.FuserConfig.from_options({**BASE, **options}))


def calls(graphs, op):
    return [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function" and n.target is op]


def refined(backend) -> dict[str, int]:
    total: dict[str, int] = {}
    for result in backend.results:
        for name, n in result.refined.items():
            total[name] = total.get(name, 0) + n
    return total


# --- experimental.linear_cross_entropy: dw_kernel, dw_accumulator, streams -----------------------------------


def lm_loss(h, w, y):
    return F.cross_entropy(F.linear(h, w).float().view(-1, w.shape[0]), y.view(-1))


def lm_inputs(gen):
    h = torch.randn(2, 5, 16, generator=gen).requires_grad_()
    w = (torch.randn(37, 16, generator=gen) / 3).requires_grad_()
    return h, w, torch.randint(0, 37, (2, 5), generator=gen)


@pytest.mark.parametrize(
    "options, expected",
    [
        ({}, ("cublas", "input", True)),
        ({"experimental": {"linear_cross_entropy": {"dw_kernel": "triton"}}}, ("triton", "input", True)),
        ({"experimental.linear_cross_entropy.dw_accumulator": "fp32"}, ("cublas", "fp32", True)),
        ({"experimental.linear_cross_entropy": {"streams": False}}, ("cublas", "input", False)),
    ],
    ids=["defaults", "dw_kernel", "dw_accumulator", "streams"],
)
def test_linear_cross_entropy_options_become_the_ops_arguments(options, expected, gen, rewritten, monkeypatch):
    import fuser.kernels.linear_cross_entropy as lce_module

    ran = []
    real = lce_module._forward_chunked

    def spy(hidden, weight, bias, labels, ce, wanted, dw_options, triton_path):
        ran.append((dw_options.kernel, dw_options.accumulator, dw_options.streams))
        return real(hidden, weight, bias, labels, ce, wanted, dw_options, triton_path)

    monkeypatch.setattr(lce_module, "_forward_chunked", spy)
    backend = compile_by_name(lm_loss, options, *lm_inputs(gen))
    assert backend.counts == {"linear_cross_entropy": 1}
    (node,) = calls(rewritten, OPS.linear_cross_entropy.default)
    names = ("dw_kernel", "dw_accumulator", "streams")
    assert len(node.args) == 11 and node.kwargs == dict(zip(names, expected, strict=True))
    assert ran == [expected]  # and the op ran with them


# --- experimental.causal_attention: gqa_fold, runtime_check ---------------------------------------------------


def causal_mask(q):  # transformers 5.17 under torch.compile
    t = q.shape[-2]
    kv_idx = torch.arange(t, device=q.device)[None, None, None, :]
    q_idx = torch.arange(t, device=q.device)[None, None, :, None]
    return (kv_idx <= q_idx).expand(q.shape[0], -1, t, t)


def repeat_kv(x, n):  # transformers' own
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def gqa_attention(q, k, v):
    n = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n), repeat_kv(v, n), attn_mask=causal_mask(q))


def padded_attention(q, k, v, keep):  # a padding mask from the batch: unknown at compile time
    i = torch.arange(q.shape[-2])
    mask = (i[None, :] <= i[:, None])[None, None] & keep[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def qkv(gen, kv_heads=2):
    q = torch.randn(2, 4, 8, 8, generator=gen).requires_grad_()
    k, v = (torch.randn(2, kv_heads, 8, 8, generator=gen).requires_grad_() for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("fold", [False, True])
def test_gqa_fold_by_name(fold, gen, rewritten):
    from fuser.patterns.causal_attention import causal_sdpa

    backend = compile_by_name(gqa_attention, {"experimental.causal_attention.gqa_fold": fold}, *qkv(gen))
    assert backend.counts == {"causal_attention": 1}
    (node,) = calls(rewritten, causal_sdpa)
    q, k, v, _, _, enable_gqa = node.args
    assert enable_gqa is fold
    assert k.meta["example_value"].shape[1] == (2 if fold else 4)  # the model's kv heads, or repeat_kv's copies


@pytest.mark.parametrize("check", [False, True])
def test_runtime_check_by_name(check, gen, rewritten):
    from fuser.patterns.causal_attention import causal_or_masked_sdpa

    keep = torch.ones(2, 8, dtype=torch.bool)
    options = {"experimental.causal_attention.runtime_check": check, "causal_attention.block_sparse_masks": False}
    backend = compile_by_name(padded_attention, options, *qkv(gen, 4), keep)
    assert backend.counts == ({"causal_attention": 1} if check else {})
    assert len(calls(rewritten, causal_or_masked_sdpa)) == int(check)
    if not check:
        reasons = [nm.reason for r in backend.results for nm in r.near_misses]
        assert any("graph input" in r for r in reasons), reasons


# --- gated_mlp.recompute_for_down_weight, experimental.gated_mlp.backward_in_place ----------------------------


def mlp(x, wg, wu, wd):  # Llama's MLP, all three weights trainable (full fine-tuning)
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def mlp_inputs(gen):
    x = torch.randn(2, 5, 16, generator=gen).requires_grad_()
    return x, *((torch.randn(*shape, generator=gen) / 4).requires_grad_() for shape in ((24, 16), (24, 16), (16, 24)))


@pytest.mark.parametrize("recompute", [False, True])
def test_recompute_for_down_weight_by_name(recompute, gen, rewritten):
    backend = compile_by_name(mlp, {"gated_mlp": {"recompute_for_down_weight": recompute}}, *mlp_inputs(gen))
    assert backend.counts == {"swiglu": 1}
    assert refined(backend) == ({"swiglu": 1} if recompute else {})
    import fuser.kernels.linear_gated  # noqa: F401  (registers the op)

    assert len(calls(rewritten, OPS.linear_gated.default)) == int(recompute)


def backward_of_a_checkpointed_layer(dout, a, b):
    # gate and up recomputed in the backward graph, last read by the gated backward: what the pass rewrites
    g, u = a * 2.0, b + 1.0
    dgate, dup, _, _ = OPS.gated_activation_backward(dout, g, u, 1.0, 1.0, True, True, False, False, "silu")
    return dgate * 3.0, dup - 1.0


@pytest.mark.parametrize("in_place", [False, True])
def test_backward_in_place_by_name(in_place, gen):
    """The post-grad pass of the backend ``options=`` names, on a backward graph as Inductor hands it over."""
    backend = compile_by_name(mlp, {"experimental.gated_mlp.backward_in_place": in_place}, *mlp_inputs(gen))
    args = [torch.randn(6, 10, generator=gen) for _ in range(3)]
    gm = make_fx(backward_of_a_checkpointed_layer, tracing_mode="fake")(*args)
    counts: dict[str, int] = {}
    fuser.dynamo_backend._post_grad_pass(backend.config, counts)(gm.graph)
    gm.recompile()
    gated = {k: v for k, v in counts.items() if k in ("gated_dx_accumulated", "gated_backward_in_place")}
    assert gated == ({"gated_dx_accumulated": 0, "gated_backward_in_place": 1} if in_place else {})
    assert len(calls([gm], OPS.gated_activation_backward_.default)) == int(in_place)
    for got, want in zip(gm(*args), backward_of_a_checkpointed_layer(*args), strict=True):
        assert torch.equal(got, want)


# --- upcast_linear.recompute_gated_input, experimental.upcast_linear: triton (lora_sum's too), grouping -------


def lora_mlp(x, wg, ag, bg, wu, au, bu, wd, ad, bd):  # peft's LoRA on a bf16/fp16 Llama MLP, fp32 adapters
    def lora(base_w, a, b, inp):
        return (F.linear(inp, base_w) + F.linear(F.linear(inp.to(torch.float32), a), b) * 2.0).to(inp.dtype)

    product = F.silu(lora(wg, ag, bg, x)) * lora(wu, au, bu, x)
    return lora(wd, ad, bd, product)


def lora_inputs(gen, dtype=torch.float16):
    x = torch.randn(2, 5, 16, generator=gen).to(dtype)
    out = []
    for n_out, n_in in ((24, 16), (24, 16), (16, 24)):
        out += [
            (torch.randn(n_out, n_in, generator=gen) / 4).to(dtype),
            (torch.randn(4, n_in, generator=gen) / 4).requires_grad_(),
            (torch.randn(n_out, 4, generator=gen) / 4).requires_grad_(),
        ]
    return x, *out


@pytest.mark.parametrize("triton", [False, True])
def test_upcast_linear_triton_by_name_reaches_every_op_of_its_kernels(triton, gen, rewritten):
    backend = compile_by_name(lora_mlp, {"experimental.upcast_linear.triton": triton}, *lora_inputs(gen))
    assert backend.counts == {"lora_sum": 3, "swiglu": 1, "upcast_linear": 3}
    upcasts = calls(rewritten, OPS.upcast_linear.default) + calls(rewritten, OPS.upcast_linear_gated.default)
    # gate's and up's adapters read one x: one op on their concatenated weights (group_shared_inputs)
    assert len(upcasts) == 2 and all(n.kwargs == {"allow_triton": triton} for n in upcasts)
    # the gate and up sums became lora_sum_wide (they feed the gated op), the down sum a lora_sum into the output
    sums = calls(rewritten, OPS.lora_sum.default) + calls(rewritten, OPS.lora_sum_wide.default)
    assert len(sums) == 3 and all(n.kwargs["allow_triton"] is triton for n in sums)


@pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="needs the Triton interpreter")
@pytest.mark.parametrize("triton", [False, True])
def test_upcast_linear_triton_by_name_decides_the_kernels(triton, gen, triton_on_cpu, monkeypatch):
    """Through the interpreter: with ``triton`` the upcast linears' and LoRA sums' Triton kernels run, forward and
    backward; without it none does (the reference path)."""
    triton_on_cpu()
    launched = []
    for name in ("_forward_triton", "_dx_triton", "_dw_triton"):
        real = getattr(U, name)
        monkeypatch.setattr(U, name, lambda *a, _real=real, _name=name, **kw: launched.append(_name) or _real(*a, **kw))
    compile_by_name(lora_mlp, {"experimental.upcast_linear.triton": triton}, *lora_inputs(gen))
    assert (len(launched) > 0) is triton, launched
    if triton:
        assert {"_forward_triton", "_dx_triton", "_dw_triton"} <= set(launched)


@pytest.mark.parametrize("group", [False, True])
def test_group_shared_inputs_by_name(group, gen, rewritten):
    backend = compile_by_name(lora_mlp, {"experimental.upcast_linear.group_shared_inputs": group}, *lora_inputs(gen))
    # gate's and up's adapters grouped (2 refined) besides the down adapter's recompute (1)
    assert refined(backend).get("upcast_linear", 0) == 1 + 2 * group
    assert len(calls(rewritten, OPS.upcast_linear.default)) == 2 - group
    assert len(calls(rewritten, torch.cat)) == int(group)


@pytest.mark.parametrize("recompute", [False, True])
def test_recompute_gated_input_by_name(recompute, gen, rewritten):
    backend = compile_by_name(lora_mlp, {"upcast_linear": {"recompute_gated_input": recompute}}, *lora_inputs(gen))
    # besides the gate/up adapters' grouping (2 refined)
    assert refined(backend).get("upcast_linear", 0) == int(recompute) + 2
    assert len(calls(rewritten, OPS.upcast_linear_gated.default)) == int(recompute)


# --- experimental.lora_sum: fp32_base, gated_in_slices, fp32_autocast_adapters ---------------------------------


@pytest.mark.parametrize("fp32_base", [False, True])
def test_lora_sum_fp32_base_by_name(fp32_base, gen, rewritten):
    """The down sum is the function's output, rounded: with ``fp32_base`` its base linear returns fp32 and the
    sum rounds once; the gate and up sums feed the gated op unrounded either way."""
    compile_by_name(lora_mlp, {"experimental.lora_sum.fp32_base": fp32_base}, *lora_inputs(gen))
    wide = calls(rewritten, OPS.linear_wide.default)
    assert len(wide) == int(fp32_base)
    rounded = [n for n in calls(rewritten, OPS.lora_sum.default) if n.args[0] in wide]
    assert len(rounded) == int(fp32_base) and all(n.args[5] == torch.float16 for n in rounded)


def autocast_lora_mlp(*args):  # the same under CPU bf16 autocast (Trainer(bf16=True) over a bf16 base)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return lora_mlp(*args)


@pytest.mark.parametrize("fp32_adapters", [False, True])
def test_lora_sum_fp32_autocast_adapters_by_name(fp32_adapters, gen, rewritten):
    """Under autocast every LoRA sum and lora_A take the adapters autocast rounded to bf16, or with
    ``fp32_autocast_adapters`` the fp32 adapters themselves (and lora_A's output in fp32)."""
    options = {"experimental.lora_sum.fp32_autocast_adapters": fp32_adapters}
    compile_by_name(autocast_lora_mlp, options, *lora_inputs(gen, torch.bfloat16))
    want = torch.float32 if fp32_adapters else torch.bfloat16
    sums = [n for op in (OPS.lora_sum.default, OPS.lora_sum_wide.default) for n in calls(rewritten, op)]
    downs = [n for n in calls(rewritten, OPS.upcast_linear.default)]  # down's lora_A (gate's and up's are grouped)
    assert len(sums) == 3 and downs
    assert {n.args[2].meta["example_value"].dtype for n in sums} == {want}
    assert {n.args[1].meta["example_value"].dtype for n in downs} == {want}
    assert {n.meta["example_value"].dtype for n in downs} == {want}


def gated_of_wide_sums(gb, ga, gw, ub, ua, uw):  # the three calls lora_sum's post-grad pass takes in
    g, g_wide = OPS.lora_sum_wide(gb, ga, gw, 0.5)
    u, u_wide = OPS.lora_sum_wide(ub, ua, uw, 2.0)
    product = OPS.gated_activation(g, u, None, None, 1.0, 1.0, "silu", gate_wide=g_wide, up_wide=u_wide)[0]
    return product, g, u


@pytest.mark.parametrize("in_slices", [False, True])
def test_lora_sum_gated_in_slices_by_name(in_slices, gen):
    """The post-grad pass of the backend ``options=`` names, on a graph as Inductor hands it over: with
    ``gated_in_slices`` one ``gated_activation_of_lora_sums`` in place of the three calls, the same results."""
    backend = compile_by_name(lora_mlp, {"experimental.lora_sum.gated_in_slices": in_slices}, *lora_inputs(gen))
    args = [t for _ in range(2) for t in (torch.randn(6, 24, generator=gen).half(), torch.randn(6, 4, generator=gen),
                                          torch.randn(24, 4, generator=gen))]  # fmt: skip
    gm = make_fx(gated_of_wide_sums, tracing_mode="fake")(*args)
    counts: dict[str, int] = {}
    fuser.dynamo_backend._post_grad_pass(backend.config, counts)(gm.graph)
    gm.recompile()
    assert counts.get("gated_sums_in_slices") == (1 if in_slices else None)
    # the calls' targets may be the direct overloads by now: count by op
    ops = [str(n.target).split(".")[1] for n in gm.graph.nodes if str(n.target).startswith("fuser.")]
    assert sorted(ops) == (
        ["gated_activation_of_lora_sums"] if in_slices else ["gated_activation", *["lora_sum_wide"] * 2]
    )
    for got, want in zip(gm(*args), gated_of_wide_sums(*args), strict=True):
        assert torch.equal(got, want)


# --- the surface itself ---------------------------------------------------------------------------------------


def test_every_switch_is_a_typed_field_with_todays_default():
    config = fuser.FuserConfig()
    assert config.causal_attention == CausalAttentionConfig(sliding_window=True, block_sparse_masks=True)
    assert config.gated_mlp == GatedMLPConfig(recompute_for_down_weight=True)
    assert config.upcast_linear == UpcastLinearConfig(recompute_gated_input=True)
    assert config.rms_norm_linear == RmsNormLinearConfig(lora=False)
    experimental = config.experimental
    assert experimental.direct_calls is True and experimental.embedding_grads is True
    assert experimental.linear_cross_entropy == LinearCrossEntropyExperimental(
        dw_kernel="cublas", dw_accumulator="input", streams=True
    )
    assert experimental.causal_attention == CausalAttentionExperimental(gqa_fold=True, runtime_check=False)
    assert experimental.gated_mlp == GatedMLPExperimental(backward_in_place=True, backward_writes_product=True)
    assert experimental.upcast_linear == UpcastLinearExperimental(triton=True, group_shared_inputs=True)
    assert experimental.lora_sum == LoraSumExperimental(
        fp32_base=True, gated_in_slices=False, fp32_autocast_adapters=True
    )
    assert experimental.rms_norm == RmsNormExperimental(residual_add=True, gradient_sums=True)
    sections = [config.causal_attention, config.gated_mlp, config.upcast_linear, config.rms_norm_linear]
    sections += [experimental.linear_cross_entropy, experimental.lora_sum, experimental.rms_norm]
    for options in (*sections, config, experimental):
        assert dataclasses.is_dataclass(options)
        with pytest.raises(dataclasses.FrozenInstanceError):
            options.__setattr__(dataclasses.fields(options)[-1].name, None)


def test_nested_dicts_dotted_names_and_dataclasses_build_the_same_config():
    by_dict = fuser.FuserConfig(
        gated_mlp={"recompute_for_down_weight": False},
        experimental={"linear_cross_entropy": {"dw_accumulator": "fp32"}},
        upcast_linear={},
    )
    by_class = fuser.FuserConfig(
        gated_mlp=GatedMLPConfig(recompute_for_down_weight=False),
        experimental=ExperimentalConfig(linear_cross_entropy=LinearCrossEntropyExperimental(dw_accumulator="fp32")),
    )
    by_options = fuser.FuserConfig.from_options(
        {"gated_mlp": {"recompute_for_down_weight": False}, "experimental.linear_cross_entropy.dw_accumulator": "fp32"}
    )
    by_dotted = fuser.FuserConfig.from_options(
        {"gated_mlp.recompute_for_down_weight": False, "experimental": {"linear_cross_entropy.dw_accumulator": "fp32"}}
    )
    assert by_dict == by_class == by_options == by_dotted and hash(by_dict) == hash(by_class) == hash(by_dotted)
    assert by_dict.experimental.linear_cross_entropy.dw_kernel == "cublas"  # the fields left out keep their defaults
    dotted = {"gated_mlp.recompute_for_down_weight": False, "experimental.linear_cross_entropy.dw_accumulator": "fp32"}
    assert fuser.backend(dotted) is fuser.backend(by_class)  # as_config
    assert fuser.backend(by_class) is not fuser.backend()
    # dataclasses.replace keeps what it is not told to change, the patterns' options included
    replaced = dataclasses.replace(by_class, strict=True)
    assert replaced.strict and replaced.gated_mlp == by_class.gated_mlp
    assert replaced.experimental == by_class.experimental


@pytest.mark.parametrize(
    "options, error, text",
    [
        ({"experimental": {"linear_cross_entropy": {"dw_kernel": "cutlass"}}}, ValueError,
         r"experimental.linear_cross_entropy.dw_kernel must be one of 'cublas', 'triton', got 'cutlass'; "
         r"e.g. options=\{'experimental': \{'linear_cross_entropy': \{'dw_kernel': 'triton'\}\}\}"),
        ({"experimental.linear_cross_entropy.dw_accumulator": "bf16"}, ValueError,
         "experimental.linear_cross_entropy.dw_accumulator must be one of 'input', 'fp32', got 'bf16'"),
        ({"experimental.linear_cross_entropy.streams": "0"}, TypeError,
         r"experimental.linear_cross_entropy.streams must be True or False, got '0'; "
         r"e.g. options=\{'experimental': \{'linear_cross_entropy': \{'streams': False\}\}\}"),
        ({"experimental.causal_attention.gqa_fold": 1}, TypeError,
         "experimental.causal_attention.gqa_fold must be True or False"),
        ({"causal_attention": {"sliding_window": "yes"}}, TypeError, "causal_attention.sliding_window must be True"),
        ({"experimental.gated_mlp.backward_in_place": None}, TypeError,
         "experimental.gated_mlp.backward_in_place must be True or False"),
        ({"gated_mlp": {"recompute_for_down_weight": 0}}, TypeError, "gated_mlp.recompute_for_down_weight must be"),
        ({"experimental.upcast_linear.triton": "off"}, TypeError, "experimental.upcast_linear.triton must be True"),
        ({"upcast_linear": {"recompute_gated_input": []}}, TypeError, "upcast_linear.recompute_gated_input must"),
        ({"experimental.lora_sum.fp32_base": 1}, TypeError, "experimental.lora_sum.fp32_base must be True or False"),
        ({"experimental.direct_calls": "no"}, TypeError, "experimental.direct_calls must be True or False"),
        ({"experimental.linear_cross_entropy": {"dw_kernal": "triton"}}, ValueError,
         r"unknown option\(s\) \['dw_kernal'\] in experimental.linear_cross_entropy; its options are "
         r"\['dw_accumulator', 'dw_kernel', 'streams'\]"),
        ({"gated_mlp": {"in_place": False}}, ValueError, r"unknown option\(s\) \['in_place'\] in gated_mlp"),
        ({"upcast_linear": False}, TypeError, r"upcast_linear takes a dict of its options"),
        ({"causal_attention": ["sliding_window"]}, TypeError, r"causal_attention takes a dict of its options"),
        ({"causal": {"gqa_fold": True}}, ValueError, r"unknown option\(s\) \['causal'\]; FuserConfig fields are"),
        ({"experimental": {"strict": True}}, ValueError,
         r"unknown option\(s\) \['strict'\] in experimental; its options are \[.*'direct_calls'.*\]; strict is "
         "not experimental: set it as strict"),
        # a switch moved to the experimental namespace says where it went
        ({"gated_mlp": {"backward_in_place": False}}, ValueError,
         r"unknown option\(s\) \['backward_in_place'\] in gated_mlp; its options are \['recompute_for_down_weight'\]; "
         r"gated_mlp.backward_in_place is experimental: set it as experimental.gated_mlp.backward_in_place"),
        ({"linear_cross_entropy": {"streams": False}}, ValueError,
         r"unknown option\(s\) \['linear_cross_entropy'\]; .*; linear_cross_entropy is experimental: set it as "
         r"experimental.linear_cross_entropy"),
        ({"direct_calls": False}, ValueError, "direct_calls is experimental: set it as experimental.direct_calls"),
        ({"experimental.gated_mlp.recompute_for_down_weight": False}, ValueError,
         "gated_mlp.recompute_for_down_weight is not experimental: set it as gated_mlp.recompute_for_down_weight"),
    ],
)  # fmt: skip
def test_options_are_validated_when_built(options, error, text):
    with pytest.raises(error, match=text):
        fuser.FuserConfig.from_options(options)
    # the same by name through torch.compile: raised at the first call, when Dynamo calls the backend
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=text) as raised:
        torch.compile(lambda x: x + 1, backend="fuser", options=options)(torch.ones(2))
    assert isinstance(raised.value.inner_exception, error)
    if set(options) <= set(fuser.FuserConfig.option_names()):
        with pytest.raises(error, match=text):
            fuser.FuserConfig(**options)


def test_options_dataclasses_validate_themselves():
    with pytest.raises(ValueError, match="experimental.linear_cross_entropy.dw_kernel must be one of"):
        LinearCrossEntropyExperimental(dw_kernel="cutlass")
    with pytest.raises(TypeError, match="experimental.upcast_linear.triton must be True or False"):
        UpcastLinearExperimental(triton=1)
    with pytest.raises(TypeError, match="gated_mlp.recompute_for_down_weight must be True or False"):
        GatedMLPConfig(recompute_for_down_weight=1)


EVERY_SWITCH = [
    {"experimental.linear_cross_entropy.dw_kernel": "triton"},
    {"experimental.linear_cross_entropy.dw_accumulator": "fp32"},
    {"experimental.linear_cross_entropy.streams": False},
    {"experimental.causal_attention.gqa_fold": False},
    {"experimental.causal_attention.runtime_check": True},
    {"causal_attention.sliding_window": False},
    {"causal_attention.block_sparse_masks": False},
    {"gated_mlp.recompute_for_down_weight": False},
    {"experimental.gated_mlp.backward_in_place": False},
    {"experimental.gated_mlp.backward_writes_product": False},
    {"upcast_linear.recompute_gated_input": False},
    {"experimental.upcast_linear.triton": False},
    {"experimental.upcast_linear.group_shared_inputs": False},
    {"experimental.lora_sum.fp32_base": False},
    {"experimental.lora_sum.fp32_autocast_adapters": False},
    {"experimental.lora_sum.gated_in_slices": True},
    {"experimental.rms_norm.residual_add": False},
    {"experimental.rms_norm.gradient_sums": False},
    {"rms_norm_linear.lora": True},
    {"experimental.direct_calls": False},
    {"experimental.embedding_grads": False},
]


def test_every_switch_is_listed_here():
    """EVERY_SWITCH names each option of a pattern and each experimental one: a new one joins the cache-key
    check by being added there."""
    config = fuser.FuserConfig()
    names = [
        f"{section}.{f.name}" for section in config.sections() for f in dataclasses.fields(getattr(config, section))
    ]
    names += [f"experimental.{name}" for name in ("direct_calls", "embedding_grads")]
    names += [f"experimental.{section}.{f.name}" for section in ExperimentalConfig.sections()
              for f in dataclasses.fields(getattr(config.experimental, section))]  # fmt: skip
    assert sorted(names) == sorted(name for options in EVERY_SWITCH for name in options)


@pytest.mark.parametrize("options", EVERY_SWITCH, ids=lambda o: next(iter(o)))
def test_every_switch_is_in_the_inductor_cache_key(options):
    key = fuser.dynamo_backend._post_grad_pass(fuser.FuserConfig(), {}).uuid()
    changed = fuser.dynamo_backend._post_grad_pass(fuser.FuserConfig.from_options(options), {}).uuid()
    assert changed != key
    ((path, value),) = options.items()
    assert f"{path.rsplit('.', 1)[-1]}={value!r}" in repr(changed)


@pytest.mark.parametrize(
    "name, value",
    [
        ("FUSER_LCE_DW_KERNEL", "triton"),
        ("FUSER_LCE_DW_ACCUMULATOR", "fp32"),
        ("FUSER_LCE_STREAMS", "0"),
    ],
)
def test_environment_variables_switch_nothing(name, value, gen, rewritten, monkeypatch):
    monkeypatch.setenv(name, value)
    compile_by_name(lm_loss, {}, *lm_inputs(gen))
    (node,) = calls(rewritten, OPS.linear_cross_entropy.default)
    assert node.kwargs == {"dw_kernel": "cublas", "dw_accumulator": "input", "streams": True}


def test_cpu_tensors_take_triton_only_inside_triton_on_cpu(monkeypatch):
    from fuser.kernels._triton import triton_on_cpu

    monkeypatch.setenv("FUSER_CPU_TRITON", "1")  # no longer read
    x = torch.ones(2)
    assert not use_triton(x)
    with triton_on_cpu():
        assert use_triton(x) == (HAS_TRITON and interpreting())
        with triton_on_cpu(False):
            assert not use_triton(x)
        assert use_triton(x) == (HAS_TRITON and interpreting())
    assert not use_triton(x)
