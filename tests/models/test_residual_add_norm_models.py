"""Tier 3: ``experimental.rms_norm.residual_add`` (on by default) under full fine-tuning: the residual add that a fused
RMSNorm reads (a decoder layer's ``h + attn_out`` before its post-attention norm, ``h + mlp_out`` before the next
layer's input norm or the final norm) becomes one ``fuser::add_rms_norm`` with the norm, whichever of ``rms_norm`` and
``rms_norm_linear`` took the norm; the residual stream reads the op's rounded sum. Counted in the rewritten graphs the
backend compiles; the step checked against eager fp32 (fp32 models) or against an fp32 copy, as close as the step
without it (bf16 models)."""

from __future__ import annotations

import copy
import logging
import operator

import pytest
import torch

import fuser
from fuser.dynamo_backend import FuserBackend
from fuser.engine.canonical import tensor_meta
from fuser.engine.rewrite import subgraph_modules
from tests.models.tiny import N_LAYERS, batch, build, checkpointed, expected_norms, from_config, grads, rel

OPS = torch.ops.fuser
ARCHS = ["llama", "qwen3", "gemma"]  # Qwen3 adds per-head q/k norms, which read projections; Gemma's are 1 + w
U_BF16 = 2.0**-8  # bf16's unit roundoff: half an ulp, relative


def config(residual_add: bool = True, **fields) -> fuser.FuserConfig:
    return fuser.FuserConfig(
        strict=True, inner_compiler="aot_eager", experimental={"rms_norm": {"residual_add": residual_add}}, **fields
    )


def residual_norms() -> int:
    """The norms that read a residual add: each layer's input and post-attention norms but the first layer's input
    norm (it reads the embeddings; Gemma's scaled by √hidden, a multiply), plus the final norm."""
    return 2 * N_LAYERS - 1 + 1


@pytest.fixture
def rewritten(monkeypatch):
    """The graphs the backend hands its inner compiler (rewritten, refinements applied), in order."""
    graphs = []
    real = FuserBackend.compile_inner
    monkeypatch.setattr(FuserBackend, "compile_inner", lambda self, gm, ex: graphs.append(gm) or real(self, gm, ex))
    return graphs


def calls(graphs, op) -> list[torch.fx.Node]:
    return [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function" and n.target is op]


def step(model, cfg=None):
    run = model if cfg is None else fuser.optimize(model, cfg)
    out = run(**batch())
    out.loss.backward()
    return out.loss.detach(), grads(model)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_step_equals_eager_with_every_residual_add_in_its_norm(arch, rewritten):
    """fp32: the op computes eager's formulas (the add, the norm of it, dx + dh) in fp32, only in another order of
    summation: loss within 1e-6 and every gradient within 1e-5 relative (measured ≤ 4e-7). The sum's other reader
    (the next residual add) takes the op's third output, and so do ``linear_normed``'s weight-gradient rebuilds of
    the projections after the norm."""
    model = build(arch).train()
    loss_ref, ref = step(copy.deepcopy(model))
    loss, got = step(model, config())
    fused = calls(rewritten, OPS.add_rms_norm.default)
    assert len(fused) == residual_norms(), [n.args[:2] for n in fused]
    assert len(calls(rewritten, OPS.rms_norm.default)) == expected_norms(arch) - residual_norms()
    # the q/k/v (input norms) and gate/up (post-attention norms) weight gradients rebuild from the op's sum
    rebuilt = [n.args[1] for n in calls(rewritten, OPS.linear_normed.default)]
    from_sums = [h for h in rebuilt if h.target is operator.getitem and h.args[0] in fused and h.args[1] == 2]
    assert len(from_sums) == 3 * (N_LAYERS - 1) + 2 * N_LAYERS, rebuilt
    assert rel(loss, loss_ref) <= 1e-6, (loss, loss_ref)
    assert got.keys() == ref.keys() and len(got) == len(list(model.parameters()))
    for name, g in got.items():
        assert rel(g, ref[name]) <= 1e-5, name


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_step_as_close_to_fp32_as_without_it(arch, rewritten):
    """bf16, against an fp32 copy: with residual_add on and off, the loss and every gradient. The two runs differ in
    where values are rounded: with it the norm reads the sum before its rounding to bf16 (a difference of at most
    half an ulp, 2⁻⁹ relative, per element), and the residual stream's gradient is added to the norm's dx in fp32
    and rounded once, not rounded, added and rounded again. Each is one rounding, so a value's distance from fp32
    moves by at most one bf16 rounding of it, U_BF16 = 2⁻⁸ relative, and the loss's and each gradient's no more
    than that, as far as the step's arithmetic carries the difference on unamplified (the bar of
    tests/models/test_gpu_models.py too). Measured by this test's steps (CPU, aot_eager, build seed 0, torch 2.13,
    2026-12-03): the largest rise of one gradient's relative error 1.7e-3, of the loss's 3e-5. With it off, no
    add_rms_norm at all."""
    model = build(arch, torch.bfloat16).train()
    loss32, grads32 = step(copy.deepcopy(model).float())
    errors = {}
    for on in (True, False):
        torch._dynamo.reset()
        rewritten.clear()
        loss, got = step(copy.deepcopy(model), config(on))
        assert len(calls(rewritten, OPS.add_rms_norm.default)) == (residual_norms() if on else 0)
        assert got.keys() == grads32.keys() and len(got) == len(list(model.parameters()))
        errors[on] = rel(loss, loss32), {name: rel(g, grads32[name]) for name, g in got.items()}
    (loss_on, grads_on), (loss_off, grads_off) = errors[True], errors[False]
    assert loss_on <= loss_off + U_BF16, (loss_on, loss_off)
    for name, err in grads_on.items():
        assert err <= grads_off[name] + U_BF16, f"{name}: {err:.2e} on, {grads_off[name]:.2e} off"


@pytest.mark.parametrize("arch", ARCHS)
def test_autocast_step_with_fp32_weights_equals_the_step_without_it(arch, rewritten):
    """fp32 weights under bf16 autocast (a trainer's ``bf16=True`` on an fp32 model): each residual add sums the fp32
    stream and a bf16 projection into fp32. The op computes that sum in fp32 as eager's add does, the norm of it,
    and in the backward the stream's gradient plus the norm's in fp32, handing the projection its bf16 rounding, as
    autograd's add does: so the step is the step without it, bit for bit (loss and every gradient)."""
    model = build(arch).train()

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
        results[on] = autocast_step(config(on))
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
    model = checkpointed(build("llama"))
    loss_ref, ref = step(copy.deepcopy(model))
    loss, got = step(model, config())
    nested = [m for gm in rewritten for _, m in subgraph_modules(gm)]
    assert len(calls(nested, OPS.add_rms_norm.default)) == N_LAYERS
    assert rel(loss, loss_ref) <= 1e-6
    for name, g in got.items():
        assert rel(g, ref[name]) <= 1e-5, name


def test_rms_norm_linear_norms_alone_absorb_their_adds(rewritten):
    """With the rms_norm pattern off, the norms rms_norm_linear takes (every layer's two) still absorb their adds (its
    refinement runs it); the final norm, then not fused, keeps its add."""
    patterns = tuple(name for name in fuser.DEFAULT_PATTERNS if name != "rms_norm")
    model = build("llama").train()
    loss_ref, ref = step(copy.deepcopy(model))
    loss, got = step(model, config(patterns=patterns))
    assert len(calls(rewritten, OPS.add_rms_norm.default)) == 2 * N_LAYERS - 1
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
    y, h = fuser.optimize(module, config())(a, b)
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
    fuser.optimize(module, config(False))(torch.randn(2, 5, 64), torch.randn(2, 5, 64))
    assert not calls(rewritten, OPS.add_rms_norm.default) and len(calls(rewritten, OPS.rms_norm.default)) == 1


# ---------------------------------------------------------------------------------------------------------
# GPU: the Triton kernels under Inductor
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_llama_1024_bf16_step_as_close_to_fp32_as_without_it():
    """A 2-layer Llama at hidden 1024 in bf16 on the GPU, Inductor, one full fine-tuning step with residual_add on
    and off against an fp32 copy: each within eager bf16's bar (tests/models/test_gpu_models.py: 1.5x eager bf16's
    error + U_BF16), and the on-run's error not above the off-run's by more than one bf16 ulp, 2⁻⁷ relative: the two
    compiled steps differ by the roundings the op removes (half an ulp each, U_BF16, as on CPU) and by Inductor's
    own kernels around the add (the off-run's add kernel, fused with its neighbours; the sums of the residual
    gradients it computes in another order), one more half-ulp-scale draw."""
    extra = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 8, "num_key_value_heads": 4}
    base = from_config("LlamaConfig", {"attn_implementation": "sdpa", **extra, "head_dim": 128}).cuda()
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
        assert sum(r.refined.get("rms_norm", 0) for r in fuser.backend(cfg).results) == (residual_norms() if on else 0)
        errors[on] = rel(loss, loss32), {name: rel(g, grads32[name]) for name, g in got.items()}
        assert errors[on][0] <= 1.5 * rel(loss16, loss32) + U_BF16
        for name, err in errors[on][1].items():
            assert err <= 1.5 * rel(grads16[name], grads32[name]) + U_BF16, (on, name, err)
    (loss_on, grads_on), (loss_off, grads_off) = errors[True], errors[False]
    assert loss_on <= loss_off + 2 * U_BF16, (loss_on, loss_off)
    for name, err in grads_on.items():
        assert err <= grads_off[name] + 2 * U_BF16, f"{name}: {err:.2e} on, {grads_off[name]:.2e} off"
