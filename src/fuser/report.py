"""``fuser.explain``: capture a model's graphs, match the patterns, compile nothing."""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fuser import _compat
from fuser.config import FuserConfig
from fuser.engine.canonical import location
from fuser.engine.rewrite import Match, NearMiss, count_by_pattern, find_matches
from fuser.padding_free import PaddingFreeStats
from fuser.patterns import PATTERNS
from fuser.tracing import input_require_grads_ignored, tracing_context

# a recompile's reason where Dynamo recorded none
UNKNOWN_REASON = "Dynamo gave no reason"

# what a report with no captured graph says: the two ways a model ends up running with nothing compiled
NO_GRAPH_HINT = (
    "no graph was captured: the model has not run through fuser yet (its first call compiles), or Dynamo ran its "
    "forward without compiling it. Dynamo logs why, and fuser warns where it gave up in a call of what "
    "optimize/optimize_ compiled; one cause is 'hit config.recompile_limit' after one process compiled many model "
    "classes through the same transformers forward wrapper: torch._dynamo.reset() between models, or a higher "
    "torch._dynamo.config.recompile_limit, avoids it"
)


@dataclass(frozen=True)
class GraphBreak:
    """Where Dynamo ended a captured graph before the function's return, and why (in Dynamo's words)."""

    where: str  # ``file:line  code`` of the user code it stopped at
    reason: str


def graph_break(gm: torch.fx.GraphModule) -> GraphBreak | None:
    """The graph break that ended ``gm``, or ``None`` when ``gm`` ends at a return."""
    found = _compat.graph_break_of(gm)
    if found is None:
        return None
    reason, (path, lineno, code) = found
    first = reason.strip().splitlines()[0] if reason.strip() else "no reason given"
    if first == "step_unsupported":  # Dynamo's word for an inlined call it could not trace, broken at its call site
        first = "Dynamo could not trace the call made here"
    return GraphBreak(location(path, lineno, code), first)


@dataclass
class Report:
    """What fuser would fuse in a model.

    counts:        pattern name → number of fused ops that would be emitted, summed over all captured graphs
                   (recompiled ones too).
    graph_breaks:  number of graph breaks Dynamo took (captured graphs − recompiles − 1).
    recompiles:    ``fuser.report``: graphs Dynamo compiled again for code it had compiled, for new shapes (a
                   Trainer's batches of another length; from the second length on, a graph with dynamic shapes)
                   or guards that failed. Not graph breaks: each repeats an earlier graph's matches.
    recompile_reasons: ``fuser.report``: for each recompile, Dynamo's reason in its words: the guard of the
                   earlier compile that failed, after that compile's id (``"0/0: tensor 'kwargs['input_ids']' size
                   mismatch at index 1. expected 16, actual 24"``: a new sequence length), or
                   :data:`UNKNOWN_REASON` where torch gave none.
    matches:       every accepted match, with its module path (``.module``) and source line (``.where``).
    near_misses:   structural matches that were declined, and anchor ops no variant covered, each with its
                   module path, source line and the reason in words (``.module``, ``.where``, ``.reason``), and
                   whether its pattern could apply to the model at all (``.applicable``). All of them, whatever
                   ``verbose`` is.
    breaks:        each graph break: where the graph before it ended and why (``.where``, ``.reason``); a block
                   split by one (an lm_head and its loss) cannot fuse.
    break_messages: ``fuser.explain``: Dynamo's own graph-break messages during the forward (first lines, each
                   once), which say what it could not trace where ``breaks`` says only "a call made here".
    skipped_frames: ``fuser.explain``: the functions Dynamo gave up on and ran eagerly, so that nothing in them was
                   captured or fused (a graph break inside a loop skips the rest of the function), each as
                   ``"function (file:line): why"``.
    runs:          ``fuser.explain``: for each of ``matches``, how many times its graph ran in the forward. A graph
                   Dynamo compiled once runs again wherever its guards hold: after a graph break inside the loop
                   over the decoder layers, each layer's code is one graph that runs for every layer, and its fused
                   ops with it.
    inlined:       ``fuser.report``: fused op → its calls in compiled GPU graphs that Inductor launches the kernels
                   of itself (``FuserConfig.inline_ops``), over the forward and the backward graphs compiled so far.
    not_inlined:   fused op → why a call of it stayed an op call (the last reason given), in words.
    padding_free:  with ``FuserConfig.padding_free``: the calls run packed, their real and padded token counts, and
                   why the others ran padded (``.packed``, ``.real_tokens``, ``.padded_tokens``, ``.declined``);
                   ``None`` with it off.
    verbose:       what ``str()`` lists of ``near_misses``. False (the default): the missed fusions, code that looked
                   like a block and was not fused; the declines of a pattern that could not apply to the model (no
                   LoRA adapter on a half-precision base for ``lora_sum``, an input already fp32 for
                   ``upcast_linear``: ``.applicable`` False) are only counted. True: every decline.
    """

    counts: dict[str, int] = field(default_factory=dict)
    graphs: int = 0
    recompiles: int = 0
    recompile_reasons: list[str] = field(default_factory=list)
    matches: list[Match] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)
    compile_seconds: float = 0.0  # fuser.report(): time spent rewriting and compiling those graphs
    breaks: list[GraphBreak] = field(default_factory=list)
    break_messages: list[str] = field(default_factory=list)
    skipped_frames: list[str] = field(default_factory=list)
    runs: list[int] = field(default_factory=list)
    inlined: dict[str, int] = field(default_factory=dict)
    not_inlined: dict[str, str] = field(default_factory=dict)
    padding_free: PaddingFreeStats | None = None
    verbose: bool = False

    @property
    def graph_breaks(self) -> int:
        """Graph breaks Dynamo took: the captured graphs less the recompiled ones, less the first."""
        return max(self.graphs - self.recompiles - 1, 0)

    @property
    def executed(self) -> dict[str, int]:
        """Pattern name → fused ops the forward ran: ``counts`` with each match counted once per run of its graph
        (``counts`` itself where the runs were not recorded: a report of compiled graphs, ``fuser.report``)."""
        if len(self.runs) != len(self.matches):
            return dict(self.counts)
        out: dict[str, int] = {}
        for match, runs in zip(self.matches, self.runs, strict=True):
            for name in (match.pattern, *match.replacement.emits_also):
                out[name] = out.get(name, 0) + runs
        return out

    def __str__(self) -> str:
        lines = [f"fuser: {self.graphs} graph(s), {self.graph_breaks} graph break(s)"]
        if self.recompiles:
            lines[0] += (
                f", {self.recompiles} recompile(s) (code compiled again for new shapes or guards; its fused ops are "
                "counted again)"
            )
        for reason, n in Counter(self.recompile_reasons).items():
            lines.append(f"recompiled{f' {n}x' if n > 1 else ''}: {reason}")
        width = max([len(m.module) for m in self.matches] + [6])
        names = max([len(m.pattern) for m in self.matches] + [16])
        lines.append(f"{'pattern':<{names}} {'variant':<12} {'module':<{width}}  source")
        for m in self.matches:
            lines.append(f"{m.pattern:<{names}} {m.variant:<12} {m.module:<{width}}  {m.where}")
        if not self.matches:
            lines.append("(nothing matched)")
        if not self.graphs:
            lines.append(NO_GRAPH_HINT)
        lines.append("counts: " + (", ".join(f"{k}={v}" for k, v in sorted(self.counts.items())) or "none"))
        if self.runs and self.executed != self.counts:
            ran = ", ".join(f"{k}={v}" for k, v in sorted(self.executed.items()))
            lines.append(f"run in the forward: {ran} (a graph compiled once ran again, e.g. for each decoder layer)")
        shown = [nm for nm in self.near_misses if self.verbose or nm.applicable]
        if shown:
            lines.append("declined (not fused, and why):")
            for nm in shown:
                module = nm.module or "(top level)"
                lines.append(f"  {nm.pattern:<20} {module}  {nm.where}")
                why = nm.reason if nm.applicable else f"does not apply to this model: {nm.reason}"
                lines.append(f"  {'':<20} {why}")
        hidden = len(self.near_misses) - len(shown)
        if hidden:
            lines.append(
                f"not listed: {hidden} decline(s) of patterns that do not apply to this model (what they fuse is "
                "not in it, or not in this dtype or setting); verbose=True lists them"
            )
        if self.breaks:
            lines.append("graph breaks (each ends a captured graph; a block split by one is not fused):")
            for one in self.breaks:
                lines.append(f"  {one.where}")
                lines.append(f"  {'':<20} {one.reason}")
        if self.break_messages:
            lines.append("Dynamo's graph-break messages: " + "; ".join(self.break_messages))
        if self.skipped_frames:
            lines.append("run eagerly (Dynamo gave up on them: nothing in them is captured or fused): "
                         + "; ".join(self.skipped_frames))  # fmt: skip
        if self.inlined or self.not_inlined:
            done = ", ".join(f"{k}={v}" for k, v in sorted(self.inlined.items())) or "none"
            lines.append(f"inlined calls (FuserConfig.inline_ops: Inductor launches their kernels): {done}")
            by_reason: dict[str, list[str]] = {}
            for op, why in sorted(self.not_inlined.items()):
                by_reason.setdefault(why, []).append(op)
            for why, ops in by_reason.items():  # one line per reason: on CPU every op gives the same one
                lines.append(f"  not inlined: {', '.join(ops)}: {why}")
        if self.padding_free is not None:
            lines.append(str(self.padding_free))
        return "\n".join(lines)


# the capture of the explain call running in this thread (or task), which _capture_backend hands each graph to
_CAPTURE: contextvars.ContextVar[Callable[[torch.fx.GraphModule, Any], Any] | None] = contextvars.ContextVar(
    "fuser_explain_capture", default=None
)


def _capture_backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    """explain's Dynamo backend: one function for every call, so that no call leaves a backend of its own in
    Dynamo's process-wide list of the backends it was given (each would keep its call's graphs alive), and so that
    the cache entries explain compiled are found by it and removed (``_compat.compiled_leaving_no_trace``)."""
    capture = _CAPTURE.get()
    return capture(gm, example_inputs) if capture is not None else gm.forward


def explain(model: Any, *args: Any, config: FuserConfig | None = None, verbose: bool = False, **kwargs: Any) -> Report:
    """Run one forward of ``model(*args, **kwargs)`` under Dynamo (executed eagerly) and match every graph.

    ``str()`` of the report lists what would fuse and the declines that matter: code that looked like a block and
    was not fused, with why. A pattern that could not apply to the model (``lora_sum`` in a model without LoRA
    adapters on a half-precision base, ``upcast_linear`` where inputs are fp32 already) declines too; such declines
    are listed only with ``verbose=True`` (:attr:`Report.verbose`), and are in ``.near_misses`` either way.

    Nothing of the run stays compiled: the cache entries it made on the model's code (shared with every model of
    its class, and counted toward ``torch._dynamo.config.recompile_limit``) are removed afterwards, so a later
    ``fuser.optimize`` of the same class compiles as if explain had not run.

    It traces as :func:`fuser.optimize` does: with ``config.ignore_logging`` (default) the logging calls that print
    at most once do not break the graph (``src/fuser/tracing.py``).
    """
    config = config or FuserConfig()
    patterns = [p for name, p in PATTERNS.items() if config.enabled(name)]
    target = getattr(model, "_orig_mod", model)  # what fuser.optimize / torch.compile wrapped
    report = Report(verbose=verbose)
    graph_runs: list[int] = []  # per captured graph, the times it ran
    graph_of_match: list[int] = []  # per match, its graph's index

    def capture(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        result = find_matches(gm, patterns, config)
        index = report.graphs
        report.graphs += 1
        graph_runs.append(0)
        report.matches += result.matches
        graph_of_match.extend([index] * len(result.matches))
        report.near_misses += result.near_misses
        if (one := graph_break(gm)) is not None:
            report.breaks.append(one)

        def run(*inputs: Any) -> Any:
            graph_runs[index] += 1
            return gm.forward(*inputs)

        return run

    messages_before = _compat.dynamo_graph_break_messages()
    token = _CAPTURE.set(capture)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(tracing_context(config))
            if config.ignore_input_require_grads:
                stack.enter_context(input_require_grads_ignored(target))
            compiled = stack.enter_context(_compat.compiled_leaving_no_trace(target, _capture_backend))
            compiled(*args, **kwargs)
    finally:
        _CAPTURE.reset(token)
    for message in _compat.dynamo_messages_since(messages_before):
        first = brief_dynamo_message(message)
        if "skip_fwd_side_effects_in_bwd_under_checkpoint" in message and first:
            first += "; FuserConfig(checkpoint_side_effects=True), the default, has Dynamo trace such a layer"
        if first and first not in report.break_messages:
            report.break_messages.append(first)
        for frame in _compat.dynamo_skipped_frames(message):
            if (text := skipped_frame_text(frame, message)) not in report.skipped_frames:
                report.skipped_frames.append(text)
    report.counts = count_by_pattern(report.matches)
    report.runs = [graph_runs[i] for i in graph_of_match]
    return report


def skipped_frame_text(frame: tuple[str, str, int], message: str) -> str:
    """``"function (file:line): why"`` for a frame Dynamo skipped (``_compat.dynamo_skipped_frames``); the rest of a
    function after an earlier graph break (Dynamo's ``torch_dynamo_resume_in_forward_at_431``) reads "forward, from
    line 431"."""
    function, path, line = frame
    resumed = re.fullmatch(r"torch_dynamo_resume_in_(\w+)_at_(\d+)", function)
    name = f"{resumed[1]}, from line {resumed[2]}" if resumed else function
    why = brief_dynamo_message(message)
    if "graph break in loop" in message:  # the break's own cause, inside a loop: Dynamo skips the rest
        why = f"a graph break inside a loop: {why}"
    return f"{name} ({location(path, line, '').strip()}): {why}"


def brief_dynamo_message(message: str) -> str:
    """A Dynamo graph-break message's first line, with its ``Explanation:`` line where it has one (its first line
    alone can be a bare category, "HOP: Unsafe side effect")."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    explanation = next((line for line in lines[1:] if line.startswith("Explanation:")), None)
    return f"{lines[0]} ({explanation.removeprefix('Explanation:').strip()})" if explanation else lines[0]
