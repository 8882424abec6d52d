"""Padding-free calls (``FuserConfig.padding_free``): a padded batch runs as one packed row of its real tokens.

A collator pads every row of a batch to the longest one, and the model then spends its per-token work
(projections, norms, MLP, lm_head and loss) on pad tokens too. With ``padding_free`` on, each call of a model
compiled by :func:`fuser.optimize` or :func:`fuser.optimize_` that carries an ``attention_mask`` with padding is
rewritten before the compiled forward runs:

- ``input_ids`` ``[B, T]`` become ``[1, N]``: the real tokens of every row, row after row (``N`` is the number of
  ones in the mask);
- ``position_ids`` are the ones the padded call uses for those tokens: the caller's, or else ``0 .. T-1`` along each
  row (what transformers' decoder models compute when none are given), gathered the same way: they restart at every
  right-padded row's first token, and a left-padded row keeps the positions its padded run gives it;
- ``labels`` are gathered the same way, with the first token of each row set to ``-100``, so that the label shift
  of the causal-LM loss never makes one document's last token predict the next document's first;
- ``attention_mask`` is dropped and ``use_cache=False`` passed: transformers' mask functions then read the
  documents from where ``position_ids`` stop counting up by one (``masking_utils.find_packed_sequence_indices``),
  and build a block-diagonal causal mask. They do so only without a 2-D mask and without a cache: the model's config
  defaults ``use_cache`` to ``True``, which would build a cache and a plain causal mask across the documents;
- outputs of the packed length are scattered back to the batch's shape, zeros at the pad positions: ``logits``
  ``[1, N, V]`` → ``[B, T, V]`` (when the graph returns them: fuser's fused loss does not build them in training),
  and per-token outputs of the shifted length ``[1, N-1]`` (TRL's fused LM head) → ``[B, T-1]``.

The loss is the padded call's: the same tokens predict the same labels, over the same count (``num_items_in_batch``
is passed on unchanged), and no token attends to another row's. The call declines, runs padded, and says why once
per model and reason (logger ``"fuser"``, ``fuser.report(model).padding_free``) where that cannot be shown:

- of the model, once per attention implementation: an implementation other than ``sdpa`` or ``eager``; a forward
  without ``position_ids``; a loss other than transformers' per-token causal-LM loss; MoE router logits or hidden
  states asked for by its config; or a probe that fails. The probe runs the model eagerly once on two documents of
  three tokens packed in one row and takes the gradient of the second document's outputs with respect to the
  embedding output: it must be exactly zero at the first document's tokens (a mask that lets them attend to each
  other gives a non-zero gradient, in any precision) and non-zero at the second's. A second probe compares a
  left-padded row run with and without explicit ``position_ids = 0 .. T-1``; a model that computes its own positions
  otherwise (from the mask, as OPT does) declines left-padded rows unless the caller passes ``position_ids``;
- of the call: positional arguments; an argument it does not know (``inputs_embeds``, ``token_type_ids``, pixel
  inputs, ``shift_labels``, ...); ``output_hidden_states``, ``output_attentions``, ``output_router_logits``,
  ``use_cache=True``, a cache, ``return_dict=False``, ``logits_to_keep``;
- of the batch: a mask that is not 0/1, or a row whose real tokens are not one contiguous run; ``position_ids`` that
  do not count up by one inside a row (a padded row that already holds several documents: the padded run lets them
  attend to each other); two rows whose positions would read as one document (a right-padded row followed by a
  left-padded one that starts where it stopped); labels that make the padded loss read a pad position's logits
  (the label after a pad token is not ``-100``: with left padding and labels copied from ``input_ids``, the last pad
  token predicts the first real one).

No attention mask, or one without padding, runs as given (nothing to remove).

Costs: the mask, labels and positions are read on the host once per call (one device synchronisation, a copy of
``[B, T]`` integers); a probe of a few tokens the first time a model runs. The packed graph's attention takes a mask
built from ``position_ids`` (an input-dependent bool mask: ``causal_attention.block_sparse_masks`` runs it on
FlexAttention on a GPU), and the packed length changes every batch: Dynamo compiles the first length statically and
the second with a symbolic length, which then serves every later batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

log = logging.getLogger("fuser")

IGNORE_INDEX = -100
# attention implementations whose transformers mask functions build the packed mask from position_ids
PACKED_MASK_ATTENTION = ("sdpa", "eager")
# what a packed call passes on (with fused_lm_head, TRL's chunked LM head); a value that would change what the
# packed call computes declines below
_KNOWN_ARGUMENTS = frozenset(
    {
        "input_ids",
        "attention_mask",
        "labels",
        "position_ids",
        "num_items_in_batch",
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "cache",
        "past_key_values",
        "logits_to_keep",
        "fused_lm_head",
    }
)


@dataclass
class PaddingFreeStats:
    """What ``padding_free`` did in the calls of the models compiled through one backend (``fuser.report``).

    packed:        calls run packed.
    real_tokens:   tokens those calls ran (the ones in their masks).
    padded_tokens: tokens those calls would have run padded (``B * T``).
    declined:      why a call ran padded → how many calls ran padded for it.
    """

    packed: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    declined: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        saved = 1 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0
        line = f"padding_free: {self.packed} call(s) packed ({saved:.0%} of their padded tokens not run)"
        for reason, calls in self.declined.items():
            line += f"\n  ran padded ({calls} call(s)): {reason}"
        return line


class Packed(NamedTuple):
    """A call rewritten: the keyword arguments of the packed call, and where its tokens were in the batch."""

    kwargs: dict[str, Any]
    index: torch.Tensor  # [N]: each packed token's flat position in the batch's [B * T]
    shape: tuple[int, int]  # (B, T)


class Decline(Exception):
    """This call runs padded, for the reason given."""


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside ``model``: through DDP/FSDP's ``.module`` and peft's ``get_base_model``."""
    for _ in range(8):
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        else:
            break
    return model


def _forward_parameters(model: torch.nn.Module) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


class PaddingFree:
    """The per-model state of ``padding_free``: the model's verdict (per attention implementation), the reasons
    already told, and the statistics it adds to.

    ``eager`` calls the model's forward uncompiled (the probe runs there); ``stats`` is the backend's record."""

    def __init__(self, model: torch.nn.Module, eager: Callable[..., Any], stats: PaddingFreeStats) -> None:
        self.model = model
        self.eager = eager
        self.stats = stats
        self._verdicts: dict[Any, str | None] = {}  # attention implementation → why the model declines, or None
        self._positions_from_arange: dict[Any, bool] = {}  # the model's default positions are 0 .. T-1
        self._told: set[str] = set()

    # the call
    def __call__(self, call: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        try:
            packed = self.pack(args, kwargs)
        except Decline as why:
            self._decline(str(why))
            return call(*args, **kwargs)
        if packed is None:
            return call(*args, **kwargs)
        self.stats.packed += 1
        self.stats.real_tokens += int(packed.index.numel())
        self.stats.padded_tokens += packed.shape[0] * packed.shape[1]
        return unpack(call(**packed.kwargs), packed)

    def _decline(self, reason: str) -> None:
        self.stats.declined[reason] = self.stats.declined.get(reason, 0) + 1
        if reason not in self._told:
            self._told.add(reason)
            log.warning("fuser: padding_free: this batch runs padded: %s", reason)

    def pack(self, args: tuple, kwargs: dict[str, Any]) -> Packed | None:
        """The packed call for ``model(*args, **kwargs)``; ``None`` where there is no padding to remove; raises
        :class:`Decline` where packing is not shown to compute what the padded call does."""
        mask = kwargs.get("attention_mask")
        if mask is None:
            return None
        if args:
            raise Decline("the model is called with positional arguments (pass them by name)")
        unknown = sorted(set(kwargs) - _KNOWN_ARGUMENTS)
        if unknown:
            raise Decline(f"the call passes {unknown}, which packing does not know how to gather")
        base = _base_model(self.model)
        config = getattr(base, "config", None)
        for name in ("output_hidden_states", "output_attentions", "output_router_logits"):
            if kwargs.get(name) or (kwargs.get(name) is None and getattr(config, name, False)):
                raise Decline(f"{name} is on: those outputs are per row and per layer of the padded batch")
        if kwargs.get("use_cache"):
            raise Decline("use_cache=True: a cache is built for the padded rows")
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            raise Decline("a cache is given (generation): its rows are the padded batch's")
        if kwargs.get("return_dict") is False:
            raise Decline("return_dict=False: the outputs to scatter back are not named")
        if kwargs.get("logits_to_keep") not in (None, 0):
            raise Decline("logits_to_keep is set: the positions it keeps are the padded rows'")
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise Decline("input_ids is not a [batch, length] tensor")
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape):
            raise Decline("attention_mask is not a [batch, length] mask of input_ids' shape")
        labels = kwargs.get("labels")
        if labels is not None and (not isinstance(labels, torch.Tensor) or labels.shape != ids.shape):
            raise Decline("labels are not of input_ids' shape")
        positions = kwargs.get("position_ids")
        if positions is not None and (
            not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.shape[-1] != ids.shape[-1]
        ):
            raise Decline("position_ids are not a [batch, length] tensor")
        model_reason = self._model_reason(base, config)
        if model_reason is not None:
            raise Decline(model_reason)
        return self._gather(ids, mask, labels, positions, kwargs, self._default_positions_ok(config))

    def _gather(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        labels: torch.Tensor | None,
        positions: torch.Tensor | None,
        kwargs: dict[str, Any],
        arange_positions: bool,
    ) -> Packed | None:
        """Check the batch on the host (one copy of its small integer tensors) and gather its real tokens."""
        batch, length = ids.shape
        host_mask = mask.detach().to("cpu")
        if not bool(((host_mask == 0) | (host_mask == 1)).all()):
            raise Decline("attention_mask holds values other than 0 and 1")
        real = host_mask.bool()
        if bool(real.all()):
            return None  # nothing is padded
        before = torch.nn.functional.pad(real[:, :-1], (1, 0), value=False)  # the token before is real
        starts = real & ~before
        if bool((starts.sum(1) > 1).any()):
            raise Decline("a row's real tokens are not one contiguous run (a hole in the attention mask)")
        if not bool(real.any()):
            raise Decline("no row has a real token")
        if positions is None:
            if not arange_positions and bool((~real[:, 0] & real.any(1)).any()):
                raise Decline(
                    "a left-padded row, and this model does not compute positions 0 .. T-1 by default; pass "
                    "position_ids, or pad on the right"
                )
            host_positions = torch.arange(length).expand(batch, length)
        else:
            host_positions = positions.detach().to("cpu").expand(batch, length)
            # inside a run the positions count up by one, else the padded row holds several documents that its
            # padded run lets attend to each other
            step = host_positions[:, 1:] - host_positions[:, :-1]
            if bool(((step != 1) & real[:, 1:] & real[:, :-1]).any()):
                raise Decline(
                    "position_ids do not count up by one inside a row: the row holds several documents, which the "
                    "padded run lets attend to each other"
                )
        flat = real.flatten()
        index = flat.nonzero().squeeze(1)
        packed_positions = host_positions.flatten()[index]
        first = starts.flatten()[index]  # [N]: each document's first token
        step = packed_positions[1:] - packed_positions[:-1]
        if bool((first[1:] & (step == 1)).any()):
            raise Decline(
                "one row's positions continue the previous row's, so the two would read as one document (a "
                "right-padded row followed by a left-padded one)"
            )
        if labels is not None:
            host_labels = labels.detach().to("cpu")
            # the padded loss: position t predicts label t + 1; it reads a pad position's logits where t is a pad
            # and label t + 1 is not ignored (and t + 1 always is a real token or a pad: a pad's label must be -100)
            reads_pad = (host_labels[:, 1:] != IGNORE_INDEX) & ~(real[:, :-1] & real[:, 1:])
            if bool(reads_pad.any()):
                raise Decline(
                    "the padded loss reads a pad position's logits (a label after a pad token is not -100, e.g. "
                    "left padding with labels copied from input_ids): packing cannot reproduce that term"
                )
        device = ids.device
        device_index = index.to(device)
        packed: dict[str, Any] = {k: v for k, v in kwargs.items() if k != "attention_mask"}
        packed["input_ids"] = ids.flatten()[device_index][None]
        packed["position_ids"] = packed_positions.to(device=device, dtype=torch.long)[None]
        packed["use_cache"] = False
        if labels is not None:
            gathered = labels.flatten()[index.to(labels.device)]
            gathered = gathered.masked_fill(first.to(labels.device), IGNORE_INDEX)
            packed["labels"] = gathered[None]
        return Packed(packed, device_index, (batch, length))

    # the model
    def _model_reason(self, base: torch.nn.Module, config: Any) -> str | None:
        """Why this model cannot run packed (``None``: it can), decided once per attention implementation."""
        implementation = getattr(config, "_attn_implementation", None)
        if implementation in self._verdicts:
            return self._verdicts[implementation]
        reason = self._static_reason(base, config, implementation)
        if reason is None:
            reason, arange = self._probe(base, config)
            self._positions_from_arange[implementation] = arange
        self._verdicts[implementation] = reason
        return reason

    def _default_positions_ok(self, config: Any) -> bool:
        return self._positions_from_arange.get(getattr(config, "_attn_implementation", None), False)

    @staticmethod
    def _static_reason(base: torch.nn.Module, config: Any, implementation: Any) -> str | None:
        if config is None:
            return "the model has no transformers config"
        if implementation not in PACKED_MASK_ATTENTION:
            return (
                f"attention implementation {implementation!r}: fuser proves the packed mask only for "
                f"{PACKED_MASK_ATTENTION}, whose transformers mask functions build it from position_ids"
            )
        if "position_ids" not in _forward_parameters(base):
            return f"{type(base).__name__}.forward takes no position_ids"
        loss = getattr(base, "loss_function", None)
        if getattr(loss, "__name__", None) != "ForCausalLMLoss":
            name = getattr(loss, "__name__", loss)
            return f"the model's loss ({name!r}) is not transformers' per-token causal-LM loss"
        if not getattr(config, "is_causal", True):
            return "the model's config is not causal (is_causal=False)"
        return None

    def _probe(self, base: torch.nn.Module, config: Any) -> tuple[str | None, bool]:
        """(why the model does not keep packed documents apart, or ``None``; whether its default positions are
        ``0 .. T-1``), from a few tokens run eagerly (module docstring). The random number generators are left as
        they were (dropout may be on)."""
        embedding = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        if not isinstance(embedding, torch.nn.Module):
            return "the model has no input embedding to probe", False
        weight = next(embedding.parameters(), None)
        device = weight.device if weight is not None else torch.device("cpu")
        vocab = int(getattr(config, "vocab_size", 0) or getattr(embedding, "num_embeddings", 0))
        if vocab < 2:
            return "the model's vocabulary size is unknown", False
        ids = (torch.arange(6, device=device) * 7 + 3) % vocab
        devices = [device] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), torch.enable_grad():
                leak = self._cross_document_gradient(embedding, ids[None], device)
                if leak is not None:
                    return leak, False
                return None, self._defaults_to_arange(ids[None, :4], device)
        except Exception as error:  # noqa: BLE001 - a model the probe cannot run is a model not shown exact
            return f"the probe of the packed mask failed ({type(error).__name__}: {error})", False

    def _cross_document_gradient(self, embedding: torch.nn.Module, ids: torch.Tensor, device: torch.device):
        captured: list[torch.Tensor] = []

        def keep(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
            output = output.detach().requires_grad_(True)
            captured.append(output)
            return output

        handle = embedding.register_forward_hook(keep)
        try:
            positions = torch.tensor([[0, 1, 2, 0, 1, 2]], device=device)
            out = self.eager(input_ids=ids, position_ids=positions, use_cache=False)
        finally:
            handle.remove()
        logits = getattr(out, "logits", None)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or len(captured) != 1:
            return "the probe found no logits, or not one embedding output"
        second = logits[0, 3:].float()
        weights = torch.randn(second.shape, generator=torch.Generator().manual_seed(0)).to(device)
        (grad,) = torch.autograd.grad((second * weights).sum(), captured[0])
        if bool((grad[0, :3] != 0).any()):
            return (
                "the model's attention lets packed documents attend to each other (its mask does not follow "
                "position_ids)"
            )
        if not bool((grad[0, 3:] != 0).any()):
            return "the probe's outputs do not depend on their own tokens"
        return None

    def _defaults_to_arange(self, ids: torch.Tensor, device: torch.device) -> bool:
        """Whether a left-padded row gives the same logits with and without ``position_ids = 0 .. T-1`` (the same
        dropout draws for both: the generators are seeded the same)."""
        mask = torch.tensor([[0, 1, 1, 1]], device=device)
        outs = []
        for positions in (None, torch.arange(4, device=device)[None]):
            torch.manual_seed(0)
            with torch.no_grad():
                extra = {} if positions is None else {"position_ids": positions}
                outs.append(self.eager(input_ids=ids, attention_mask=mask, use_cache=False, **extra).logits[:, 1:])
        return bool(torch.equal(outs[0], outs[1]))


def unpack(out: Any, packed: Packed) -> Any:
    """``out`` with its per-token tensors of the packed call scattered back to the batch's shape (zeros at the pad
    positions): ``[1, N, ...]`` → ``[B, T, ...]``, and the shifted ``[1, N - 1, ...]`` → ``[B, T - 1, ...]``."""
    if not hasattr(out, "keys"):
        return out
    batch, length = packed.shape
    tokens = packed.index.numel()
    for name in list(out.keys()):
        value = out[name]
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[0] != 1:
            continue
        if value.shape[1] == tokens:
            out[name] = _scatter(value[0], packed.index, batch * length).view(batch, length, *value.shape[2:])
        elif value.shape[1] == tokens - 1 and tokens > 1:
            # position t of a shifted output predicts token t + 1: kept where t is not a row's last column
            index = packed.index[:-1]
            keep = (index % length) != length - 1
            rows, columns = index // length, index % length
            target = rows * (length - 1) + columns
            value = value[0][keep]
            out[name] = _scatter(value, target[keep], batch * (length - 1)).view(batch, length - 1, *value.shape[1:])
    return out


def _scatter(values: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    full = values.new_zeros((rows, *values.shape[1:]))
    return full.index_copy(0, index.to(values.device), values)


def wrap(compiled: torch.nn.Module, eager: Callable[..., Any], model: torch.nn.Module, stats: PaddingFreeStats):
    """Make every call of ``compiled`` (what ``optimize`` returned, or the module ``optimize_`` compiled) go
    through a :class:`PaddingFree` of ``model``; returns it."""
    from fuser import _compat

    packer = PaddingFree(model, eager, stats)

    def around(inner: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            return packer(inner, args, kwargs)

        return call

    _compat.wrap_compiled_call(compiled, around)
    return packer
