"""Inlined ops: Inductor launches the fused ops' Triton kernels itself, from its generated code.

A fused op called from a compiled graph runs its Python body on every call: checks, buffer allocation, the launch
configuration, ``JITFunction.run`` around each kernel: several times the host time of a kernel that Inductor
launches from its generated code. A LoRA step calls fused ops over a thousand times, and where its kernels are short
the host takes longer to launch a step than the GPU takes to run it (measurements: ``docs/defaults.md``,
``inline_ops``).

The body depends only on what the graph already knows at compile time (shapes, strides, dtypes, the op's constant
arguments), so this pass runs it once, at compile time, on the node's fake values, with each kernel launch recorded
as Inductor's ``triton_kernel_wrapper_functional`` node (``torch.library.wrap_triton``, through
:func:`fuser.kernels.launches.launchable`), and puts the traced ops in the op's place. Inductor then allocates the
buffers in its memory plan and launches the kernels as it launches its own (what ``torch.library.triton_op`` does
for an op, but after fuser's post-grad passes have seen the ops whole). Same kernels, same arguments: the results
are the op's.

A call stays an op call, with the reason kept for :func:`fuser.report`, where inlining it might not compute the
same:
- the op mutates an input (the in-place gated backward, the dx accumulation);
- a shape is symbolic (a dynamic-shape graph: the body's choices hold only for the traced shape);
- its tensors are not all on a GPU (CPU tensors take the op's reference path, chosen at run time);
- the body switches CUDA streams (a trace records none: the inlined ops would lose the overlap);
- a kernel writes into part of a buffer (the loss's chunks of rows): Inductor's functional graph writes the part
  back through an ``as_strided`` of the part that spans the whole buffer, and reads past the part's own copy, an
  illegal memory access on a GPU;
- Inductor could not tell which arguments a kernel writes (it would copy back every argument), or the body could
  not be traced at all (a data-dependent value, or a Triton kernel launched other than through ``launchable``: such
  a launch is refused during the trace, since on fake tensors it would run on null pointers).

Autocast is no reason to keep a call: a graph compiled under autocast runs with autocast off (AOT autograd's runtime
wrapper disables it around the forward and the backward, the casts autocast chose being ops of the graph), and
Dynamo compiles again when the autocast state changes. A call's body and its inlined trace, made with autocast off,
run the same matmuls in the same dtypes (``tests/test_inline_ops.py`` holds PyTorch to this).

On by default (``FuserConfig(inline_ops=False)`` keeps the calls): it helps a host-bound step, leaves a GPU-bound one
as it was, and costs compile time (``docs/defaults.md``, ``inline_ops``). The reasons a call stays a call are kept
as words, never as the exceptions that said them: an exception's traceback holds every frame up the compile's
stack, AOT autograd's backward frame among them, whose locals hold that backward's outputs, so a kept exception
keeps the first step's gradients allocated for good (``docs/notes/inline-ops-held-gradients.md``;
``tests/test_inline_ops.py`` reproduces the held frame on CPU).
Inductor types a Python float launch argument fp64, where Triton's launch types
it fp32: each kernel casts its float scalars to fp32 first, or an inlined kernel would compute in fp64
(``tests/kernels/test_sm90_compile.py`` checks every kernel for this).
"""

from __future__ import annotations

import contextlib
import operator
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from fuser import _compat
from fuser.inductor.direct_calls import NAMESPACE
from fuser.kernels.launches import tracing_kernels


class Declined(Exception):
    """Why one call cannot be inlined, in words for :func:`fuser.report`."""


def _default_overload(target: Any) -> _compat.OpOverload | None:
    """The default overload of a ``fuser::`` op for ``target`` (its default or ``direct`` overload), else None."""
    if not isinstance(target, _compat.OpOverload) or target.namespace != NAMESPACE:
        return None
    return target.overloadpacket.default


def _is_symbolic(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride(), value.storage_offset()))
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _key_of(value: Any, positions: dict[int, int]) -> Any:
    """What of one argument the traced body may depend on: a tensor's layout and which graph value it is (two
    arguments that are one tensor stay one), a constant itself."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, str(value.device),
                positions.setdefault(id(value), len(positions)))  # fmt: skip
    return ("C", type(value).__name__, repr(value))


@contextlib.contextmanager
def _no_direct_launches() -> Iterator[None]:
    """While a body is traced, a Triton kernel launched other than through ``launchable`` raises :class:`Declined`
    instead of running: on fake tensors it would run for real, on null pointers (a fake tensor's ``data_ptr()`` is
    0). Launches on real tensors (another thread's) run as ever."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - no Triton, no kernels to launch
        yield
        return
    original = JITFunction.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        # a fake tensor, or one wrapped by the functionalization the trace runs under
        if any(_compat.is_fake_or_functional(v) for v in (*args, *kwargs.values())):
            raise Declined(f"its body launches the Triton kernel {self.__name__} directly, where a trace cannot see it")
        return original(self, *args, **kwargs)

    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = original


@contextlib.contextmanager
def _no_stream_switches() -> Iterator[None]:
    """While a body is traced on this thread, switching or joining CUDA streams raises :class:`Declined`: a trace
    records no stream, so the inlined ops would all run on one stream, without the overlap the body asked for (the
    loss's weight-gradient side stream). Other threads switch streams as ever."""
    import threading

    tracing_thread = threading.get_ident()
    patched = [(torch.cuda, "set_stream"), (torch.cuda.Stream, "wait_stream"), (torch.cuda.Stream, "wait_event")]
    originals = [getattr(owner, name) for owner, name in patched]

    def refusing(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == tracing_thread:
                raise Declined(f"its body calls torch.cuda.{name}: a trace keeps no CUDA stream")
            return original(*args, **kwargs)

        return call

    for (owner, name), original in zip(patched, originals, strict=True):
        setattr(owner, name, refusing(name if owner is torch.cuda else f"Stream.{name}", original))
    try:
        yield
    finally:
        for (owner, name), original in zip(patched, originals, strict=True):
            setattr(owner, name, original)


def _autocast_off() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for device in ("cuda", "cpu"):
        stack.enter_context(torch.autocast(device, enabled=False))
    return stack


def _trace(function: Callable[..., Any], args: tuple, kwargs: dict, fake_mode: Any) -> torch.fx.GraphModule:
    """``function(*args, **kwargs)`` traced functionally on the tensor leaves of args/kwargs (fake tensors), with
    its kernel launches as graph nodes, with grad mode and autocast off (as in a compiled graph's call)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    # decomposed as Inductor decomposes the graphs it is given (aten.t, for one, reaches Inductor only so)
    decompositions = _compat.inductor_decompositions()  # imported here, outside the fake mode
    leaves, spec = pytree.tree_flatten((args, kwargs))
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def body(*tensors: torch.Tensor) -> list[torch.Tensor]:
        filled = list(leaves)
        for i, t in zip(where, tensors, strict=True):
            filled[i] = t
        a, k = pytree.tree_unflatten(filled, spec)
        out = function(*a, **k)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # autocast's "CUDA is not available" where there is no GPU (CPU tests)
        with (
            fake_mode,
            tracing_kernels(),
            _no_direct_launches(),
            _no_stream_switches(),
            torch.no_grad(),
            _autocast_off(),
        ):
            traced = make_fx(torch.func.functionalize(body), decomposition_table=decompositions, tracing_mode="real")
            return traced(*[leaves[i] for i in where])


def _numel(node: Any) -> int | None:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value.numel() if isinstance(value, torch.Tensor) else None


def _part_of_a_buffer(node: Any) -> bool:
    """Whether ``node`` is a view of fewer elements than a tensor it was taken from (a slice of rows, through any
    chain of views), rather than all of one."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.args:
        base = node.args[0]
        if not (_compat.is_view_op(node.target) and isinstance(base, torch.fx.Node)):
            return False
        inner, outer = _numel(node), _numel(base)
        if inner is None or outer is None:
            return False
        if inner < outer:
            return True
        node = base
    return False


def _check(gm: torch.fx.GraphModule) -> None:
    placeholders = {n for n in gm.graph.nodes if n.op == "placeholder"}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.copy_.default and node.args[0] in placeholders:
            raise Declined(
                "Inductor could not tell which arguments its kernel writes and would copy every argument back"
            )
        if node.target is _compat.triton_kernel_wrapper_functional():
            # a kernel that writes a part of a buffer (one chunk's rows): Inductor's functional graph writes the part
            # back through an ``as_strided`` of the part that spans the whole buffer, and reads past the part's
            # own copy (an illegal memory access on the GPU)
            arguments = node.kwargs["kwargs"]
            for name in node.kwargs["tensors_to_clone"]:
                if _part_of_a_buffer(arguments.get(name)):
                    raise Declined(
                        f"its kernel writes `{name}` into part of a buffer, which Inductor copies back wrongly"
                    )


class Inliner:
    """Traces each op signature once (a model's layers repeat the same calls) and splices the result in."""

    def __init__(self) -> None:
        # a signature's trace, or why it stays a call: the reason's words, never the exception itself, whose
        # traceback would keep every frame up the compile's stack alive as long as this inliner (the backend) lives,
        # among them AOT autograd's frame that runs the first backward right after compiling it, and so that
        # backward's outputs, the model's gradients (module docstring)
        self._traced: dict[Any, torch.fx.GraphModule | str] = {}
        self.inlined: dict[str, int] = {}  # op name -> calls inlined
        self.declined: dict[str, str] = {}  # op name -> the last reason a call of it stayed a call
        self.seconds = 0.0  # compile time spent here: tracing bodies and splicing them in

    def _graph_for(self, op: _compat.OpOverload, args: tuple, kwargs: dict, fake_mode: Any) -> torch.fx.GraphModule:
        if op._schema.is_mutable:
            raise Declined("it writes into an input, which Inductor's functional graph would have to copy")
        values = pytree.tree_leaves((args, kwargs))
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        if any(_is_symbolic(v) for v in values):
            raise Declined("the graph has dynamic shapes; the op's launch choices hold only for the shapes traced")
        if not tensors or not all(t.is_cuda for t in tensors):
            raise Declined("its tensors are not all on a GPU (the CPU path is chosen when it runs)")
        positions: dict[int, int] = {}
        key = (op, tuple(_key_of(v, positions) for v in values), pytree.tree_structure((args, kwargs)))
        cached = self._traced.get(key)
        if cached is None:
            cached = self._traced[key] = self._trace_checked(op, args, kwargs, fake_mode)
        if isinstance(cached, str):
            raise Declined(cached)  # a new exception each time: a remembered one would gather this stack too
        return cached

    @staticmethod
    def _trace_checked(op, args, kwargs, fake_mode) -> torch.fx.GraphModule | str:
        """The body's checked trace, or why the call stays a call (see ``_traced``: words, not the exception)."""
        functions = _compat.custom_op_functions(op)
        if functions is None:
            return "its Python body is not available from torch.library"
        function = functions[0]
        try:
            gm = _trace(function, args, kwargs, fake_mode)
            _check(gm)
        except Declined as reason:
            return str(reason)
        except Exception as error:  # noqa: BLE001 - any failure to trace leaves the call as it was
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            return f"its body could not be traced ({type(error).__name__}: {first[:160]})"
        return gm

    def inline(self, graph: torch.fx.Graph) -> int:
        """Replace every fused op call of ``graph`` that can be inlined by the ops of its body; returns how many."""
        start = time.perf_counter()
        try:
            return self._inline(graph)
        finally:
            self.seconds += time.perf_counter() - start

    def _inline(self, graph: torch.fx.Graph) -> int:
        count = 0
        work = [n for n in graph.nodes if n.op == "call_function" and _default_overload(n.target) is not None]
        while work:
            node = work.pop(0)
            op = _default_overload(node.target)
            name = op.overloadpacket.__name__
            args, kwargs = pytree.tree_map_only(torch.fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs))
            fake_mode = next((v.fake_mode for v in pytree.tree_leaves((args, kwargs)) if hasattr(v, "fake_mode")), None)
            if fake_mode is None:
                continue
            if isinstance(node.meta.get("val"), (tuple, list)) and any(
                u.op != "call_function" or u.target is not operator.getitem for u in node.users
            ):
                continue  # a tuple result used whole (not in post-grad graphs, which take each item)
            try:
                gm = self._graph_for(op, args, kwargs, fake_mode)
            except Declined as reason:
                self.declined[name] = str(reason)
                continue
            work.extend(_splice(graph, node, gm, fake_mode))
            self.inlined[name] = self.inlined.get(name, 0) + 1
            count += 1
        return count


def _splice(
    graph: torch.fx.Graph, node: torch.fx.Node, gm: torch.fx.GraphModule, fake_mode: Any
) -> list[torch.fx.Node]:
    """Put ``gm``'s ops (traced on ``node``'s tensor arguments, in pytree order) in ``node``'s place; returns the
    new calls of fuser ops among them (a body that calls another op), to inline in turn.

    Each new node gets fake values of its own, computed here from its inputs': a trace serves every call of the same
    signature (each layer's), and values shared between two calls would tell Inductor that their buffers are one
    storage (it would then copy a kernel's output buffer instead of writing it in place)."""
    inputs = [leaf for leaf in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(leaf, torch.fx.Node)]
    env: dict[torch.fx.Node, Any] = {}
    placeholders = iter(inputs)
    outputs: list[Any] = []
    added: list[torch.fx.Node] = []
    with graph.inserting_before(node), fake_mode, _compat.python_dispatcher():
        for inner in gm.graph.nodes:
            if inner.op == "placeholder":
                env[inner] = next(placeholders)
            elif inner.op == "output":
                outputs = [env[o] if isinstance(o, torch.fx.Node) else o for o in inner.args[0]]
            elif inner.op == "get_attr":
                raise AssertionError("fuser: an inlined op's trace holds a constant tensor")  # not for our bodies
            else:
                new = graph.node_copy(inner, lambda n: env[n])
                args, kwargs = torch.fx.node.map_arg((new.args, new.kwargs), lambda n: n.meta["val"])
                new.meta["val"] = new.target(*args, **kwargs)
                if "eager_input_vals" in new.meta:  # the strides Inductor holds a Triton kernel's arguments to
                    new.meta["eager_input_vals"] = (args, kwargs)
                env[inner] = new
                if _default_overload(new.target) is not None:
                    added.append(new)
    if isinstance(node.meta.get("val"), (tuple, list)):
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(outputs[user.args[1]])
                graph.erase_node(user)
    else:
        node.replace_all_uses_with(outputs[0])
    graph.erase_node(node)
    return added
