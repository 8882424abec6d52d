"""DeepSpeed ZeRO-3's two changes to a model, in one process: its ``F.linear`` replaced by a custom autograd.Function
(``src/fuser/engine/function_linear.py`` reads such a Function as a linear when its forward and backward graphs are a
linear's) and the decoder layers marked as ZeRO-3 leaf modules by ``optimize_`` (``src/fuser/zero3.py``). The
two-process Trainer runs are ``tests/integrations/test_deepspeed.py``."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch

import fuser
from fuser import zero3
from tests.integrations._distributed_worker import VOCAB, tiny_llama

pytest.importorskip("transformers")


class LinearFunction(torch.autograd.Function):
    """DeepSpeed's ``LinearFunctionForZeroStage3`` as written there (its partitioned-weight gather left out: the
    graph is traced with the weight gathered), so the test needs no DeepSpeed."""

    @staticmethod
    def forward(input, weight, bias=None):
        if input.dim() == 2 and bias is not None:
            return torch.addmm(bias, input, weight.t())
        output = input.matmul(weight.t())
        if bias is not None:
            output += bias
        return output

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight, bias = inputs[0], inputs[1], inputs[2] if len(inputs) > 2 else None
        ctx.save_for_backward(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)
        if ctx.needs_input_grad[1]:
            grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(input.reshape(-1, input.shape[-1]))
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_output.sum([i for i in range(grad_output.dim() - 1)])
        return grad_input, grad_weight, grad_bias


class NotLinearBackward(LinearFunction):
    """A linear forward whose backward is not the linear's gradient: no fused op may stand for it."""

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(input.reshape(-1, input.shape[-1]))
        return grad_output.matmul(weight), grad_weight * 2, None


def _explain_with_linear(monkeypatch, function):
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    if function is not None:
        monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: function.apply(x, w, b))
    return fuser.explain(model, input_ids=ids, labels=ids)


@pytest.fixture(scope="module")
def plain() -> dict[str, int]:
    """What fuses in the tiny Llama with torch's own F.linear."""
    counts = _explain_with_linear(None, None).counts
    assert counts.get("rms_norm_linear") == 4 and counts.get("linear_cross_entropy") == 1
    return counts


def test_a_function_computing_a_linear_fuses_as_f_linear_does(monkeypatch, plain):
    assert _explain_with_linear(monkeypatch, LinearFunction).counts == plain


def test_a_function_whose_backward_is_not_the_linear_gradient_is_no_linear(monkeypatch):
    counts = _explain_with_linear(monkeypatch, NotLinearBackward).counts
    assert "rms_norm_linear" not in counts and "linear_cross_entropy" not in counts, counts


def test_deepspeed_zero3_linear_fuses_as_f_linear_does(monkeypatch, plain):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3

    assert _explain_with_linear(monkeypatch, LinearFunctionForZeroStage3).counts == plain


@pytest.mark.parametrize("shape", [(2, 5, 8), (10, 8)], ids=["3-D, bias added", "2-D, addmm"])
def test_a_function_linear_with_bias_reads_as_linear(shape):
    from fuser.engine.canonical import canonical

    lin = torch.nn.Linear(8, 4)
    read = []

    def capture(gm, example_inputs):
        read.extend(c for n in gm.graph.nodes if (c := canonical(n)) is not None and c.op == "linear")
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(shape, requires_grad=True)
    torch.compile(lambda t: LinearFunction.apply(t, lin.weight, lin.bias), backend=capture)(x)
    assert len(read) == 1 and all(a is not None for a in read[0].args)  # input, weight and bias bound


def test_a_trained_step_through_the_function_equals_eager(monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: LinearFunction.apply(x, w, b))
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    eager, compiled = tiny_llama(), tiny_llama()
    torch._dynamo.reset()
    config = fuser.FuserConfig(inner_compiler="aot_eager", strict=True, zero3_leaf_layers=False)
    run = fuser.optimize(compiled, config)
    want, got = eager(input_ids=ids, labels=ids).loss, run(input_ids=ids, labels=ids).loss
    want.backward()
    got.backward()
    assert fuser.report(run).counts.get("linear_cross_entropy") == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_decoder_layers_are_the_repeated_modulelist_entries():
    model = tiny_llama()
    assert zero3.repeated_layers(model) == list(model.model.layers)
    assert zero3.repeated_layers(torch.nn.Sequential(torch.nn.Linear(2, 2))) == []


def test_optimize_in_place_marks_the_layers_as_zero3_leaves(monkeypatch):
    monkeypatch.setattr(zero3, "deepspeed_installed", lambda: True)
    model = fuser.optimize_(tiny_llama())
    assert [getattr(layer, zero3.Z3_LEAF_ATTRIBUTE, None) for layer in model.model.layers] == [True, True]
    assert not any(hasattr(m, zero3.Z3_LEAF_ATTRIBUTE) for m in list(model.model.layers[0].modules())[1:])
    off = fuser.optimize_(tiny_llama(), fuser.FuserConfig(zero3_leaf_layers=False))
    assert not any(hasattr(layer, zero3.Z3_LEAF_ATTRIBUTE) for layer in off.model.layers)
    # the user's own choice stands
    mine = tiny_llama()
    mine.model.layers[0]._z3_leaf = False
    fuser.optimize_(mine)
    assert [getattr(layer, zero3.Z3_LEAF_ATTRIBUTE, None) for layer in mine.model.layers] == [False, None]


def test_without_deepspeed_nothing_is_marked(monkeypatch):
    monkeypatch.setattr(zero3, "deepspeed_installed", lambda: False)
    model = fuser.optimize_(tiny_llama())
    assert not any(hasattr(layer, zero3.Z3_LEAF_ATTRIBUTE) for layer in model.model.layers)


def test_optimize_leaves_the_users_layers_unmarked_and_warns_once_under_zero3(monkeypatch):
    monkeypatch.setattr(zero3, "deepspeed_installed", lambda: True)
    model = tiny_llama()
    compiled = fuser.optimize(model, fuser.FuserConfig(inner_compiler="aot_eager"))
    assert not any(hasattr(m, zero3.Z3_LEAF_ATTRIBUTE) for m in model.modules())

    def hook(module, args):  # stands for one of DeepSpeed's ZeRO-3 pre-forward hooks
        return None

    hook.__module__ = zero3._DEEPSPEED_HOOKS_MODULE
    for layer in model.model.layers:
        layer.register_forward_pre_hook(hook)
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    ids = torch.randint(0, VOCAB, (1, 8))
    with pytest.warns(UserWarning, match="optimize_.*leaf modules"):
        compiled(input_ids=ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled(input_ids=ids)  # told once


def test_under_zero3_leaves_a_frozen_embedding_gets_the_input_require_grads_hook(monkeypatch):
    """LoRA under ZeRO-3 with the layers as fuser's leaves: DeepSpeed collects a leaf's gradients only when an input
    of the leaf needs a gradient, which a frozen embedding's output does not. optimize_ registers transformers'
    ``enable_input_require_grads`` hook at the first call once ZeRO-3 has partitioned the layers (``ds_id``), and
    ``ignore_input_require_grads`` no longer swaps it out during the calls."""
    from fuser import dynamo_backend

    monkeypatch.setattr(zero3, "deepspeed_installed", lambda: True)
    ignored = []
    real = dynamo_backend.input_require_grads_ignored
    monkeypatch.setattr(dynamo_backend, "input_require_grads_ignored", lambda m: ignored.append(m) or real(m))
    model = tiny_llama()
    for name, p in model.named_parameters():  # LoRA-like: the layers train something, the embedding nothing
        p.requires_grad_("mlp" in name)
    fuser.optimize_(model, fuser.FuserConfig(inner_compiler="aot_eager"))
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    embedding = model.get_input_embeddings()
    ids = torch.randint(0, VOCAB, (1, 8))
    model(input_ids=ids)  # not partitioned yet: nothing added, the hooks ignored as ever
    assert not embedding._forward_hooks and len(ignored) == 1
    for i, p in enumerate(model.model.layers.parameters()):
        p.ds_id = i  # what ZeRO-3's partitioning sets
    model(input_ids=ids)
    model(input_ids=ids)
    assert list(embedding._forward_hooks.values()) == [zero3.make_inputs_require_grads]  # once
    assert len(ignored) == 1  # kept during the calls under ZeRO-3 leaves
    out = embedding(ids)
    assert out.requires_grad


def test_without_zero3_leaves_no_hook_is_added(monkeypatch):
    monkeypatch.setattr(zero3, "deepspeed_installed", lambda: True)
    model = tiny_llama()
    for name, p in model.named_parameters():
        p.requires_grad_("mlp" in name)
    fuser.optimize_(model, fuser.FuserConfig(inner_compiler="aot_eager", zero3_leaf_layers=False))
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    for i, p in enumerate(model.model.layers.parameters()):
        p.ds_id = i
    model(input_ids=torch.randint(0, VOCAB, (1, 8)))
    assert not model.get_input_embeddings()._forward_hooks
