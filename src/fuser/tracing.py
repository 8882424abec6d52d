"""What holds while Dynamo traces the calls fuser compiles (``fuser.optimize``, ``optimize_``, ``explain``).

Dynamo cannot trace a call of a ``logging.Logger`` method and breaks the graph there. transformers' causal LMs
whose class name does not end in ``ForCausalLM`` (GPT-2, CTRL, OpenAI-GPT, BERT as a decoder, ...) log a
``logger.warning_once`` in their ``loss_function`` property, between the lm_head and the loss: the two land in
different graphs and the loss cannot fuse. With ``FuserConfig.ignore_logging`` (default ``True``) Dynamo skips
the logging methods that print a message at most once per process (:data:`ONCE_LOGGING_METHODS`) while it traces
those calls; the message is then not printed by compiled code. Dynamo's ``reorderable_logging_functions``, which
would print it after the graph instead, does not reach methods of a logger (only plain functions such as
``print``), so skipping is the one way to keep the graph whole.

With ``FuserConfig.checkpoint_side_effects`` (default ``True``) Dynamo traces a gradient-checkpointed layer that
sets Python state instead of running the whole layer eagerly: transformers >= 5.25, with the ``kernels`` package
it installs, sets and restores a context variable in each attention layer's forward to route its kernels, and
Dynamo refuses any mutation inside ``torch.utils.checkpoint`` unless told the change need not be replayed when
the backward recomputes the layer (``skip_fwd_side_effects_in_bwd_under_checkpoint``). A set-and-restore leaves
nothing to replay.

With ``FuserConfig.ignore_input_require_grads`` (default ``True``) the forward hook that transformers'
``gradient_checkpointing_enable`` and peft put on the input embeddings (``output.requires_grad_(True)``) does nothing
during the call, where no layer checkpoints with reentrancy: Dynamo cannot trace ``requires_grad_`` on the output of
a frozen embedding, gives up on the forward and traces each nested frame again, the whole model each time. Only
reentrant checkpointing needs the hook (its layers get no gradients unless their input requires one); without it,
every parameter's gradient is the same. The hook is swapped for a no-op in place, so the order of the module's hooks
stays, and put back after the call.

Only Dynamo's tracing of fuser's own compiled calls is affected: the setting is entered around each call and
restored after it, never at import and never for other compiled code. ``torch.compile(model, backend="fuser")``
gives a backend no way to wrap its calls: there the break stays, and ``fuser.explain`` (with
``FuserConfig(ignore_logging=False)``) or ``fuser.report()`` shows the loss declined for it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from fuser import _compat

if TYPE_CHECKING:
    from fuser.config import FuserConfig

# the names of the forward hooks transformers' enable_input_require_grads and peft register on the input embeddings
INPUT_REQUIRE_GRADS_HOOKS = ("make_inputs_require_grads", "make_inputs_require_grad")

# methods of logging.Logger that print a message at most once per process; transformers adds them to the class
ONCE_LOGGING_METHODS = ("warning_once", "info_once")


def skipped_logging_calls() -> list[Any]:
    """The ``logging.Logger`` methods Dynamo skips under ``ignore_logging`` (those defined now: transformers may be
    imported after fuser)."""
    return [m for name in ONCE_LOGGING_METHODS if (m := getattr(logging.Logger, name, None)) is not None]


@contextlib.contextmanager
def tracing_context(config: FuserConfig) -> Iterator[None]:
    """The context each call compiled through fuser with ``config`` runs in (see the module docstring); Dynamo's
    settings change when it is entered, not when it is made."""
    with contextlib.ExitStack() as stack:
        if config.ignore_logging:
            stack.enter_context(_compat.dynamo_ignoring_logging(skipped_logging_calls()))
        if config.checkpoint_side_effects:
            stack.enter_context(_compat.dynamo_allowing_checkpoint_side_effects())
        yield


def _no_op_hook(module: Any, args: Any, output: Any) -> None:
    return None


def _is_input_require_grads_hook(hook: Any) -> bool:
    """Whether ``hook`` is transformers' or peft's ``make_inputs_require_grads``: by its name and its one call."""
    code = getattr(inspect.unwrap(hook), "__code__", None) if callable(hook) else None
    return code is not None and code.co_name in INPUT_REQUIRE_GRADS_HOOKS and "requires_grad_" in code.co_names


def _no_reentrant_checkpointing(model: Any) -> bool:
    """Whether no module of ``model`` checkpoints with reentrancy: every module with checkpointing on (transformers'
    ``gradient_checkpointing`` and ``_gradient_checkpointing_func``) checkpoints through a ``functools.partial`` with
    ``use_reentrant=False`` (torch's checkpoint without the argument is reentrant), and no torch
    ``CheckpointWrapper`` is reentrant."""
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            func = getattr(module, "_gradient_checkpointing_func", None)
            if not (isinstance(func, functools.partial) and func.keywords.get("use_reentrant") is False):
                return False
        impl = getattr(module, "checkpoint_impl", None)
        if impl is not None and getattr(impl, "name", "") != "NO_REENTRANT":
            return False
    return True


# per model: the modules that can name its input embeddings (transformers' ``get_input_embeddings``), found once,
# and the verdict of :func:`_no_reentrant_checkpointing` for the hooks last found (a new hook, as a new
# ``gradient_checkpointing_enable`` registers, asks again)
_EMBEDDING_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def input_embeddings(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model``'s input embedding modules, as transformers' ``get_input_embeddings`` names them (each once)."""
    owners = _EMBEDDING_OWNERS.get(model)
    if owners is None:
        owners = [m for m in model.modules() if callable(getattr(m, "get_input_embeddings", None))]
        _EMBEDDING_OWNERS[model] = owners
    found: dict[int, torch.nn.Module] = {}
    for owner in owners:
        try:
            embedding = owner.get_input_embeddings()
        except (NotImplementedError, AttributeError):
            continue
        if isinstance(embedding, torch.nn.Module):
            found.setdefault(id(embedding), embedding)
    return list(found.values())


def _input_require_grads_hooks(model: Any) -> list[tuple[dict, Any, Any]]:
    """(hooks dict, key, hook) of each ``make_inputs_require_grads`` hook on ``model``'s input embeddings."""
    found = []
    for embedding in input_embeddings(model):
        hooks = embedding._forward_hooks
        found += [(hooks, key, hook) for key, hook in hooks.items() if _is_input_require_grads_hook(hook)]
    return found


@contextlib.contextmanager
def input_require_grads_ignored(model: Any) -> Iterator[None]:
    """``model``'s ``make_inputs_require_grads`` hooks swapped for a no-op for the duration (see the module
    docstring), where :func:`_no_reentrant_checkpointing` holds; otherwise nothing changes."""
    swapped = _input_require_grads_hooks(model) if isinstance(model, torch.nn.Module) else []
    if swapped:
        key = tuple((id(hooks), k, id(hook)) for hooks, k, hook in swapped)
        verdict = _VERDICTS.get(model)
        if verdict is None or verdict[0] != key:
            verdict = (key, _no_reentrant_checkpointing(model))
            _VERDICTS[model] = verdict
        if not verdict[1]:
            swapped = []
    for hooks, k, _ in swapped:
        hooks[k] = _no_op_hook
    try:
        yield
    finally:
        for hooks, k, hook in swapped:
            if hooks.get(k) is _no_op_hook:
                hooks[k] = hook
