"""``str(fuser.explain(...))``: each match and each near-miss names its module and source line, and a near-miss
says why in words (no FX node dumps)."""

from __future__ import annotations

import re

import torch

import fuser
import fuser.dynamo_backend
from fuser import _compat
from tests.models.tiny import N_LAYERS, batch, build

LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
NORM_MODULES = [f"model.layers.{i}.{n}" for i in range(N_LAYERS) for n in LAYER_NORMS] + ["model.norm"]


def _assert_plain_words(text: str) -> None:
    assert not re.search(r"%\w+ :|call_function\[|call_method\[|num_users=", text), text


def test_loss_match_names_the_lm_head_module():
    report = fuser.explain(build("llama"), **batch())
    (loss,) = [m for m in report.matches if m.pattern == "linear_cross_entropy"]
    assert loss.module == "lm_head"
    (row,) = [line for line in str(report).splitlines() if line.startswith("linear_cross_entropy")]
    assert " lm_head " in row and "loss_utils.py" in row, row


def test_rope_match_names_the_attention_module():
    """The module of a rotary match is the model's attention layer, also where transformers (>= 5.25, with the
    ``kernels`` package) calls apply_rotary_pos_emb as a module-level module of its own."""
    report = fuser.explain(build("llama"), **batch())
    ropes = [m for m in report.matches if m.pattern == "rope"]
    assert sorted(m.module for m in ropes) == [f"model.layers.{i}.self_attn" for i in range(N_LAYERS)], str(report)
    assert "G." not in str(report) and "__import_" not in str(report), str(report)


def test_norm_declined_by_a_check_names_module_source_and_reason():
    report = fuser.explain(build("llama", torch.float64), **batch())  # fp64: every norm is declined by dtype
    norms = [nm for nm in report.near_misses if nm.pattern == "rms_norm"]
    assert {nm.module for nm in norms} == set(NORM_MODULES), str(report)
    assert all("modeling_llama.py:" in nm.where and "torch.float64" in nm.reason for nm in norms), str(report)
    lines = str(report).splitlines()
    for module in NORM_MODULES:
        rows = [i for i, line in enumerate(lines) if line.split()[:2] == ["rms_norm", module]]
        assert rows, f"{module} has no declined row"
        for i in rows:  # the row names the source line, the next line says why
            assert "modeling_llama.py:" in lines[i] and "torch.float64" in lines[i + 1], lines[i : i + 2]
    _assert_plain_words(str(report))


def test_norm_no_form_covers_names_module_source_and_what_differs():
    """An eps that is a tensor (not a number): no RMSNorm form matches around the rsqrt; the reason names the form
    that came closest and what the code has where it needs eps."""
    model = build("llama")
    for name, module in model.named_modules():
        if name in NORM_MODULES:
            module.variance_epsilon = torch.tensor(1e-6)
    report = fuser.explain(model, **batch())
    assert "rms_norm" not in report.counts, str(report)
    norms = [nm for nm in report.near_misses if nm.pattern == "rms_norm"]
    assert sorted(nm.module for nm in norms) == sorted(NORM_MODULES), str(report)  # one for each norm
    for nm in norms:
        assert "modeling_llama.py:" in nm.where and "rsqrt" in nm.where, nm.where
        assert "needs a number (eps)" in nm.reason and "0-d float32 tensor" in nm.reason, nm.reason
    text = str(report)
    assert "model.layers.0.input_layernorm" in text and "needs a number (eps)" in text
    _assert_plain_words(text)


def test_a_graph_break_is_listed_with_its_source_line_and_dynamos_words():
    def split(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    report = fuser.explain(split, torch.randn(3))
    assert report.graphs == 2 and len(report.breaks) == 1, str(report)
    (one,) = report.breaks
    assert "test_explain_report.py:" in one.where and "torch._dynamo.graph_break()" in one.where, one.where
    assert one.reason and report.break_messages, str(report)
    text = str(report)
    assert "graph breaks" in text and "torch._dynamo.graph_break()" in text
    _assert_plain_words(text)


class _Norm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj = _Norm(), torch.nn.Linear(8, 8)

    def forward(self, x):
        x = self.proj(self.norm(x))
        torch._dynamo.graph_break()  # as data-dependent MoE routing breaks JetMoE's layers
        return x + 1


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer() for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_graph_run_for_several_layers_counts_each_run_in_executed():
    """A break inside the layers' loop: Dynamo compiles a layer's code once and runs that graph for the next layer
    too. ``counts`` counts fused ops per graph; ``executed`` per run, as the forward ran them. (Each norm feeds
    only its projection: ``rms_norm_linear``.)"""
    report = fuser.explain(_Stack(), torch.randn(2, 8))
    assert report.counts["rms_norm_linear"] < 3, str(report)  # fewer graphs than layers
    assert report.executed == {"rms_norm_linear": 3}, str(report)
    assert len(report.runs) == len(report.matches) and sum(report.runs) == 3
    assert "run in the forward: rms_norm_linear=3" in str(report)


EAGER = fuser.FuserConfig(inner_compiler="eager")


def _step(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, int]]:
    """The loss of one forward+backward of ``model`` through ``fuser.optimize`` and what fused in it."""
    loss = fuser.optimize(model, EAGER)(**batch()).loss
    loss.backward()
    return loss.detach(), fuser.report(model).counts


def test_explain_leaves_nothing_compiled_that_a_later_optimize_runs_into():
    """Each explain's capture used to stay in Dynamo's cache on the model's code (transformers' forward wrapper,
    one code object for every model of the class), under a backend of its own, and counted toward
    ``recompile_limit``: after as many explains as the limit, a fresh model of the class given to fuser.optimize
    ran eagerly, fusing nothing and saying nothing. Now explain leaves no cache entry, and the fresh model compiles
    and fuses as one that no explain preceded, with eager's loss."""
    expected = _step(build("llama"))[1]
    assert expected, "nothing fused even without explain"
    torch._dynamo.reset()  # the baseline's own entries must not count toward the limit below
    fuser.dynamo_backend._BACKENDS.clear()  # nor its graphs toward the counts

    model = build("llama")
    limit = 2  # as many explains as the limit (8 by default) ran into it; 2 of 2 do the same in a quarter the time
    with torch._dynamo.config.patch(recompile_limit=limit):
        for _ in range(limit):
            report = fuser.explain(model, **batch())
            assert report.counts == expected, str(report)
        left = _compat.live_cache_entries()  # on any code object Dynamo ran
        loss, counts = _step(build("llama"))
    assert counts == expected
    assert left == {}, "explain left compiled entries"
    assert fuser.report().recompiles == 0  # its first graphs are first compiles, not explain's again
    torch.testing.assert_close(loss, build("llama")(**batch()).loss)


class _Scale(torch.nn.Module):
    def forward(self, x):
        return x * 2 + 1


def test_explain_after_optimize_removes_only_its_own_entries():
    """On code that a compiled model shares, explain takes its own entries away and leaves the model's: the model
    runs on without compiling again."""
    model = _Scale()
    compiled = fuser.optimize(model, EAGER)
    compiled(torch.randn(3, 4))
    before = _compat.live_cache_entries()
    assert before
    for rows in (3, 5):
        fuser.explain(model, torch.randn(rows, 4))
    assert _compat.live_cache_entries() == before
    graphs = fuser.report(model).graphs
    compiled(torch.randn(3, 4))
    assert fuser.report(model).graphs == graphs


def _double(x):
    return x * 2


def test_explain_leaves_no_shapes_that_make_the_next_compile_dynamic():
    """Dynamo records the sizes each code ran with, and compiles a code dynamic from its first graph where the
    record holds other sizes (automatic dynamic shapes): explain's sizes are not left in the record."""
    fuser.explain(_double, torch.randn(3))
    inputs = []

    def record(gm, example_inputs):
        inputs.extend(example_inputs)
        return gm.forward

    torch.compile(_double, backend=record)(torch.randn(4))
    assert inputs and all(isinstance(x, torch.Tensor) and x.shape == (4,) for x in inputs), inputs
