"""The Dynamo backend: rewrite the captured graph, then hand it to the inner compiler."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx

from fuser import _compat, padding_free, zero3
from fuser.config import FuserConfig
from fuser.engine.protocol import post_grad_passes
from fuser.engine.rewrite import RewriteResult, count_by_pattern, rewrite
from fuser.inductor import direct_calls, graph_pool_grads, inline_ops
from fuser.padding_free import PaddingFreeStats
from fuser.patterns import PATTERNS
from fuser.patterns.linear_cross_entropy import LOGITS_FROM_BEFORE_THE_GRAPH
from fuser.report import UNKNOWN_REASON, GraphBreak, Report, graph_break
from fuser.tracing import input_require_grads_ignored, tracing_context

log = logging.getLogger("fuser")


class FuserError(RuntimeError):
    """A rewrite failed under ``FuserConfig(strict=True)``."""


def _source_digest() -> str:
    """A hash of fuser's own source: a changed pattern or kernel must never reuse a stale compiled graph."""
    digest = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


_SOURCE_DIGEST = _source_digest()


def _post_grad_pass(config: FuserConfig, counts: dict[str, int], inliner: inline_ops.Inliner | None = None) -> Any:
    """fuser's post-grad pass: the post-grad passes the registered patterns declare (``Pattern.post_grad``: the
    gated MLP's backward in place), each where it is enabled for ``config``; then, with ``config.inline_ops``, the
    fused ops' calls that can be replaced by their kernels, launched by Inductor (:mod:`fuser.inductor.inline_ops`,
    through ``inliner``); then, with ``config.experimental.direct_calls``, the remaining calls retargeted to their
    direct overloads (:mod:`fuser.inductor.direct_calls`); then the user's own post-grad pass, if any. The numbers of
    calls the blocks' passes rewrote are added to ``counts``.

    Inductor folds ``CustomGraphPass.uuid()`` of its custom passes into the FX-graph and AOT-autograd cache
    keys: fuser's source and the whole config (its repr, nested options included: every switch there is) are in
    it, and the user's pass keeps its uuid in the key.
    """
    base = _compat.custom_graph_pass_base()
    previous = _compat.current_post_grad_custom_post_pass()

    class FuserPostGrad(base):
        def __call__(self, graph: torch.fx.Graph) -> None:
            for one in post_grad_passes(PATTERNS.values()):
                if not one.enabled(config):
                    continue
                name = one.name
                try:
                    plan = one.plan(graph)
                except Exception as error:
                    # a backward graph compiles at the first backward call, outside the rewrite's fallback: a
                    # failing analysis leaves the graph as Inductor gave it (it has not been touched)
                    if config.strict:
                        raise FuserError(f"fuser: the post-grad pass {name} failed: {error!r}") from error
                    warnings.warn(
                        f"fuser: the post-grad pass {name} failed ({error!r}); that graph keeps its out-of-place "
                        "ops. Set FuserConfig(strict=True) to raise, and please report this.",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    continue
                counts[name] = counts.get(name, 0) + one.apply(graph, plan)
            if config.inline_ops and inliner is not None:
                inliner.inline(graph)
            if config.experimental.direct_calls:
                direct_calls.retarget(graph)
            if previous is not None:
                previous(graph)

        def uuid(self) -> Any:
            prev = previous.uuid() if previous is not None and hasattr(previous, "uuid") else None
            return ("fuser", _SOURCE_DIGEST, repr(config), prev)

    return FuserPostGrad()


def _empty_for_dropped_outputs(gm: torch.fx.GraphModule, new_gm: torch.fx.GraphModule) -> None:
    """Where the rewrite made ``new_gm`` return ``None`` for a tensor ``gm`` returned (the logits the fused loss
    never computes), return a 0-element tensor of its dtype and device instead.

    For a DDP bucket's piece (``_compat.compiling_a_ddp_bucket``) AOT autograd reads ``meta["val"]`` of every
    forward output, and a ``None`` output fails there (``AttributeError: 'NoneType' object has no attribute
    'meta'`` in ``FakifiedOutWrapper.pre_compile``); DESIGN.md's fallback, an empty tensor, compiles.
    """
    old_out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    new_out = next(n for n in reversed(new_gm.graph.nodes) if n.op == "output")
    old_values, new_values = old_out.args[0], new_out.args[0]
    if not isinstance(new_values, (tuple, list)) or len(old_values) != len(new_values):
        return
    values = list(new_values)
    for i, (old, new) in enumerate(zip(old_values, new_values, strict=True)):
        example = old.meta.get("example_value", old.meta.get("val")) if isinstance(old, torch.fx.Node) else None
        if new is None and isinstance(example, torch.Tensor):
            with new_gm.graph.inserting_before(new_out):
                values[i] = new_gm.graph.call_function(
                    torch.empty, ((0,),), {"dtype": example.dtype, "device": example.device}
                )
    new_out.args = (type(new_values)(values),)
    new_gm.recompile()


class FuserBackend:
    """``backend(gm, example_inputs)`` as Dynamo calls it; one instance per config (see :func:`backend`)."""

    def __init__(self, config: FuserConfig) -> None:
        self.config = config
        self.patterns = [p for name, p in PATTERNS.items() if config.enabled(name)]
        self.results: list[RewriteResult] = []  # one per graph compiled through this backend, in order
        # what fuser's post-grad pass changed in the graphs Inductor compiled (forward and backward), e.g.
        # {"gated_backward_in_place": 32}; filled as Inductor compiles them (a backward graph maybe only at the
        # first backward call), and not when a graph comes from Inductor's cache
        self.post_grad_counts: dict[str, int] = {}
        self.inliner = inline_ops.Inliner()  # which fused-op calls Inductor launches itself (config.inline_ops)
        self.compile_seconds = 0.0  # rewrite + inner compile of every graph so far (backward graphs compile later)
        self.breaks: list[GraphBreak] = []  # where each graph it compiled ended at a graph break, and why
        self._warned: set[str] = set()  # the once-per-backend warnings already given (_warn_once's keys)
        # cause → what happened, for each way Dynamo gave up on code of a model compiled through this backend and
        # ran it eagerly (_compat.DynamoGaveUp's causes), the first time for each; seen in the calls that optimize
        # and optimize_ scope, not where torch.compile is given this backend directly
        self.gave_up: dict[str, str] = {}
        # what FuserConfig.padding_free did in the calls of the models optimize / optimize_ compiled through it
        self.padding_free = PaddingFreeStats()
        self.padding_free_wrapped = False  # some model's calls go through padding_free (optimize / optimize_)

    @property
    def counts(self) -> dict[str, int]:
        """Fused ops emitted so far, summed over every graph this backend compiled (graph breaks included)."""
        return count_by_pattern(m for result in self.results for m in result.matches)

    @property
    def last_result(self) -> RewriteResult | None:
        return self.results[-1] if self.results else None

    def __repr__(self) -> str:
        return f"FuserBackend({self.config!r})"

    def rewrite(self, gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, RewriteResult | None]:
        """The rewritten copy of ``gm``; on failure ``gm`` itself with a warning (or FuserError under strict)."""
        try:
            new_gm, result = rewrite(gm, self.patterns, self.config)
        except Exception as error:
            if self.config.strict:
                raise FuserError(f"fuser: the rewrite failed: {error!r}") from error
            warnings.warn(
                f"fuser: the rewrite failed ({error!r}); compiling the unrewritten graph instead. "
                "Set FuserConfig(strict=True) to raise, and please report this.",
                RuntimeWarning,
                stacklevel=2,
            )
            return gm, None
        return new_gm, result

    def compile_inner(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if self.config.inner_compiler == "eager":
            return gm.forward
        if self.config.inner_compiler == "aot_eager":
            return _compat.lookup_dynamo_backend("aot_eager")(gm, example_inputs)
        post_grad = _post_grad_pass(self.config, self.post_grad_counts, self.inliner)
        direct_calls.register()  # before Inductor gives fuser's ops (these overloads among them) their fallbacks
        if self.config.inline_ops:
            _compat.memoize_kernel_analysis()  # Inductor analyses every inlined launch: once per kernel signature
        patches: dict[str, Any] = {"post_grad_custom_post_pass": post_grad}
        if not self.config.cuda_graphs:
            return _compat.inductor_compile(gm, example_inputs, config_patches=patches)
        patches["triton.cudagraphs"] = True
        skips = _compat.cudagraph_skips()
        # a replay writes the pool memory autograd may have kept as a parameter's .grad: moved out before it
        compiled = graph_pool_grads.keeping_grads_out_of_pool(
            _compat.inductor_compile(gm, example_inputs, config_patches=patches)
        )
        if _compat.cudagraph_skips() > skips:
            # cuda_graphs is on and Inductor declined to record a graph it compiled
            self._warn_once(
                "cudagraph_skip",
                "fuser: FuserConfig(cuda_graphs=True), but Inductor will not record one of this model's compiled "
                "graphs as a CUDA graph (e.g. it has CPU tensors, or an input is mutated in place); that graph "
                "launches its kernels one by one as without cuda_graphs. Run with TORCH_LOGS=cudagraphs to see "
                "Inductor's reason.",
            )
        return compiled

    def _warn_once(self, key: str, message: str) -> None:
        """``message`` as a RuntimeWarning, once per backend for each ``key``."""
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)  # the line that called _warn_once's caller

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        if self.config.padding_free and not self.padding_free_wrapped:
            self._warn_once(
                "padding_free_backend",
                "fuser: FuserConfig.padding_free packs a model's batches in the calls of what fuser.optimize or "
                "fuser.optimize_ compiled; torch.compile(backend='fuser') gives the backend graphs, not batches, so "
                "this model runs padded. Use fuser.optimize / fuser.optimize_ instead.",
            )
        start = time.perf_counter()
        index = len(self.results) + 1
        log.info("fuser: compiling graph %d (%d nodes)...", index, len(gm.graph.nodes))
        new_gm, result = self.rewrite(gm)
        if _compat.compiling_a_ddp_bucket():
            self._warn_ddp_buckets()
            if new_gm is not gm:
                _empty_for_dropped_outputs(gm, new_gm)
        recompiling = _compat.dynamo_recompiling()
        if result is not None and any(
            near.pattern == "linear_cross_entropy" and near.reason.startswith(LOGITS_FROM_BEFORE_THE_GRAPH)
            for near in result.near_misses
        ):
            self._warn_loss_after_a_break()
        if result is not None:
            result.recompile = recompiling
            result.recompile_reason = _compat.dynamo_recompile_reason() if recompiling else None
            self.results.append(result)
        compiled = self._compile(gm, new_gm, example_inputs, result)
        # after the compile: a restarted analysis brings gm again; a recompile's break is one already listed
        if not recompiling and (one := graph_break(gm)) is not None:
            self.breaks.append(one)
        seconds = time.perf_counter() - start
        self.compile_seconds += seconds
        fused = ", ".join(f"{k}={v}" for k, v in sorted(result.counts.items())) if result else ""
        why = f" (a recompile: {result.recompile_reason or UNKNOWN_REASON})" if result and result.recompile else ""
        log.info(
            "fuser: graph %d compiled in %.1f s (%s): fused %s%s",
            index,
            seconds,
            self.config.inner_compiler,
            fused or "nothing",
            why,
        )
        return compiled

    def _compile(
        self,
        gm: torch.fx.GraphModule,
        new_gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        result: RewriteResult | None,
    ) -> Callable:
        if new_gm is gm:
            return self.compile_inner(gm, example_inputs)
        try:
            return self.compile_inner(new_gm, example_inputs)
        except _compat.dynamo_restart_analysis():
            # Dynamo traces the frame again (a float it made symbolic gets specialised): not a failure, and this
            # graph never runs; the traced-again graph comes through this backend once more
            if result is not None and result in self.results:
                self.results.remove(result)
            raise
        except Exception as error:
            unrewritten = None
            if isinstance(error, _compat.dynamo_fallback_exceptions()):
                # an op fake tensors cannot trace (nonzero of a boolean mask, .item()): Dynamo breaks the graph there
                # and sends the pieces, as it does for any backend. The captured graph failing the same way makes it
                # Dynamo's to handle, not the rewrite's; the graph compiled in pieces is not this one.
                try:
                    unrewritten = self.compile_inner(gm, example_inputs)
                except _compat.dynamo_fallback_exceptions():
                    if result is not None:
                        self.results.remove(result)
                    raise error from None
            if self.config.strict:
                raise FuserError(f"fuser: compiling the rewritten graph failed: {error!r}") from error
            warnings.warn(
                f"fuser: compiling the rewritten graph failed ({error!r}); compiling the unrewritten graph instead.",
                RuntimeWarning,
                stacklevel=2,
            )
            if result is not None:
                self.results.remove(result)
            return unrewritten if unrewritten is not None else self.compile_inner(gm, example_inputs)

    @contextlib.contextmanager
    def calls_scope(self) -> Iterator[None]:
        """What each call of a model compiled through this backend by :func:`optimize` or :func:`optimize_` runs
        inside: Dynamo's settings for tracing it (:func:`fuser.tracing.tracing_context`), and a watch for Dynamo
        giving up on its code, which is otherwise a model that silently runs eagerly."""
        with _compat.dynamo_give_ups() as gave_up:
            try:
                with tracing_context(self.config):
                    yield
            finally:
                for one in gave_up:
                    self._dynamo_gave_up(one)

    def _dynamo_gave_up(self, one: _compat.DynamoGaveUp) -> None:
        """Record that Dynamo gave up on code it was compiling through this backend, and say it once per cause,
        with what to do."""
        detail = one.detail if len(one.detail) <= 300 else one.detail[:300] + "..."
        if one.cause == "error":
            what = (
                f"compiling {one.function} failed and Dynamo runs it eagerly (torch._dynamo.config.suppress_errors "
                f"is on), so nothing in it is fused: {detail}. Set torch._dynamo.config.suppress_errors = False to "
                "have the error raised with its traceback"
            )
        else:
            what = (
                f"Dynamo hit torch._dynamo.config.{one.cause} on {one.function} and runs that code eagerly from now "
                f"on, so nothing in it is fused ({detail}). Every compile of a code object counts toward the limit, "
                "whichever model or backend made it (transformers' forward wrapper is one code object for every "
                f"model of a class): raise torch._dynamo.config.{one.cause}, or call torch._dynamo.reset() between "
                "models"
            )
        self.gave_up.setdefault(one.cause, what)
        self._warn_once(f"dynamo_gave_up:{one.cause}", f"fuser: {what}.")

    def _warn_loss_after_a_break(self) -> None:
        """Once per backend: a loss whose logits come from the graph before (a graph break between the lm_head and
        the loss) is computed as written, with the whole logits in memory."""
        zero3 = (
            " Under DeepSpeed ZeRO-3 the break is DeepSpeed's: the parameter-gathering hooks it registers on the "
            "lm_head module end the graph before the lm_head and again after it. fuser.optimize_(model), called "
            "before deepspeed.initialize (the Trainer's and accelerate's too), hands the lm_head's weight to its "
            "caller's hook instead (FuserConfig.zero3_lm_head); engine.compile(backend=fuser.backend()) cannot, as it "
            "compiles the model again without fuser's per-call hook."
            if "deepspeed" in sys.modules
            else ""
        )
        self._warn_once(
            "loss_after_a_break",
            "fuser: a graph break separates this model's lm_head from its cross-entropy loss, so they are not fused "
            "(linear_cross_entropy) and the full logits are computed and kept for the backward." + zero3 + " "
            "fuser.report(model).breaks says where each graph ended, and why.",
        )

    def _warn_ddp_buckets(self) -> None:
        """Once per backend: DDP hands fuser its graph in pieces, one per gradient bucket, and a block split
        between two pieces cannot be matched (and is not reported as declined: neither piece holds all of it)."""
        self._warn_once(
            "ddp_buckets",
            "fuser: torch.compile splits this DistributedDataParallel model's graph at its gradient-bucket borders "
            "(Dynamo's DDPOptimizer), and a block whose ops land in two buckets, such as a gated MLP's gate and up "
            "projections, is not fused. fuser.report(model).counts shows what fused. To fuse across the borders, "
            "set torch._dynamo.config.optimize_ddp = False before compiling (one graph; DDP's all-reduce then "
            "starts after the backward instead of overlapping it), or raise DDP's bucket_cap_mb.",
        )

    def report(self) -> Report:
        """What this backend fused so far: counts, graphs, matches and near-misses of every graph it compiled."""
        out = Report(graphs=len(self.results), recompiles=sum(result.recompile for result in self.results))
        out.recompile_reasons = [r.recompile_reason or UNKNOWN_REASON for r in self.results if r.recompile]
        for result in self.results:
            out.matches += result.matches
            out.near_misses += result.near_misses
        out.counts = self.counts
        out.compile_seconds = self.compile_seconds
        out.breaks = list(self.breaks)
        out.inlined = dict(self.inliner.inlined)
        out.not_inlined = dict(self.inliner.declined)
        if self.config.padding_free:
            out.padding_free = dataclasses.replace(self.padding_free, declined=dict(self.padding_free.declined))
        return out

    def wrap_padding_free(self, compiled: torch.nn.Module, model: torch.nn.Module) -> None:
        """Send the calls of ``compiled`` (``model`` compiled by :func:`optimize` or :func:`optimize_`) through
        ``FuserConfig.padding_free``'s packing (:mod:`fuser.padding_free`)."""
        padding_free.wrap(compiled, _compat.eager_call(compiled), model, self.padding_free)
        self.padding_free_wrapped = True


_BACKENDS: dict[FuserConfig, FuserBackend] = {}
# the backend each model given to optimize / optimize_ is compiled with (weak: the model's lifetime is the user's)
_MODEL_BACKENDS: weakref.WeakKeyDictionary[torch.nn.Module, FuserBackend] = weakref.WeakKeyDictionary()


def as_config(config: FuserConfig | dict[str, Any] | None) -> FuserConfig:
    """``config`` as a :class:`FuserConfig`: ``None`` is the default, a dict names fields as ``options=`` does."""
    if config is None:
        return FuserConfig()
    if isinstance(config, FuserConfig):
        return config
    if isinstance(config, dict):
        return FuserConfig.from_options(config)
    raise TypeError(
        f"fuser: config must be a fuser.FuserConfig, a dict of its fields or None, got {type(config).__name__}"
    )


def backend(config: FuserConfig | dict[str, Any] | None = None) -> FuserBackend:
    """The Dynamo backend for ``config``: the same object for equal configs, so Dynamo does not recompile."""
    config = as_config(config)
    if config not in _BACKENDS:
        _BACKENDS[config] = FuserBackend(config)
    return _BACKENDS[config]


def fuser_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable:
    """The backend registered as ``"fuser"`` (entry point ``torch_dynamo_backends``).

    ``torch.compile(model, backend="fuser", options={...})`` maps ``options`` onto :class:`FuserConfig`.
    """
    if mode not in (None, "default"):
        log.warning("fuser: torch.compile mode=%r is ignored; configure Inductor through torch._inductor.config", mode)
    return backend(FuserConfig.from_options(options))(gm, example_inputs)


def _check_module(model: Any, api: str) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fuser: {api} takes a torch.nn.Module, got {type(model).__name__}")


def _calls_scope(model: torch.nn.Module, chosen: FuserBackend) -> Callable[[], contextlib.AbstractContextManager]:
    """What each call of ``model`` (compiled by :func:`optimize` or :func:`optimize_`) runs inside: with
    ``FuserConfig.zero3_lm_head``, first the lm_head's DeepSpeed ZeRO-3 hooks handed to its caller (once: DeepSpeed
    adds them in ``deepspeed.initialize``, after ``optimize_``), and a warning where ZeRO-3 hooks the decoder layers'
    submodules one by one (once); the input embeddings' ``make_inputs_require_grads`` hooks swapped for a no-op
    (``ignore_input_require_grads``, :func:`fuser.tracing.input_require_grads_ignored`); then
    :meth:`FuserBackend.calls_scope`."""
    target = weakref.ref(model)  # the scope is stored on the model: no strong reference back to it
    unchecked_layers = [True]
    leaves: list[Any] = [None, False]  # the decoder layers (found once), and whether ZeRO-3 runs them as leaves

    def scope() -> contextlib.AbstractContextManager:
        one = target()
        if one is not None and "deepspeed" in sys.modules:
            if chosen.config.zero3_lm_head:
                zero3.gather_lm_head_with_its_caller(one)
            if unchecked_layers[0]:
                unchecked_layers[0] = not zero3.warn_if_layers_are_not_leaves(one)
            if leaves[0] is None:
                leaves[0] = zero3.repeated_layers(one)
            if not leaves[1] and zero3.leaf_layers_partitioned(leaves[0]):
                leaves[1] = True
                if chosen.config.zero3_leaf_layers and one in zero3.MARKED:  # fuser's leaves, in place
                    zero3.first_layer_input_requires_grad(one, leaves[0])
        # under ZeRO-3 leaves the hook is needed (zero3.first_layer_input_requires_grad): it stays
        if one is None or not chosen.config.ignore_input_require_grads or leaves[1]:
            return chosen.calls_scope()
        stack = contextlib.ExitStack()
        stack.enter_context(input_require_grads_ignored(one))
        stack.enter_context(chosen.calls_scope())
        return stack

    return scope


def _route_calls(compiled: torch.nn.Module, model: torch.nn.Module, chosen: FuserBackend) -> None:
    """What :func:`optimize` and :func:`optimize_` add to ``model``'s compiled calls (``compiled``: the wrapper, or
    ``model`` compiled in place): ``model`` recorded as compiled by ``chosen``, its decoder layers marked as ZeRO-3
    leaves (``zero3_leaf_layers``; in place only: :func:`optimize` does not modify the model), each call run inside
    :func:`_calls_scope`, and through ``padding_free``'s packing where that is on."""
    if chosen.config.zero3_leaf_layers and compiled is model:  # optimize leaves the user's model as it is
        zero3.mark_layers_as_zero3_leaves(model)
    _MODEL_BACKENDS[model] = chosen
    _compat.within_each_call(compiled, _calls_scope(model, chosen))
    if chosen.config.padding_free:
        chosen.wrap_padding_free(compiled, model)


def optimize(model: torch.nn.Module, config: FuserConfig | dict[str, Any] | None = None) -> torch.nn.Module:
    """``torch.compile(model, backend=fuser.backend(config))``. ``model`` itself is not modified.

    The result is torch's compiled wrapper (``state_dict`` keys prefixed ``_orig_mod.``, ``forward(*args,
    **kwargs)``): for ``transformers.Trainer`` and TRL's trainers use :func:`optimize_` instead.

    With ``FuserConfig.ignore_logging`` (default), each call of the result runs with Dynamo skipping the logging
    methods that print at most once (``logger.warning_once``) while it traces, so they do not break the graph
    (``fuser.tracing``); their message is then not printed by compiled code. ``FuserConfig.checkpoint_side_effects``
    (default) likewise lets Dynamo trace a gradient-checkpointed layer that sets and restores Python state. Both are
    scoped to these calls: Dynamo's global configuration is as it was outside them. Where Dynamo gives up on the
    model's code in a call (its recompile limit, a compile error it suppressed) and runs it eagerly, fuser warns
    once per cause, with what to do (:meth:`FuserBackend.calls_scope`).
    """
    _check_module(model, "optimize")
    chosen = backend(config)
    compiled = torch.compile(model, backend=chosen)
    _route_calls(compiled, model, chosen)
    return compiled


def optimize_(model: torch.nn.Module, config: FuserConfig | dict[str, Any] | None = None) -> torch.nn.Module:
    """Compile ``model`` through fuser in place, as ``model.compile(backend=fuser.backend(config))`` does, and
    return it: its class, ``forward``, signature, parameters and ``state_dict`` keys stay the user's own, so
    ``transformers.Trainer`` (column pruning, ``save_model``, ``from_pretrained``, resuming) and TRL's trainers
    (which replace ``forward`` on the instance; the compiled call runs whatever ``forward`` is then) see the
    model they expect. Apply it to the model the trainer calls: after ``get_peft_model``, and to
    ``trainer.model`` when the trainer wraps the model itself (``SFTTrainer(peft_config=...)``).

    ``FuserConfig.ignore_logging`` and ``checkpoint_side_effects``, and the warning where Dynamo gives up on the
    model's code, apply to the model's compiled calls as in :func:`optimize`.
    """
    _check_module(model, "optimize_")
    if _compat.is_compiled_wrapper(model):
        raise TypeError(
            "fuser: optimize_ got a module that torch.compile (or fuser.optimize) already wrapped; pass the "
            "original module (`compiled._orig_mod`) instead"
        )
    chosen = backend(config)
    model.compile(backend=chosen)
    _route_calls(model, model, chosen)
    return model


def report(model: torch.nn.Module | None = None, verbose: bool = False) -> Report:
    """What fuser fused so far in the graphs it compiled: for ``model`` (given to :func:`optimize` or
    :func:`optimize_`, or the object :func:`optimize` returned), else summed over every fuser backend in this
    process. Nothing is compiled or run; counts grow as graphs compile (the first training step compiles them).

    ``str()`` of it lists the declines that matter, as :func:`fuser.explain`'s does; ``verbose=True`` also lists
    those of patterns that could not apply to the model (:attr:`Report.verbose`)."""
    if model is not None:
        target = getattr(model, "_orig_mod", model)
        if target not in _MODEL_BACKENDS:
            raise ValueError("fuser: report(model) got a model that was not given to fuser.optimize or optimize_")
        out = _MODEL_BACKENDS[target].report()  # a new Report: setting its rendering changes no other
        out.verbose = verbose
        return out
    total = Report(verbose=verbose)
    for one in _BACKENDS.values():
        part = one.report()
        total.graphs += part.graphs
        total.matches += part.matches
        total.near_misses += part.near_misses
        total.compile_seconds += part.compile_seconds
        total.breaks += part.breaks
        total.recompiles += part.recompiles
        total.recompile_reasons += part.recompile_reasons
    total.counts = count_by_pattern(total.matches)
    return total
