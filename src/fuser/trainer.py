"""``fuser.FuserCallback``: what fuser fused, in a ``transformers.Trainer`` (or TRL trainer) run.

    fuser.optimize_(model)                                            # the integration: in place
    trainer = Trainer(model=model, ..., callbacks=[fuser.FuserCallback()])

The callback compiles nothing itself. At the start of training it shows fuser's log lines (one per compiled
graph: what fused, how long it took) unless the Trainer's ``log_level`` asks for warnings only. After the first
step it checks that the model the trainer calls went through fuser, and warns if nothing was compiled, naming
the cause: Dynamo gave up on the model's code (its recompile limit, as ``FuserBackend.gave_up`` recorded), or else
the model was wrapped after ``optimize_``, e.g. by ``SFTTrainer(peft_config=...)`` (apply ``optimize_`` to
``trainer.model`` then); and it warns where Dynamo gave up on a function of the model's own source files in that step
and ran it eagerly (nothing in it fused; a library's function, such as TRL's chunked loss, is not the model's). Its
first log after compiling adds ``fuser/<pattern>`` counts to the Trainer's logs. At the first step it warns where
the collator packs sequences into rows while the model's config has ``use_cache=True`` (transformers then lets each
sequence attend to the ones packed before it).
"""

from __future__ import annotations

import inspect
import logging
import warnings
from typing import Any

import torch
from transformers import DataCollatorWithFlattening, TrainerCallback

from fuser import _compat, dynamo_backend
from fuser.report import skipped_frame_text

log = logging.getLogger("fuser")
_QUIET_LEVELS = ("warning", "error", "critical")


def _backend_of(model: torch.nn.Module | None) -> dynamo_backend.FuserBackend | None:
    """The fuser backend the trainer's model (or a module inside it, or the module it wraps) is compiled with."""
    if model is None:
        return None
    for module in (getattr(model, "_orig_mod", model), *model.modules()):
        found = dynamo_backend._MODEL_BACKENDS.get(module)
        if found is not None:
            return found
    return None


class FuserCallback(TrainerCallback):
    """Shows what fuser fused in a Trainer run, and warns when the trainer's model bypasses fuser."""

    def __init__(self) -> None:
        self._checked = False
        self._checked_collator = False
        self._logged_counts = False
        self._handler: logging.Handler | None = None
        self._messages_before: dict[str, int] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if getattr(args, "log_level", "passive") not in _QUIET_LEVELS and not log.handlers:
            self._handler = logging.StreamHandler()
            self._handler.setFormatter(logging.Formatter("%(message)s"))
            log.addHandler(self._handler)
            log.setLevel(logging.INFO)
        self._messages_before = _compat.dynamo_graph_break_messages()
        found = _backend_of(model)
        if found is None:
            warnings.warn(
                "fuser: the trainer's model was not given to fuser.optimize_, so nothing will be fused; call "
                "fuser.optimize_(trainer.model) before trainer.train()",
                RuntimeWarning,
                stacklevel=2,
            )
            self._checked = True

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        # at the first step: the trainer hands its dataloader to callbacks only after on_train_begin
        if not self._checked_collator:
            self._checked_collator = True
            self._warn_if_packed_rows_attend_across(model, kwargs.get("train_dataloader"))

    @staticmethod
    def _warn_if_packed_rows_attend_across(model: Any, loader: Any) -> None:
        """A collator that packs sequences into rows (``DataCollatorWithFlattening``, TRL's ``padding_free``) and a
        model config with ``use_cache=True``: transformers reads packed ``position_ids`` as separate sequences only
        where no cache is passed; with one (created from ``use_cache``) it builds one causal mask over the row, and
        each sequence attends to those packed before it, compiled or not."""
        collator = getattr(loader, "collate_fn", None)
        for _ in range(4):  # the trainer's wrappers (RemoveColumnsCollator) keep the user's as ``data_collator``
            collator = getattr(collator, "data_collator", collator)
        packs = isinstance(collator, DataCollatorWithFlattening) or getattr(collator, "padding_free", False) is True
        if packs and getattr(getattr(model, "config", None), "use_cache", False):
            warnings.warn(
                "fuser: the data collator packs several sequences into each row, and the model's config has "
                "use_cache=True, so transformers masks each row as one sequence: every sequence attends to the "
                "ones packed before it (with or without fuser). Set model.config.use_cache = False before "
                "trainer.train().",
                RuntimeWarning,
                stacklevel=3,
            )

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self._checked:
            return
        self._checked = True
        found = _backend_of(model)
        if found is None:
            return
        skipped = self._skipped_frames(model)
        if not found.results:
            # nothing compiled: say why where Dynamo said it (it gave up on the model's code), else the usual cause
            if found.gave_up:
                warnings.warn(
                    "fuser: the first training step compiled no graph through fuser: "
                    + "; ".join(found.gave_up.values())
                    + ".",
                    RuntimeWarning,
                    stacklevel=2,
                )
            elif not skipped:
                warnings.warn(
                    "fuser: the first training step compiled no graph through fuser: the trainer calls the model "
                    "around the compiled module (it was wrapped after fuser.optimize_). Call "
                    "fuser.optimize_(trainer.model) after building the trainer.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if skipped:
            where = "; ".join(text for _, text in sorted(skipped.items()))
            warnings.warn(
                f"fuser: in the first training step Dynamo gave up on code of the model and ran it eagerly, so "
                f"nothing in it was fused: {where}. fuser.explain(model, **batch) lists Dynamo's messages, and "
                "TORCH_LOGS=graph_breaks shows the full reason.",
                RuntimeWarning,
                stacklevel=2,
            )

    def _skipped_frames(self, model: torch.nn.Module) -> dict[tuple[str, str, int], str]:
        """The functions of the model's own source files that Dynamo skipped (ran eagerly) since training began, each
        as ``fuser.explain`` names it (:func:`fuser.report.skipped_frame_text`), by frame."""
        files = set()
        for module in model.modules():
            try:
                files.add(inspect.getsourcefile(type(module)))
            except TypeError:  # a class without a source file (built in)
                continue
        skipped: dict[tuple[str, str, int], str] = {}
        for message in _compat.dynamo_messages_since(self._messages_before):
            for frame in _compat.dynamo_skipped_frames(message):
                if frame[1] in files:
                    skipped.setdefault(frame, skipped_frame_text(frame, message))
        return skipped

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, model: Any = None, **kw: Any):
        found = _backend_of(model)
        if self._logged_counts or logs is None or found is None or not found.results:
            return
        self._logged_counts = True
        counts = {f"fuser/{name}": count for name, count in sorted(found.counts.items())}
        logs.update(counts)  # what the printing and reporting callbacks after this one see
        if state.log_history:  # the Trainer stored a copy of these logs before calling back
            state.log_history[-1].update(counts)
        log.info(
            "fuser: fused %s in %d graph(s), %.1f s compiling", found.counts, len(found.results), found.compile_seconds
        )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._handler is not None:
            log.removeHandler(self._handler)
            self._handler = None
