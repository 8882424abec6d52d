"""``str(fuser.explain(...))``: each match and each near-miss names its module and source line, and a near-miss
says why in words (no FX node dumps)."""

from __future__ import annotations

import dataclasses
import re

import torch

import fuser
import fuser.dynamo_backend
from fuser import _compat
from tests.models.tiny import N_LAYERS, batch, build, with_lora

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


# --- declines of patterns that could not apply to the model: listed only with verbose=True ---------------------

NOT_FOR_FP32 = ("lora_sum", "upcast_linear")  # for fp32 adapters on a half-precision base, and inputs made fp32


def _decline_rows(text: str, pattern: str) -> list[str]:
    """The rows of ``str(report)``'s declined section (indented, unlike the matches) that name ``pattern``."""
    return [line for line in text.splitlines() if line.startswith("  ") and line.split()[:1] == [pattern]]


def test_fp32_llama_without_lora_lists_the_missed_fusions_and_no_lora_declines():
    """The default rendering of a plain fp32 model: what fused, and the decline that matters (the final norm, which
    the logits' slice also reads, is not fused with the lm_head), in the user's code, not graph node names; no
    decline of a LoRA or upcast pattern, which has nothing to do in such a model."""
    report = fuser.explain(build("llama"), **batch())
    text = str(report)
    for pattern in NOT_FOR_FP32:
        assert not _decline_rows(text, pattern), text
        assert all(not nm.applicable for nm in report.near_misses if nm.pattern == pattern), text
    (norm,) = [nm for nm in report.near_misses if nm.pattern == "rms_norm_linear"]
    assert norm.applicable and norm.module == "model.norm", norm
    assert "logits_to_keep" in norm.reason and "modeling_utils.py:" in norm.reason, norm.reason
    assert "hidden_states_" not in norm.reason and "getitem" not in norm.reason, norm.reason
    rows = _decline_rows(text, "rms_norm_linear")
    assert len(rows) == 1 and " model.norm " in rows[0], text
    assert norm.reason in text, text
    _assert_plain_words(text)


def test_fp32_llama_with_lora_lists_lora_sum_declines_only_when_verbose():
    """peft's adapters on an fp32 Llama: every LoRA sum declines, as lora_sum fuses adapters on a bf16/fp16 base.
    Nothing was missed: the report counts them by default and lists each with verbose=True."""
    report = fuser.explain(with_lora(build("llama")), **batch())
    sums = [nm for nm in report.near_misses if nm.pattern == "lora_sum"]
    assert len(sums) == 7 * N_LAYERS, str(report)  # q, k, v, o, gate, up, down
    assert all(not nm.applicable and "torch.float32, not bf16/fp16" in nm.reason for nm in sums), str(report)
    text = str(report)
    assert not _decline_rows(text, "lora_sum") and "lora_sum" not in text, text
    assert f"not listed: {len(sums)} decline(s) of patterns that do not apply" in text, text
    assert "rms_norm_linear" in text, text  # the final norm's decline is still there
    verbose = str(dataclasses.replace(report, verbose=True))
    assert len(_decline_rows(verbose, "lora_sum")) == len(sums), verbose
    assert verbose.count("does not apply to this model: the base layer's output is torch.float32") == len(sums)
    assert "not listed" not in verbose


def test_fp32_gemma_upcast_declines_say_the_input_is_fp32_and_only_when_verbose():
    """Gemma's norm returns ``output.type_as(x)``: in an fp32 model a cast to fp32 that q/k/v (gate/up) each read.
    upcast_linear matches each ``linear(cast, W)``; its input is fp32 already, so the pattern has nothing to do:
    that is the reason given (not the cast's other readers), and the decline is listed only with verbose=True."""
    report = fuser.explain(build("gemma"), **batch(), verbose=True)
    assert report.verbose
    upcasts = [nm for nm in report.near_misses if nm.pattern == "upcast_linear"]
    assert len(upcasts) == 5 * N_LAYERS, str(report)  # q, k, v, gate, up
    assert all(not nm.applicable and "torch.float32 before the cast" in nm.reason for nm in upcasts), str(report)
    assert len(_decline_rows(str(report), "upcast_linear")) == len(upcasts), str(report)
    quiet = str(dataclasses.replace(report, verbose=False))
    assert not _decline_rows(quiet, "upcast_linear") and "upcast_linear" not in quiet, quiet


class _UpcastInput(torch.nn.Module):
    """``linear(h.to(fp32))`` where the cast is also summed: in fp32 the cast changes nothing (upcast_linear does not
    apply); in bf16 it is an upcast whose copy another op reads (a missed fusion)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.proj = torch.nn.Linear(8, 4, bias=False)

    def forward(self, x):
        h = torch.exp(x.to(self.dtype)).to(torch.float32)
        return self.proj(h).sum() + h.sum()


def test_report_lists_declines_that_do_not_apply_only_when_verbose():
    """fuser.report(model) renders as explain does: ``verbose=True`` adds the declines of a pattern that could not
    apply; a decline for a use outside the block names that use's line of code."""
    fp32, bf16 = _UpcastInput(torch.float32), _UpcastInput(torch.bfloat16)
    x = torch.randn(2, 8)
    # a backend of its own for each (one per config): a model's report holds the graphs its backend compiled
    for model, inner in ((fp32, "eager"), (bf16, "aot_eager")):
        fuser.optimize(model, fuser.FuserConfig(patterns=("upcast_linear",), inner_compiler=inner))(x)
    (fp32_miss,) = fuser.report(fp32).near_misses
    assert not fp32_miss.applicable and "torch.float32 before the cast" in fp32_miss.reason, fp32_miss.reason
    assert "upcast_linear" not in str(fuser.report(fp32)), str(fuser.report(fp32))
    verbose = fuser.report(fp32, verbose=True)
    assert verbose.verbose and len(_decline_rows(str(verbose), "upcast_linear")) == 1, str(verbose)
    (bf16_miss,) = fuser.report(bf16).near_misses
    assert bf16_miss.applicable, bf16_miss.reason
    assert "is also used by the code `return self.proj(h).sum() + h.sum()` (tests/test_explain_report.py:" in (
        bf16_miss.reason
    ), bf16_miss.reason
    assert len(_decline_rows(str(fuser.report(bf16)), "upcast_linear")) == 1, str(fuser.report(bf16))


class _BreakInALoop(torch.nn.Module):
    """A norm, then a loop whose body Dynamo cannot trace (a data-dependent slice): Dynamo gives up on the whole
    function and runs it eagerly, so the norm before the loop is not captured either."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.lins = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x, n):
        x = self.norm(x)
        for lin in self.lins:
            x = lin(x)[: int(n.sum().item())]
        return x.sum()


def test_a_function_dynamo_runs_eagerly_is_named_with_why():
    report = fuser.explain(_BreakInALoop(), torch.randn(4, 8), torch.tensor([1, 2]))
    assert "layer_norm" not in report.counts  # nothing in the skipped function was captured
    (skipped,) = report.skipped_frames
    line = _BreakInALoop.forward.__code__.co_firstlineno
    assert skipped.startswith(f"forward (tests/test_explain_report.py:{line}): a graph break inside a loop: "), skipped
    assert "run eagerly (Dynamo gave up on them" in str(report)
