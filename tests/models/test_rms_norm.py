"""Tier 3: ``experimental.rms_norm.gradient_sums`` (the post-grad pass ``norm_grad_sums``, on by default): a fused
norm's output gradient, which the backward graph forms as the sum of the input gradients of the projections the norm
feeds (q, k and v; gate and up), is summed by the norm's backward kernel instead of an add kernel before it. Through
Inductor on CPU (its caches off, so the post-grad passes run): one rewrite per norm that feeds projections, fp32 steps
equal bit for bit to the steps without it, bf16 steps as close to an fp32 copy as without it."""

from __future__ import annotations

import copy

import pytest
import torch

import fuser
from tests.models.inductor_steps import XDIST_GROUP, inductor_step
from tests.models.tiny import N_LAYERS, assert_same_step, batch, build, checkpointed, grads, lora_model, rel

# one worker runs the module under pytest-xdist (``--dist loadgroup``), beside the other modules that read the steps
# of tests/models/inductor_steps.py (each computed once there)
pytestmark = XDIST_GROUP

ON = fuser.FuserConfig.from_options({"strict": True, "experimental.rms_norm.gradient_sums": True})
OFF = fuser.FuserConfig.from_options({"strict": True, "experimental.rms_norm.gradient_sums": False})
U_BF16 = 2.0**-8  # bf16's unit roundoff: half an ulp, relative
# Gemma's norms take 1 + w and feed GeGLU; Qwen3's q/k norms read projections instead of feeding them (no sums)
FP32_ARCHS = ["llama", "gemma"]
BF16_ARCHS = ["llama", "qwen3"]


@pytest.fixture(autouse=True)
def _no_inductor_cache():
    # a graph from Inductor's (or AOT autograd's) cache skips the post-grad passes, and with them the count
    import torch._functorch.config as functorch_config

    with torch._inductor.config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


def step(model, config):
    """(loss, gradients) of one training step through fuser, and how many norm backwards took their sums."""
    backend = fuser.backend(config)
    before = backend.post_grad_counts.get("norm_grad_sums", 0)
    out = fuser.optimize(model, config)(**batch())
    out.loss.backward()
    taken = backend.post_grad_counts.get("norm_grad_sums", 0) - before
    torch._dynamo.reset()
    return (out.loss.detach(), grads(model)), taken


def shared_step(model, config):
    """``step`` of ``inductor_steps.MODELS[model]``, read from the one computed there."""
    shared = inductor_step(model, config)
    return shared.loss_and_grads(), shared.post_grad_counts.get("norm_grad_sums", 0)


@pytest.mark.parametrize("arch", FP32_ARCHS)
def test_fp32_full_fine_tuning_takes_every_projection_sum_and_the_step_is_unchanged(arch):
    """Each layer's two norms feed projections (q/k/v, gate/up): two sums per layer. In fp32 the kernel adds the
    terms in fp32, left to right, as Inductor's add kernel did: the same step bit for bit."""
    model = build(arch).train()
    on, taken = shared_step(arch, ON)  # of build(arch).train()
    off, taken_off = step(copy.deepcopy(model), OFF)
    assert taken == 2 * N_LAYERS and taken_off == 0
    assert_same_step(on, off)


@pytest.mark.parametrize("arch", BF16_ARCHS)
def test_bf16_full_fine_tuning_is_as_close_to_fp32_as_without_it(arch):
    """bf16: the sum is no longer rounded to bf16 before the norm's backward reads it, one rounding fewer. So every
    gradient's relative error against an fp32 copy's step moves by at most one bf16 rounding (U_BF16) either way,
    and the loss (computed before the backward) is the same."""
    model = build(arch, torch.bfloat16).train()
    (loss32, grads32), _ = step(copy.deepcopy(model).float(), OFF)
    (loss_on, grads_on), taken = shared_step(f"{arch} bf16", ON)  # of build(arch, torch.bfloat16).train()
    (loss_off, grads_off), _ = step(copy.deepcopy(model), OFF)
    assert taken == 2 * N_LAYERS
    assert torch.equal(loss_on, loss_off)
    assert grads_on.keys() == grads32.keys() and len(grads_on) == len(list(model.parameters()))
    moved = 0
    for name, g in grads_on.items():
        err_on, err_off = rel(g, grads32[name]), rel(grads_off[name], grads32[name])
        assert err_on <= err_off + U_BF16, f"{name}: {err_on:.2e} with the sums, {err_off:.2e} without"
        moved += not torch.equal(g, grads_off[name])
    assert moved, "no gradient changed: the sums were rounded as before"


def test_lora_takes_the_sums_of_the_adapted_projections():
    """peft's LoRA on every linear layer (bf16 base, fp32 adapters): the norms' output gradients are sums of the
    adapted projections' input gradients too; the step stays as close to fp32 as without it."""
    model = lora_model()
    (_, grads32), _ = step(copy.deepcopy(model).float(), OFF)
    (_, grads_on), taken = shared_step("lora", ON)  # of lora_model()
    (_, grads_off), _ = step(copy.deepcopy(model), OFF)
    # every norm but the first layer's input norm (the embeddings are frozen: its backward does not run)
    assert taken == 2 * N_LAYERS - 1
    for name, g in grads_on.items():
        assert rel(g, grads32[name]) <= rel(grads_off[name], grads32[name]) + U_BF16, name


def test_checkpointed_layers_take_their_sums():
    model = checkpointed(build("llama"))
    on, taken = shared_step("checkpointed llama", ON)
    off, _ = step(copy.deepcopy(model), OFF)
    assert taken == 2 * N_LAYERS
    assert_same_step(on, off)


CAST_PASSES = ("norm_grad_upcasts", "output_casts", "rope_grad_upcasts")


def autocast_step(model, config):
    """``step`` under bf16 autocast; also how many calls each cast pass rewrote ({pass: calls})."""
    backend = fuser.backend(config)
    before = {name: backend.post_grad_counts.get(name, 0) for name in CAST_PASSES}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fuser.optimize(model, config)(**batch())
    out.loss.backward()
    taken = {name: backend.post_grad_counts.get(name, 0) - before[name] for name in CAST_PASSES}
    torch._dynamo.reset()
    return (out.loss.detach(), grads(model)), taken


def test_autocast_norm_backwards_read_the_bf16_terms_and_the_step_is_unchanged():
    """fp32 weights under bf16 autocast (a trainer's ``bf16=True`` on an fp32 model): every norm's output gradient
    terms are bf16 projection gradients (q/k/v, gate/up; the lm_head's for the final norm) widened to fp32 by
    autocast's casts. Each norm backward reads them as bf16 and widens them as it loads them: the same values, the
    same sum, so the step is the step with both passes off, bit for bit."""
    model = build("llama").train()
    model.config.use_cache = False  # a cache would read the rotated k in fp32: its cast then stays (and q's with it)
    on, taken = autocast_step(copy.deepcopy(model), ON)
    off, taken_off = autocast_step(copy.deepcopy(model), OFF)
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
def test_gpu_llama_1024_bf16_step_as_close_to_fp32_as_without_it():
    """A 2-layer Llama at hidden 1024 in bf16 on the GPU through Inductor (the Triton kernel), one full fine-tuning
    step with the sums on and off against an fp32 copy: two sums per layer taken, each gradient within one bf16
    rounding (U_BF16) of the off-run's distance from fp32, and within eager bf16's bar
    (tests/models/test_gpu_models.py: 1.5× eager bf16's error + U_BF16)."""
    from tests.models.tiny import from_config

    extra = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 8, "num_key_value_heads": 4}
    base = from_config("LlamaConfig", {"attn_implementation": "sdpa", **extra, "head_dim": 128}).cuda()
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
    got_on, taken = run(copy.deepcopy(base).bfloat16(), ON)
    got_off, _ = run(copy.deepcopy(base).bfloat16(), OFF)
    assert taken == 2 * N_LAYERS
    for name, g in got_on.items():
        err_on, err_off = rel(g, grads32[name]), rel(got_off[name], grads32[name])
        assert err_on <= err_off + U_BF16, (name, err_on, err_off)
        assert err_on <= 1.5 * rel(grads16[name], grads32[name]) + U_BF16, (name, err_on)


@pytest.mark.gpu
def test_gpu_llama_1024_autocast_step_reads_bf16_terms_and_is_as_close_to_fp32_as_eager():
    """fp32 weights under bf16 autocast on the GPU (Inductor, the Triton kernels): every norm backward reads its bf16
    gradient terms (``norm_grad_upcasts``: each layer's two norms and the final norm), and the step's loss and
    gradients stay as close to the fp32 step's as eager autocast's, by tests/models/test_gpu_models.py's bar
    (1.5× eager's error + U_BF16)."""
    from tests.models.tiny import from_config

    extra = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 8, "num_key_value_heads": 4}
    fields = {"attn_implementation": "sdpa", "use_cache": False, **extra, "head_dim": 128}
    base = from_config("LlamaConfig", fields).cuda()
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
    loss, got, taken = run(copy.deepcopy(base), ON)
    assert taken == 2 * N_LAYERS + 1
    assert rel(loss, loss32) <= 1.5 * rel(loss_eager, loss32) + U_BF16, (loss, loss_eager, loss32)
    assert got.keys() == grads32.keys() and got
    for name, g in got.items():
        err, err_eager = rel(g, grads32[name]), rel(grads_eager[name], grads32[name])
        assert err <= 1.5 * err_eager + U_BF16, (name, err, err_eager)
