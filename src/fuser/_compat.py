"""The one place that touches private PyTorch APIs, so a torch upgrade breaks one small file.

Supported: torch >= 2.11.

Private APIs used elsewhere, and why (``PRIVATE_USES_ELSEWHERE`` below; ``tests/test_private_apis.py`` fails on
any other ``torch._*`` use outside this file):

- ``src/fuser/kernels/linear_cross_entropy.py``, ``torch._foreach_mul_``: an ATen op of the kernel's eager backward
  (the gradients scaled in place in one vectorised pass), not an internal of PyTorch; it has no public spelling,
  and a wrapper here would move part of the op's maths away from it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.fx

# (file, API, why it stays there): the private torch uses outside this file, which the module docstring lists
PRIVATE_USES_ELSEWHERE: tuple[tuple[str, str, str], ...] = (
    (
        "src/fuser/kernels/linear_cross_entropy.py",
        "torch._foreach_mul_",
        "an ATen op of the kernel's eager backward, with no public spelling: part of the op's maths",
    ),
)

OpOverload = torch._ops.OpOverload
"""The type of one overload of a registered op (``torch.ops.fuser.rms_norm.default``)."""

SET_GRAD_ENABLED = torch._C._set_grad_enabled
"""The function a traced ``torch.set_grad_enabled``/``torch.no_grad`` records as its graph node's target."""


def triton_kernel_wrapper_functional() -> Any:
    """The higher-order op a traced, functionalised Triton kernel launch is recorded as."""
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_functional as wrapper

    return wrapper


def is_view_op(target: Any) -> bool:
    """Whether ``target`` is an ATen overload whose result is a view of its first input (slice, view, ...)."""
    return isinstance(target, torch._ops.OpOverload) and bool(target.is_view)


def registered_op_names() -> list[str]:
    """The qualified names (``"namespace::name"`` or ``"namespace::name.overload"``) of every op the dispatcher
    knows."""
    return torch._C._dispatch_get_all_op_names()


def has_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has a storage to read (``untyped_storage()``): a sparse tensor, or a wrapper subclass
    without one, has none."""
    return torch._C._has_storage(tensor)


def python_dispatcher() -> contextlib.AbstractContextManager[Any]:
    """A context in which ops dispatch through Python (what running a graph's ops on its fake values needs)."""
    from torch._dispatch.python import enable_python_dispatcher

    return enable_python_dispatcher()


def real_tensors() -> contextlib.AbstractContextManager[Any]:
    """A context in which new tensors are real, even inside a fake mode (a compile's trace)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


@functools.cache
def _traced_tensor_types() -> tuple[type, ...]:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return FakeTensor, FunctionalTensor


def is_fake_or_functional(value: Any) -> bool:
    """Whether ``value`` is a fake tensor, or one wrapped by functionalization (what a trace runs on)."""
    return isinstance(value, torch.Tensor) and (
        isinstance(value, _traced_tensor_types()) or torch._is_functional_tensor(value)
    )


def inductor_decompositions() -> dict[Any, Callable[..., Any]]:
    """Inductor's decomposition table (op overload -> its decomposition)."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inductor_compile(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config_patches: dict[str, Any]
) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    register_inductor_fallbacks("fuser")
    return compile_fx(gm, example_inputs, config_patches=config_patches)


def cudagraph_skips() -> int:
    """How many times Inductor has declined to record a compiled graph as a CUDA graph in this process (its
    ``counters["inductor"]["cudagraph_skips"]``; 0 where torch keeps no such counter)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["inductor"].get("cudagraph_skips", 0))


def is_compiled_backward(node: Any) -> bool:
    """Whether the autograd node ``node`` is the backward of an AOT-autograd compiled graph (its
    ``autograd.Function`` is named ``CompiledFunction``)."""
    return type(node).__name__ == "CompiledFunctionBackward"


def is_accumulate_grad(node: Any) -> bool:
    """Whether the autograd node ``node`` accumulates into a leaf's ``.grad`` (it has ``.variable``)."""
    return type(node).__name__ == "AccumulateGrad"


def register_inductor_fallbacks(namespace: str) -> int:
    """Give every registered ``namespace::`` custom op the fallback lowering Inductor would create for it on first
    sight (the layout constraint its tags ask for), before Inductor sees it; returns how many were new.

    Inductor's implicit fallback formats the op's arguments first (eagerly, as ``log.info``'s argument, up to
    torch 2.11): the string of an opaque op's input holds its producers', recursively, so a chain of opaque ops
    (fuser's residual-add norms, lora sums and projections, layer after layer) makes that string exponential in
    the depth: a 32-layer model's compile did not finish in minutes. Registered up front, the op never reaches
    that branch. Where these private helpers are missing, nothing is registered (Inductor's own path runs)."""
    try:
        from torch._inductor.lowering import lowerings, make_fallback, tag_to_layout_constraint
        from torch._library.utils import get_layout_constraint_tag
    except ImportError:
        return 0
    prefix = f"{namespace}::"
    new = 0
    for qualified in registered_op_names():
        if not qualified.startswith(prefix):
            continue
        name, _, overload = qualified[len(prefix) :].partition(".")
        op = getattr(getattr(getattr(torch.ops, namespace), name), overload or "default", None)
        if op is None or op in lowerings:
            continue
        constraint = tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        make_fallback(op, layout_constraint=constraint, warn=False)
        new += 1
    return new


def custom_op_functions(op: Any) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """(the function a ``torch.library.custom_op`` was made from, its fake implementation) for ``op``, an
    ``OpOverload``; ``None`` where ``op`` was not made by ``custom_op``, has no fake, has a kernel of its own for
    some device (``register_kernel``), or torch keeps these elsewhere than ``CustomOpDef``'s private fields."""
    try:
        from torch._library.custom_ops import _maybe_get_opdef
    except ImportError:
        return None
    opdef = _maybe_get_opdef(op)
    function = getattr(opdef, "_init_fn", None)
    fake = getattr(opdef, "_abstract_fn", None)
    kernels = getattr(opdef, "_backend_fns", None)
    if not callable(function) or not callable(fake) or not isinstance(kernels, dict) or set(kernels) - {None}:
        return None
    return function, fake


def lookup_dynamo_backend(name: str) -> Callable[..., Any]:
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(name)


def current_post_grad_custom_post_pass() -> Any:
    import torch._inductor.config as inductor_config

    return inductor_config.post_grad_custom_post_pass


def custom_graph_pass_base() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def is_compiled_wrapper(module: Any) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile(module)`` returns (``OptimizedModule``)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)


def dynamo_restart_analysis() -> type[BaseException]:
    """Dynamo's "trace this frame again" exception, which a backend must let through: AOT autograd's tensorify
    pass raises it to specialise a float that Dynamo made symbolic (an ``eps`` that changed between models)."""
    from torch._dynamo.exc import RestartAnalysis

    return RestartAnalysis


def dynamo_fallback_exceptions() -> tuple[type[BaseException], ...]:
    """The exceptions a backend may raise for Dynamo to break the graph at the op instead of failing: fake tensors
    could not trace an op of the captured graph (an output shape that depends on data, as ``nonzero`` of a boolean
    mask has, a ``.item()``, an operator without a fake kernel). Dynamo catches exactly these from any backend."""
    from torch._dynamo.exc import exceptions_allowed_to_be_fallback

    return tuple(exceptions_allowed_to_be_fallback)


def statically_equal(a: Any, b: Any) -> bool:
    """``a == b`` for ints or SymInts, decided without adding a guard (unknown counts as unequal)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


def sympy_expr(size: int | torch.SymInt) -> Any:
    """A size as a sympy expression: an int as a sympy integer, a SymInt as the expression over the shape
    environment's symbols that it stands for (replacements applied), e.g. the symbol of a dynamic sequence length."""
    import sympy

    if isinstance(size, torch.SymInt):
        return size.node.expr
    return sympy.Integer(size)


def statically_same_shape(a: Any, b: Any) -> bool:
    """Two shapes of one rank whose sizes are :func:`statically_equal` one by one."""
    return len(a) == len(b) and all(statically_equal(x, y) for x, y in zip(a, b, strict=True))


def compiling_a_ddp_bucket() -> bool:
    """Whether Dynamo's DDPOptimizer is compiling one gradient bucket's piece of a DDP model's graph now.

    ``torch.compile`` of a ``DistributedDataParallel`` module with more than one gradient bucket (any model over
    ``bucket_cap_mb``, 25 MB by default) splits the graph at the bucket borders and compiles each piece with
    ``TracingContext.fakify_first_call`` set (a private attribute: absent, this answers False).
    """
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    return bool(context is not None and getattr(context, "fakify_first_call", False))


def dynamo_ignoring_logging(functions: Sequence[Callable[..., Any]]) -> contextlib.AbstractContextManager[None]:
    """A context in which Dynamo skips calls of ``functions`` (``logging.Logger`` methods, as
    ``logging.Logger.warning_once``) while it traces, instead of breaking the graph there: the config's set with
    ``functions`` added, restored on exit. Named ``ignore_logging_functions`` since torch 2.11 (before,
    ``ignore_logger_methods``). Dynamo does not guard on it: a graph traced inside keeps the calls skipped."""
    import torch._dynamo.config as dynamo_config

    name = "ignore_logging_functions" if hasattr(dynamo_config, "ignore_logging_functions") else "ignore_logger_methods"
    added = {IgnoredFunction(fn) for fn in functions}

    @contextlib.contextmanager
    def ignoring() -> Iterator[None]:
        with dynamo_config.patch(**{name: set(getattr(dynamo_config, name)) | added}):
            yield

    return ignoring()


def dynamo_allowing_checkpoint_side_effects() -> contextlib.AbstractContextManager[None]:
    """A context in which Dynamo traces a checkpointed region that mutates Python state (the mutation applied once,
    not replayed in the backward's recompute) instead of skipping the frame: its
    ``skip_fwd_side_effects_in_bwd_under_checkpoint``, restored on exit; a no-op where torch lacks it."""
    import torch._dynamo.config as dynamo_config

    if not hasattr(dynamo_config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        return contextlib.nullcontext()
    return dynamo_config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)


class IgnoredFunction(str):
    """A function in Dynamo's set of logging functions to skip, standing in for it: hashed as the function and equal
    to it, so Dynamo's ``method in ignore_set or function in ignore_set`` finds it, and a string (the function's
    qualified name), so the set can be sorted and JSON-dumped. Dynamo records its config with every compile's
    metrics by sorting each set in it; torch 2.11 leaves ``ignore_logging_functions`` out of that record only
    under its old name, so two ``functools.lru_cache`` wrappers in it (transformers' ``warning_once`` and
    ``info_once``) made every compile log a ``TypeError`` traceback ("'<' not supported between instances of
    'functools._lru_cache_wrapper'")."""

    def __new__(cls, fn: Callable[..., Any]) -> IgnoredFunction:
        name = f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', None) or repr(fn)}"
        self = super().__new__(cls, name)
        self.fn = fn
        return self

    def __hash__(self) -> int:
        return hash(self.fn)

    def __eq__(self, other: object) -> bool:
        return other is self.fn or (isinstance(other, IgnoredFunction) and other.fn is self.fn)

    def __ne__(self, other: object) -> bool:
        return not self == other


def within_each_call(compiled: torch.nn.Module, context: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
    """Run every call of ``compiled``'s Dynamo-compiled forward inside a fresh ``context()``, so what it sets
    holds while Dynamo traces (the first call compiles; a recompile is a later call) and nowhere else.

    ``torch.compile`` gives a backend no hook of its own around calls: Dynamo enters a backend's
    ``backend_ctx_ctor`` only for ``torch._dynamo.optimize(backend)``, and ``torch.compile`` hands Dynamo its own
    wrapper of the backend instead (:func:`wrap_compiled_call` says where the call is replaced).
    """

    def around(inner: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(inner)
        def call(*args: Any, **kwargs: Any) -> Any:
            with context():
                return inner(*args, **kwargs)

        return call

    wrap_compiled_call(compiled, around)


def wrap_compiled_call(compiled: torch.nn.Module, around: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``compiled``'s Dynamo-compiled call by ``around(call)``.

    ``compiled`` is what ``torch.compile(module)`` returned (``OptimizedModule``: its ``forward`` attribute is the
    compiled ``__call__`` of the original) or a module that ``module.compile()`` compiled in place (its
    ``_compiled_call_impl``). Type, parameters and ``state_dict`` keys are unchanged; a pickled or deep-copied
    ``OptimizedModule`` rebuilds its ``forward`` without the wrapper (Dynamo's default).
    """
    attribute = "forward" if is_compiled_wrapper(compiled) else "_compiled_call_impl"
    inner = getattr(compiled, attribute, None)
    if inner is None:
        raise TypeError(f"fuser: {type(compiled).__name__} has no compiled call to wrap")
    setattr(compiled, attribute, around(inner))


def eager_call(compiled: torch.nn.Module) -> Callable[..., Any]:
    """Call the module that ``compiled`` compiles without compiling: the original of an ``OptimizedModule``, or
    the module's own ``_call_impl`` (its hooks and ``forward``) where ``module.compile()`` compiled it in place."""
    if is_compiled_wrapper(compiled):
        return compiled._orig_mod
    return compiled._call_impl


@contextlib.contextmanager
def compiled_leaving_no_trace(target: Callable[..., Any], backend: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """``torch.compile(target, backend=backend)``, to be called inside the block; on exit Dynamo keeps nothing that
    those calls compiled, and no other compile's limits or shapes are changed by them.

    Dynamo stores what it compiles on the code objects it ran (transformers' forward wrapper is one code object
    for every model of its class), and every entry there, whatever its backend, counts toward
    ``torch._dynamo.config.recompile_limit`` for that code: one-off captures left in place make a later
    ``fuser.optimize`` of the same class run eagerly. So:

    - the calls compile into a recompile region of their own (``torch.compile(isolate_recompiles=True)``, where
      this torch has it): while they exist their entries count toward no other compile's ``recompile_limit``
      (only toward the per-code ``accumulated_recompile_limit``); their lookups reuse another compile's entries
      only where its backend is ``backend``;
    - on exit, each code object whose entries all came from ``backend`` has its cache reset (``reset_code``: no
      entry left); where other compiles' entries share the code, ``backend``'s are invalidated instead (they stay
      listed, never match again, and hold neither their code nor the backend);
    - Dynamo's record of the shapes each code ran with (automatic dynamic shapes, ``torch._dynamo.pgo``), which
      would make the next compile of that code dynamic from its first graph, is put back as it was.

    ``backend`` must be an object no other compile uses: its entries are found by it. ``torch._dynamo.reset()``,
    which would drop every compiled model in the process, is not called.
    """
    restore_shapes = _automatic_dynamic_snapshot()
    isolate = "isolate_recompiles" in inspect.signature(torch.compile).parameters
    try:
        yield torch.compile(target, backend=backend, **({"isolate_recompiles": True} if isolate else {}))
    finally:
        remove_cache_entries_of(backend)
        restore_shapes()


def _automatic_dynamic_snapshot() -> Callable[[], None]:
    """A function that puts Dynamo's automatic-dynamic record back as it is now (a no-op where torch keeps it
    elsewhere). Initialising the record here is what Dynamo's first compile would do."""
    try:
        from torch._dynamo import pgo

        state = pgo.get_code_state()
    except (ImportError, AttributeError):
        return lambda: None
    saved = copy.deepcopy(dict(state))

    def restore() -> None:
        if getattr(pgo, "_CODE_STATE", None) is state:  # not replaced meanwhile (torch._dynamo.reset)
            state.clear()
            state.update(saved)

    return restore


def remove_cache_entries_of(backend: Callable[..., Any]) -> int:
    """Remove Dynamo's cache entries compiled by ``backend`` from every code object Dynamo has run (see
    :func:`compiled_leaving_no_trace`); returns how many were found. Nothing is removed where torch lacks these
    private helpers."""
    found = 0
    for code in _dynamo_input_codes():
        entries = _cache_entries(code)
        ours = [entry for entry in entries if _entry_backend(entry) is backend]
        if not ours:
            continue
        found += len(ours)
        if len(ours) == len(entries):
            torch._C._dynamo.eval_frame.reset_code(code)
            continue
        for entry in ours:
            _invalidate_entry(entry)
    return found


def live_cache_entries(backend: Callable[..., Any] | None = None) -> dict[Any, int]:
    """Code object → its cache entries that can still run (not invalidated), over every code Dynamo has run; only
    ``backend``'s where given. Empty where torch lacks these private helpers."""
    out: dict[Any, int] = {}
    for code in _dynamo_input_codes():
        live = [
            entry
            for entry in _cache_entries(code)
            if getattr(entry, "code", None) is not None and (backend is None or _entry_backend(entry) is backend)
        ]
        if live:
            out[code] = len(live)
    return out


def _dynamo_input_codes() -> list[Any]:
    try:
        from torch._dynamo import convert_frame
    except ImportError:
        return []
    tracker = getattr(convert_frame, "input_codes", None)
    return [code for ref in getattr(tracker, "seen", []) if (code := ref()) is not None]


def _cache_entries(code: Any) -> list[Any]:
    entries = getattr(torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    return list(entries(code)) if entries is not None else []


def _entry_backend(entry: Any) -> Any:
    """The backend a cache entry was compiled by: what ``torch.compile`` was given (it stores its own wrapper of
    it, ``_TorchCompileWrapper.compiler_fn``); ``None`` for an invalidated entry."""
    stored = getattr(entry, "backend", None)
    return getattr(stored, "compiler_fn", stored)


def _invalidate_entry(entry: Any) -> None:
    """What Dynamo does to an entry whose guarded object died: it never matches again and drops its code."""
    try:
        from torch._dynamo.guards import DeletedGuardManagerWrapper

        guard_manager = entry.guard_manager
        guard_manager.extra_state.invalidate(entry, DeletedGuardManagerWrapper("compiled by fuser.explain"))
    except (ImportError, AttributeError, TypeError):  # another torch's signature: the entry stays (isolated)
        return


class DynamoGaveUp(NamedTuple):
    """A frame Dynamo stopped compiling and runs eagerly: ``cause`` is ``"recompile_limit"``,
    ``"accumulated_recompile_limit"`` (the config option it reached) or ``"error"`` (a compile error it suppressed,
    ``torch._dynamo.config.suppress_errors``); ``function`` names the code ("'forward' (file:line)"); ``detail`` is
    Dynamo's reason in brief (the last guard failure, the error)."""

    cause: str
    function: str
    detail: str


# the logger Dynamo's frame conversion warns through when it gives up on a frame
_CONVERT_FRAME_LOGGER = "torch._dynamo.convert_frame"
_WONT_CONVERT = re.compile(r"WON'T CONVERT (\S+) (.+?) line (\d+)")


def _gave_up_from(record: logging.LogRecord) -> DynamoGaveUp | None:
    """The give-up a record of Dynamo's frame conversion reports, from its format and arguments (Dynamo's own
    wording, so it lives here); ``None`` for any other record."""
    if not isinstance(record.msg, str):
        return None
    args = record.args if isinstance(record.args, tuple) else ()
    if record.msg.startswith("torch._dynamo hit config.") and len(args) >= 4:
        limit, value, function, reason = args[:4]
        return DynamoGaveUp(str(limit), str(function), f"limit {value}; last reason: {reason}")
    if record.msg.startswith("WON'T CONVERT"):
        found = _WONT_CONVERT.match(record.getMessage())
        function = f"'{found[1]}' ({found[2]}:{found[3]})" if found else "a frame"
        error = record.exc_info[1] if record.exc_info else None
        # the backend's own error, not Dynamo's wrapper of it (BackendCompilerFailed, whose text leads with the
        # backend's repr)
        error = getattr(error, "inner_exception", None) or error
        detail = f"{type(error).__name__}: {error}" if error is not None else record.getMessage().splitlines()[-1]
        return DynamoGaveUp("error", function, detail)
    return None


class _GiveUpCollector(logging.Handler):
    """Collects the give-ups Dynamo logs in one thread (the thread that compiles a call is the one that made it)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.thread = threading.get_ident()
        self.found: list[DynamoGaveUp] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread and (one := _gave_up_from(record)) is not None:
            self.found.append(one)


@contextlib.contextmanager
def dynamo_give_ups() -> Iterator[list[DynamoGaveUp]]:
    """A list that collects, while the block runs, each frame Dynamo gave up compiling in this thread and will run
    eagerly (:class:`DynamoGaveUp`), as Dynamo warns of it through its logger (``torch._dynamo hit
    config.recompile_limit``, ``WON'T CONVERT``). Dynamo makes these records only where that logger is enabled for
    warnings (torch's default; ``TORCH_LOGS`` can turn it off). A graph break, or a frame skipped for an
    unsupported construct, is not a give-up here: Dynamo logs those below warning level."""
    collector = _GiveUpCollector()
    logger = logging.getLogger(_CONVERT_FRAME_LOGGER)
    logger.addHandler(collector)
    try:
        yield collector.found
    finally:
        logger.removeHandler(collector)


def dynamo_recompiling() -> bool:
    """Whether the graph Dynamo is compiling now is a recompile: a frame it compiled before, again for new shapes
    or guards that failed (its compile id's ``frame_compile_id`` above 0), rather than a new frame such as the code
    after a graph break. False where torch does not say."""
    try:
        from torch._guards import CompileContext

        compile_id = CompileContext.current_compile_id()
    except Exception:  # noqa: BLE001 - an older or newer torch without it: count the graph as a first compile
        return False
    return bool(getattr(compile_id, "frame_compile_id", 0))


def dynamo_recompile_reason() -> str | None:
    """Dynamo's reason for the recompile it is compiling now, in its words: the first guard of the earlier compile
    that failed, prefixed by that compile's id (``"0/0: tensor 'kwargs['input_ids']' size mismatch at index 1.
    expected 16, actual 24"``). Read from the metrics Dynamo records for the frame it compiles
    (``recompile_reason``); None outside a recompile or where torch keeps no such record."""
    try:
        from torch._dynamo.utils import get_metrics_context

        context = get_metrics_context()
        reason = context._metrics.get("recompile_reason") if context.in_progress() else None
    except Exception:  # noqa: BLE001 - an older or newer torch without it: no reason to give
        return None
    return reason if isinstance(reason, str) and reason else None


def graph_break_of(gm: torch.fx.GraphModule) -> tuple[str, tuple[str, int, str]] | None:
    """Why Dynamo ended the graph ``gm`` at a graph break, and where (file, line, code of the user frame it
    stopped in), from the reason Dynamo attaches to the graph module; ``None`` when the graph ended at a return
    (or the attribute is missing)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    stack = list(getattr(reason, "user_stack", None) or [])
    frame = stack[-1] if stack else None
    where = (frame.filename, frame.lineno, frame.line or "") if frame is not None else ("?", 0, "")
    return str(getattr(reason, "reason", "")), where


def dynamo_skipped_frames(message: str) -> list[tuple[str, str, int]]:
    """``(function, file, first line)`` of each frame a Dynamo message says it skipped and ran eagerly ("frame
    skipped: forward (/path/modeling_llama.py line 354)"); empty for a plain graph break or where torch words it
    otherwise."""
    return [(name, path, int(line)) for name, path, line in _SKIPPED_FRAME.findall(message)]


_SKIPPED_FRAME = re.compile(r"frame skipped: (\S+) \((.+?) line (\d+)\)")


def dynamo_graph_break_messages() -> dict[str, int]:
    """Dynamo's count of each graph-break message so far in this process (the messages ``TORCH_LOGS=graph_breaks``
    prints), a copy; empty where the counters are missing. Its ``unimplemented`` messages are counted too: where
    Dynamo gives up on a whole frame and runs it eagerly ("Skipping the function and falling back to eager", as for
    a side effect inside ``torch.utils.checkpoint``) that is the only record of why."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    merged = dict(counters.get("graph_break", {}))
    for message, n in counters.get("unimplemented", {}).items():
        merged[message] = merged.get(message, 0) + n
    return merged


def dynamo_messages_since(before: dict[str, int]) -> list[str]:
    """The graph-break messages (:func:`dynamo_graph_break_messages`) Dynamo counted again since ``before``, a
    snapshot of them."""
    return [m for m, n in dynamo_graph_break_messages().items() if n > before.get(m, 0)]


# torch's analysis of which arguments a user-defined Triton kernel reads and writes: identify_accessed_tensors
# (torch >= 2.12, reads and writes) or identify_mutated_tensors (earlier, the written argument names)
_KERNEL_ANALYSES = ("identify_accessed_tensors", "identify_mutated_tensors")


def memoized_kernel_analysis(analysis: Callable[..., Any]) -> Callable[..., Any]:
    """``analysis(kernel, kwargs, tma_descriptor_metadata)``, computed once per kernel and per what it reads of the
    arguments. It compiles the kernel to Triton IR on each call (milliseconds each: ``docs/notes/host-overhead.md``)
    for tensors of the given dtypes (``generate_ttir`` stands a 2-element tensor of the dtype in for each tensor, 2
    for each symbolic value) and the given constants; Inductor calls it two or three times for every launch in a
    graph, so that a model of many inlined calls (``FuserConfig.inline_ops``) spends minutes compiling what a few
    kernels' signatures determine. Each call returns its own copy of the result."""
    cache: dict[Any, Any] = {}

    def arg_key(value: Any) -> Any:
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) or type(value).__module__.startswith(
            "sympy"
        ):
            return ("symbolic",)
        dtype = getattr(value, "dtype", None)
        if isinstance(dtype, torch.dtype) and not isinstance(value, (int, float, bool)):
            return ("tensor", type(value).__name__, str(dtype))  # a (fake) tensor, an Inductor TensorBox
        return ("value", type(value).__name__, repr(value))

    def memoized(kernel: Any, kwargs: dict[str, Any], tma_descriptor_metadata: Any) -> Any:
        try:
            key = (kernel, tuple((k, arg_key(v)) for k, v in kwargs.items()), repr(tma_descriptor_metadata))
            hash(key)
        except TypeError:  # an argument that cannot be a key: no memo for this call
            return analysis(kernel, kwargs, tma_descriptor_metadata)
        if key not in cache:
            cache[key] = analysis(kernel, kwargs, tma_descriptor_metadata)
        return copy.deepcopy(cache[key])

    memoized.fuser_memoized = analysis  # type: ignore[attr-defined]
    return memoized


def memoize_kernel_analysis() -> bool:
    """Install :func:`memoized_kernel_analysis` over torch's kernel analysis, once per process (it is a pure
    function of what the key holds, so every later caller gets the same answers sooner); False where this torch
    has neither analysis."""
    try:
        import torch._higher_order_ops.triton_kernel_wrap as wrap
    except ImportError:  # pragma: no cover - torch without user-defined Triton kernel support
        return False
    for name in _KERNEL_ANALYSES:
        current = getattr(wrap, name, None)
        if current is None:
            continue
        if not hasattr(current, "fuser_memoized"):
            setattr(wrap, name, memoized_kernel_analysis(current))
        return True
    return False
