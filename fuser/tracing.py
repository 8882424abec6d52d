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

Only Dynamo's tracing of fuser's own compiled calls is affected: the setting is entered around each call and
restored after it, never at import and never for other compiled code. ``torch.compile(model, backend="fuser")``
gives a backend no way to wrap its calls: there the break stays, and ``fuser.explain`` (with
``FuserConfig(ignore_logging=False)``) or ``fuser.report()`` shows the loss declined for it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fuser import _compat

if TYPE_CHECKING:
    from fuser.config import FuserConfig

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
