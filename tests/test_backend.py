"""The public API contract: optimize never mutates, backend identity, options by name, fallback, cache key."""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import fuser
import fuser.dynamo_backend
from fuser.patterns import rms_norm as rms_norm_pattern
from tests.models.tiny import batch, build, rel

AOT = fuser.FuserConfig(inner_compiler="aot_eager")


def test_optimize_never_mutates_the_model():
    model = build("llama")
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    forward = model.forward
    optimized = fuser.optimize(model, AOT)
    optimized(**batch()).loss.backward()
    assert model.forward == forward and "forward" not in model.__dict__
    assert list(model.state_dict()) == list(before)
    for k, v in model.state_dict().items():
        assert v.data_ptr() == before[k][0] and torch.equal(v, before[k][1]), k
    assert type(model).__name__ == "LlamaForCausalLM"
    assert all(k.startswith("_orig_mod.") for k in optimized.state_dict())


def test_save_load_round_trip_through_the_optimized_model(tmp_path):
    model = build("llama")
    optimized = fuser.optimize(model, AOT)
    optimized(**batch())
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    for (k, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    buffer = io.BytesIO()
    torch.save(optimized.state_dict(), buffer)
    buffer.seek(0)
    fresh = fuser.optimize(build("llama", seed=5), AOT)
    fresh.load_state_dict(torch.load(buffer))
    for (k, a), (_, b) in zip(optimized.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


def test_backend_is_one_object_per_config():
    assert fuser.backend() is fuser.backend(fuser.FuserConfig())
    assert fuser.backend(AOT) is fuser.backend(fuser.FuserConfig(inner_compiler="aot_eager"))
    assert fuser.backend(AOT) is not fuser.backend()


def test_config_rejects_unknown_names():
    with pytest.raises(ValueError, match="inner_compiler"):
        fuser.FuserConfig(inner_compiler="tvm")
    with pytest.raises(ValueError, match="unknown pattern"):
        fuser.FuserConfig(patterns=("group_norm",))
    with pytest.raises(ValueError, match="unknown option"):
        fuser.FuserConfig.from_options({"stritc": True})


def test_disabled_pattern_is_not_applied():
    model = build("llama")
    config = fuser.FuserConfig(patterns=(), inner_compiler="aot_eager", strict=True)
    fuser.optimize(model, config)(**batch())
    assert fuser.backend(config).counts == {}


def test_compile_by_name_with_options_maps_onto_config():
    model = build("llama")
    compiled = torch.compile(model, backend="fuser", options={"strict": True, "inner_compiler": "aot_eager"})
    compiled(**batch())
    counts = fuser.backend(fuser.FuserConfig(strict=True, inner_compiler="aot_eager")).counts
    assert counts == {"rms_norm_linear": 4, "rms_norm": 1, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1}


def test_compile_by_name_in_a_fresh_process_without_importing_fuser():
    script = textwrap.dedent(
        """
        import sys, torch
        assert "fuser" not in sys.modules
        x, w = torch.randn(4, 32), torch.randn(32)
        def norm(x, w):
            h = x.float()
            return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        out = torch.compile(norm, backend="fuser", options={"strict": True, "inner_compiler": "aot_eager"})(x, w)
        torch.testing.assert_close(out, norm(x, w))
        fuser = sys.modules["fuser"]
        print(fuser.backend(fuser.FuserConfig(strict=True, inner_compiler="aot_eager")).counts)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("{'rms_norm': 1}")


def _failing_check(found, variant, config):
    raise RuntimeError("injected fault")


def test_fault_in_rewrite_falls_back_to_the_unrewritten_graph(monkeypatch):
    monkeypatch.setattr(rms_norm_pattern.RMS_NORM, "check", _failing_check)
    model = build("llama")
    reference = copy.deepcopy(model)
    data = batch()
    with pytest.warns(RuntimeWarning, match="compiling the unrewritten graph"):
        out = fuser.optimize(model, AOT)(**data)
    assert fuser.backend(AOT).counts == {}
    assert rel(out.loss, reference(**data).loss) <= 1e-6


def test_fault_in_rewrite_raises_under_strict(monkeypatch):
    monkeypatch.setattr(rms_norm_pattern.RMS_NORM, "check", _failing_check)
    config = fuser.FuserConfig(strict=True, inner_compiler="aot_eager")
    with pytest.raises(Exception) as info:
        fuser.optimize(build("llama"), config)(**batch())
    chain, error = [], info.value
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    assert any(isinstance(e, fuser.FuserError) for e in chain), chain


def test_failure_compiling_the_rewritten_graph_falls_back(monkeypatch):
    backend = fuser.backend(AOT)
    original = backend.compile_inner

    def compile_inner(gm, example_inputs):
        if any(getattr(n.target, "namespace", None) == "fuser" for n in gm.graph.nodes):
            raise RuntimeError("injected lowering failure")
        return original(gm, example_inputs)

    monkeypatch.setattr(backend, "compile_inner", compile_inner)
    model = build("llama")
    data = batch()
    with pytest.warns(RuntimeWarning, match="compiling the rewritten graph failed"):
        out = fuser.optimize(model, AOT)(**data)
    assert rel(out.loss, copy.deepcopy(model)(**data).loss) <= 1e-6
    assert backend.counts == {}


def test_cache_key_carries_fuser_source_config_and_switch():
    a = fuser.dynamo_backend._post_grad_pass(fuser.FuserConfig(), {}).uuid()
    b = fuser.dynamo_backend._post_grad_pass(fuser.FuserConfig(strict=True), {}).uuid()
    assert a != b
    assert fuser.dynamo_backend._SOURCE_DIGEST in repr(a)
    off = fuser.FuserConfig(experimental={"gated_mlp": {"backward_in_place": False}})
    assert fuser.dynamo_backend._post_grad_pass(off, {}).uuid() != a
    logging_off = fuser.dynamo_backend._post_grad_pass(fuser.FuserConfig(ignore_logging=False), {}).uuid()
    assert logging_off != a and "ignore_logging=False" in repr(logging_off)


def test_explain_report_table_names_source_lines():
    report = fuser.explain(build("llama"), **batch())
    text = str(report)
    assert "modeling_llama.py" in text and "rms_norm=1" in text and "rms_norm_linear=4" in text
    assert report.graph_breaks == 0


def test_functional_rms_norm_rejects_a_wrong_weight():
    with pytest.raises(ValueError, match="1-D weight of size 8"):
        fuser.rms_norm(torch.randn(2, 8), torch.randn(4))


def test_optimize_takes_a_dict_of_config_fields():
    model = build("llama")
    optimized = fuser.optimize(model, {"inner_compiler": "aot_eager", "strict": True})
    optimized(**batch()).loss.backward()
    assert fuser.backend({"inner_compiler": "aot_eager", "strict": True}).counts["rms_norm_linear"] == 4
    with pytest.raises(ValueError, match="unknown option"):
        fuser.optimize(model, {"inner": "aot_eager"})
    with pytest.raises(TypeError, match="FuserConfig, a dict"):
        fuser.optimize(model, "aot_eager")


@pytest.mark.parametrize(
    "fields, error, text",
    [
        ({"patterns": "rms_norm"}, TypeError, r"patterns=\('rms_norm',\)"),
        ({"patterns": ["rms_norm", 3]}, TypeError, "pattern names"),
        ({"patterns": ["rms_nrom"]}, ValueError, "unknown pattern"),
        ({"keep_logits": "yes"}, TypeError, "keep_logits must be True or False"),
        ({"strict": 1}, TypeError, "strict must be True or False"),
        ({"ignore_logging": "no"}, TypeError, "ignore_logging must be True or False"),
        ({"inner_compiler": "cudagraphs"}, ValueError, "inner_compiler must be one of"),
    ],
)
def test_config_is_validated_when_built(fields, error, text):
    with pytest.raises(error, match=text):
        fuser.FuserConfig(**fields)
    with pytest.raises(error, match=text):  # the same through torch.compile's options=
        fuser.FuserConfig.from_options(fields)


def test_optimize_in_place_keeps_the_users_class_keys_and_signature():
    import inspect

    model = build("llama")
    keys, signature = list(model.state_dict()), inspect.signature(model.forward)
    assert fuser.optimize_(model, AOT) is model
    model(**batch()).loss.backward()
    assert type(model).__name__ == "LlamaForCausalLM" and list(model.state_dict()) == keys
    assert inspect.signature(model.forward) == signature
    assert fuser.report(model).counts["rms_norm_linear"] == 4 and fuser.report(model).counts["rms_norm"] == 1
    with pytest.raises(TypeError, match="already wrapped"):
        fuser.optimize_(fuser.optimize(build("llama"), AOT))
    with pytest.raises(ValueError, match="not given to fuser.optimize"):
        fuser.report(build("llama"))


def test_inductor_never_formats_the_arguments_of_fuser_ops(monkeypatch, caplog):
    """Inductor's implicit fallback for an op it has no lowering for formats the op's arguments first (eagerly,
    up to torch 2.11), and an opaque op's argument string holds its producers', recursively: exponential in the
    depth of a chain of fuser ops (a 32-layer model's compile did not finish in minutes). fuser registers its ops'
    fallbacks before Inductor runs, so their arguments are never formatted."""
    import logging

    from torch._inductor import exc, lowering

    from tests.models.tiny import lora_model

    for op in [op for op in lowering.lowerings if str(op).startswith("fuser.")]:  # as in a fresh process
        monkeypatch.delitem(lowering.lowerings, op)
    formatted = []
    real = exc.OperatorIssue.operator_str

    def spy(target, args, kwargs):
        formatted.append(str(target))
        return real(target, args, kwargs)

    monkeypatch.setattr(exc.OperatorIssue, "operator_str", staticmethod(spy))
    caplog.set_level(logging.INFO, logger="torch._inductor.graph")  # the message is built where it is logged
    backend = fuser.backend(fuser.FuserConfig())
    fuser.optimize(lora_model(), backend.config)(**batch()).loss.backward()
    assert backend.counts["lora_sum"] > 0 and backend.counts["rms_norm"] > 0
    assert not [t for t in formatted if t.startswith("fuser.")], formatted


def test_a_model_dynamo_ran_uncompiled_reports_no_graph_and_says_why():
    """Past Dynamo's recompile limit on transformers' shared forward wrapper (many model classes compiled in one
    process), a model runs uncompiled: its report has no graph, and says so with the likely cause and the remedy,
    instead of only "(nothing matched)". A model that compiled does not carry the hint."""
    from fuser.report import NO_GRAPH_HINT

    with torch._dynamo.config.patch(recompile_limit=1):
        first = fuser.optimize(build("llama"), AOT)
        first(**batch()).loss.backward()
        second = fuser.optimize(build("mistral"), fuser.FuserConfig(inner_compiler="aot_eager", strict=True))
        second(**batch()).loss.backward()  # the wrapper's second class: past the limit, run uncompiled
    compiled, uncompiled = fuser.report(first), fuser.report(second)
    assert compiled.graphs >= 1 and NO_GRAPH_HINT not in str(compiled)
    assert uncompiled.graphs == 0 and uncompiled.counts == {}, (
        "the second model compiled: transformers no longer shares one forward wrapper across model classes, "
        "and NO_GRAPH_HINT's example may be out of date"
    )
    text = str(uncompiled)
    assert NO_GRAPH_HINT in text and "recompile_limit" in text and "torch._dynamo.reset()" in text


def test_report_tells_a_recompile_from_a_graph_break():
    """A batch of another length makes Dynamo compile the model again (with dynamic shapes, as in a Trainer whose
    batches vary in length): that is a recompile, not a graph break, and the report says so, with Dynamo's reason;
    a real graph break inside the same code is still counted once, recompiled or not."""
    torch._dynamo.reset()
    model = build("llama")
    compiled = fuser.optimize(model, AOT)
    for seq in (16, 24, 32):
        compiled(**batch(seq=seq))
    report = fuser.report(compiled)
    assert (report.graphs, report.recompiles, report.graph_breaks) == (2, 1, 0), str(report)
    assert str(report).startswith("fuser: 2 graph(s), 0 graph break(s), 1 recompile(s)"), str(report)
    # Dynamo's reason: the guard on the first length that the second failed
    (reason,) = report.recompile_reasons
    assert "input_ids" in reason and "size mismatch at index 1. expected 16, actual 24" in reason, reason
    assert f"recompiled: {reason}" in str(report).splitlines()[1], str(report)

    class Split(torch.nn.Module):
        def forward(self, x):
            y = x * 2
            torch._dynamo.graph_break()
            return y + 1

    torch._dynamo.reset()
    split = fuser.optimize(Split(), {"inner_compiler": "aot_eager", "strict": True})  # a backend of its own
    for n in (3, 5, 7):
        split(torch.randn(n))
    report = fuser.report(split)
    assert (report.graphs, report.recompiles, report.graph_breaks) == (4, 2, 1), str(report)
    assert len(report.breaks) == 1, str(report)  # the recompiled frame's break is not listed twice


class _Relu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x).relu()


def _relu_elsewhere(x):
    return x.relu()


def test_dynamo_giving_up_on_a_models_code_is_said_once_with_the_cause():
    """Past ``recompile_limit`` Dynamo runs the code eagerly from then on, which only its log says: fuser warns,
    once for the backend, naming the limit, the function and what to do, and records the cause on the backend
    (``FuserCallback`` reads it). The same limit hit by a compile that is not fuser's says nothing."""
    import warnings

    config = fuser.FuserConfig(inner_compiler="eager")
    model = _Relu()
    compiled = fuser.optimize(model, config)
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (2, 3, 4, 5):  # from the second size on Dynamo would compile again: past the limit of 1
            x = torch.randn(rows, 8)
            torch.testing.assert_close(compiled(x), model(x))
        other = torch.compile(_relu_elsewhere, backend="eager")
        with fuser._compat.dynamo_give_ups() as elsewhere:
            for rows in (2, 3):
                other(torch.randn(rows, 8))
        assert [one.cause for one in elsewhere] == ["recompile_limit"]  # Dynamo gave up there too, unwatched
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "fuser" in str(w.message)]
    assert len(said) == 1, said
    (message,) = said
    assert "recompile_limit" in message and "'forward'" in message and "test_backend.py" in message, message
    assert "raise torch._dynamo.config.recompile_limit" in message and "torch._dynamo.reset()" in message, message
    assert list(fuser.backend(config).gave_up) == ["recompile_limit"]


def test_a_compile_error_dynamo_suppressed_is_said_with_the_error(monkeypatch):
    """With ``torch._dynamo.config.suppress_errors`` Dynamo swallows a failed compile and runs the code eagerly:
    fuser says so, with the error."""
    import warnings

    def fail(self, gm, example_inputs):
        raise RuntimeError("inner compiler broke")

    monkeypatch.setattr(fuser.dynamo_backend.FuserBackend, "compile_inner", fail)
    model = _Relu()
    x = torch.randn(2, 8)
    with torch._dynamo.config.patch(suppress_errors=True), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(fuser.optimize(model, {"inner_compiler": "eager"})(x), model(x))
    said = [str(w.message) for w in caught if "Dynamo runs it eagerly" in str(w.message)]
    assert len(said) == 1 and "inner compiler broke" in said[0] and "suppress_errors" in said[0], said


def _masked_scatter_then_norm(x, weight, mask, values):
    h = x * 2
    h[mask] = values  # nonzero of the mask in the backward: an output shape fake tensors cannot know
    hf = h.float()
    return (weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)).sin().sum()


@pytest.mark.parametrize("strict", [True, False])
def test_an_op_fake_tensors_cannot_trace_is_dynamos_graph_break_not_a_fuser_failure(strict):
    """A captured graph that AOT autograd cannot trace with fake tensors (a boolean-mask scatter, whose backward
    needs ``nonzero``) fails with any backend; Dynamo then breaks the graph there. fuser lets it: no FuserError under
    strict, no "rewritten graph failed" warning, the graph's fused blocks not counted, the gradients eager's.
    (Seen in kosmos-2 and Qwen3-VL, which scatter image features into the text embeddings by a mask.)"""
    torch.manual_seed(0)
    x, weight = torch.randn(2, 5, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    mask = torch.rand(2, 5) > 0.5
    values = torch.randn(int(mask.sum()), 16, requires_grad=True)
    want = torch.autograd.grad(_masked_scatter_then_norm(x, weight, mask, values), (x, weight, values))
    config = fuser.FuserConfig(strict=strict, inner_compiler="aot_eager")
    backend = fuser.backend(config)
    compiled = torch.compile(_masked_scatter_then_norm, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.autograd.grad(compiled(x, weight, mask, values), (x, weight, values))
    assert not [w for w in caught if "fuser" in str(w.message)], [str(w.message) for w in caught]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    assert backend.results == [] and backend.counts == {}  # Dynamo ran the frame without that graph
