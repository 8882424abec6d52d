"""FuserConfig: every knob of the optimizer, as one frozen (hashable) dataclass.

Each option is described once, by the docstring written under its field (here, and in each pattern's options
dataclass, which the pattern names as its ``Pattern.options`` and which FuserConfig holds once the pattern is
registered). :mod:`fuser.options_reference` renders them as FuserConfig's docstring and as ``docs/options.md``
(``python scripts/options_doc.py`` writes it, and ``tests/test_options_doc.py`` fails when it is out of date).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any

from fuser import options_reference as reference
from fuser.engine.protocol import registered_options
from fuser.options import SectionedOptions, build, nest_dotted, reserve_names
from fuser.patterns import PATTERNS

INNER_COMPILERS = ("inductor", "aot_eager", "eager")

__all__ = ["INNER_COMPILERS", "ExperimentalConfig", "FuserConfig", "options_reference"]


@dataclass(frozen=True, init=False, repr=False)
class ExperimentalConfig(SectionedOptions):
    """``FuserConfig.experimental``: the switches kept to compare implementations, fuser's own and each registered
    pattern's (``Pattern.experimental_options``); ``FuserConfig``'s description of the field says what they are."""

    _PATH = "experimental"

    direct_calls: bool = True
    """Inductor's compiled graphs call the fused ops through their ``direct`` overloads: the same functions, schema
    and fake, without the custom-op wrapper and autograd kernel, which graphs past AOT autograd never use. It saves
    host time on every call (``src/fuser/inductor/direct_calls.py``)."""

    embedding_grads: bool = True
    """An embedding's weight gradient, and a tied lm_head's gradient added to it, are written by one op
    (``fuser::embedding_grad``, put in by a post-grad pass) in one pass over ``[vocab, hidden]``: the batch's ids
    sorted, each row summing its tokens' gradients in fp32 in token order, so the result is the same every run.
    Inductor instead zero-fills an fp32 buffer, scatters into it with atomics, and reads it back to add and cast
    (``src/fuser/inductor/embedding_grads.py``)."""

    def __post_init__(self) -> None:
        for name in ("direct_calls", "embedding_grads"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"fuser: experimental.{name} must be True or False, got {value!r}")

    @classmethod
    def sections(cls) -> dict[str, type]:
        """The registered patterns' experimental options classes (``Pattern.experimental_options``), by name."""
        return registered_options(experimental=True)

    @classmethod
    def _misplaced(cls, path: str) -> str:
        return FuserConfig._misplaced(f"experimental.{path}")


def _names(cls: type[SectionedOptions], path: str) -> bool:
    """Whether ``path`` (``"strict"``, ``"gated_mlp"``, ``"gated_mlp.recompute_for_down_weight"``) names an option
    of ``cls``."""
    head, _, rest = path.partition(".")
    if not rest:
        return head in cls.option_names()
    section = cls.sections().get(head)
    return section is not None and "." not in rest and rest in {f.name for f in dataclasses.fields(section)}


@dataclass(frozen=True, init=False, repr=False)
class FuserConfig(SectionedOptions):
    """What fuser rewrites and what compiles the result: a frozen dataclass, validated when built.

    Each field is described by the docstring written under it (a pattern's options under their own dataclass's
    fields); the list below and ``docs/options.md`` are generated from those descriptions. Besides its own fields
    it holds the options of each registered pattern (``Pattern.options``), read as ``config.<name>.<field>``, and in
    ``experimental`` the switches kept to compare implementations. Give a pattern's options as its dataclass, as a
    dict of its fields (the fields left out keep their defaults) or, through ``options=``, by dotted names:
    ``FuserConfig(gated_mlp={"recompute_for_down_weight": False})``, or by name from a trainer:
    ``torch.compile(model, backend="fuser", options={"causal_attention.block_sparse_masks": False})``.
    """

    patterns: tuple[str, ...] | None = None
    """Names of the patterns to apply (the keys of ``fuser.explain(...).counts``). ``None`` applies every registered
    pattern that is on by default (``fuser.DEFAULT_PATTERNS`` names them); a tuple applies only the names in it, so
    leaving a name out turns that block off."""

    inner_compiler: str = "inductor"
    """What compiles the rewritten graph: ``"inductor"``, ``"aot_eager"`` or ``"eager"``. Inductor also optimises
    everything fuser leaves unfused, and only it runs the post-grad passes (the fused ops' backward refinements,
    ``inline_ops``, ``cuda_graphs``); the other two are for debugging."""

    keep_logits: bool = False
    """When a training graph returns the logits it computes the loss from, keep them: the ``linear_cross_entropy``
    pattern then leaves that loss unfused. ``False``: the loss is fused, the ``[tokens, vocab]`` logits are never
    computed, and the graph returns ``None`` in their place (``outputs.logits is None``). Evaluation (no gradient
    wanted) always returns the logits."""

    strict: bool = False
    """Raise ``fuser.FuserError`` instead of warning and compiling the unrewritten graph when a rewrite fails.
    Tests use it, so that a silent fallback cannot pass."""

    ignore_logging: bool = True
    """While Dynamo traces the calls that ``fuser.optimize``, ``optimize_`` and ``explain`` compile, skip the
    ``logging.Logger`` methods that print a message at most once (transformers' ``warning_once``, ``info_once``)
    instead of breaking the graph there: a GPT-2-style model's ``loss_function`` logs one between its lm_head and its
    loss, which then could not fuse across the break. Their message is then not printed by compiled code. Scoped to
    those calls (``fuser.tracing``), never set globally; ``torch.compile(m, backend="fuser")`` gives fuser no hook
    around its calls, so there the break stays."""

    checkpoint_side_effects: bool = True
    """While Dynamo traces those same calls, a gradient-checkpointed layer that changes Python state is traced, not
    run eagerly (Dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint``): the change is applied once, in the
    forward, and not replayed when the backward recomputes the layer. transformers >= 5.25 with the ``kernels`` package
    sets and restores a context variable in each attention layer's forward, so without this every checkpointed decoder
    layer runs eagerly and nothing in it fuses (TRL's ``SFTTrainer`` checkpoints by default). Set ``False`` for a
    model whose checkpointed layers need a side effect replayed. Scoped like ``ignore_logging``; under
    ``torch.compile(m, backend="fuser")`` set the Dynamo flag yourself."""

    ignore_input_require_grads: bool = True
    """While Dynamo traces those same calls, the forward hook that transformers' ``gradient_checkpointing_enable``
    (and peft) put on the input embeddings, ``output.requires_grad_(True)``, is replaced by one that does nothing,
    where every checkpointed layer of the model checkpoints without reentrancy (``use_reentrant=False``,
    transformers' default) or nothing is checkpointed. Dynamo cannot trace that call on a frozen embedding's output:
    it gives up on the whole forward and traces each nested frame again, several times the compile time of a LoRA
    model with gradient checkpointing. The hook exists for reentrant checkpointing, whose layers get no gradients
    unless their input requires one; without reentrancy every parameter's gradient is the same without it. The
    hook is put back after each call. Under DeepSpeed ZeRO-3 with the decoder layers as leaf modules it stays: a
    leaf's gradients are collected only when its input needs one. Scoped like ``ignore_logging``."""

    inline_ops: bool = True
    """Inductor launches the fused ops' Triton kernels from its generated code: each call in a compiled GPU graph is
    replaced, at compile time, by what its Python body does for those shapes (its buffers and kernel launches), so
    no op body runs per call. Same kernels, same arguments. It helps a step whose host cannot launch kernels as fast
    as the GPU runs them, leaves a GPU-bound one as it was, and costs compile time. A call that might not compute the
    same inlined (it writes an input or part of a buffer, its shapes are dynamic, its tensors are not on a GPU) stays
    a call; ``fuser.report(model).not_inlined`` says why (``fuser.inductor.inline_ops``). ``False`` keeps every
    call, e.g. to compare or to debug a kernel from Python."""

    cuda_graphs: bool = False
    """Inductor records the compiled forward and backward graphs as CUDA graphs and replays them (its
    ``triton.cudagraphs``, what ``mode="reduce-overhead"`` turns on), so a step costs the host microseconds instead of
    a launch per kernel: for steps the host cannot launch as fast as the GPU runs them. The costs: more GPU memory
    (the graphs' own pool), one recording per new input shape (pad batches to a few fixed lengths), and a replay
    overwrites the last step's outputs (``.clone()`` what is kept; a loop that does not run forward then backward each
    step calls ``torch.compiler.cudagraph_mark_step_begin()`` first). A graph Inductor will not record (CPU tensors,
    an input mutated in place) runs as before; fuser warns where Inductor declines the forward
    (``TORCH_LOGS=cudagraphs`` shows every graph declined). Needs ``inner_compiler="inductor"``. Gradient
    accumulation works: where ``.grad`` was ``None``, autograd keeps the backward replay's output buffer itself as
    ``.grad``, so fuser copies such a ``.grad`` out of the graphs' memory before the next call replays over it
    (``src/fuser/inductor/graph_pool_grads.py``); a step without accumulation copies nothing."""

    zero3_leaf_layers: bool = True
    """Where DeepSpeed is installed, ``fuser.optimize_`` marks the model's decoder layers (the
    entries of its outermost ``nn.ModuleList`` of one repeated class) as DeepSpeed ZeRO-3 leaf modules, unless one is
    marked either way already: ZeRO-3 then gathers a layer's parameters together, with one hook, and the layer
    reaches fuser as one graph (otherwise each submodule's hook breaks the graph and no block in the layer fuses).
    Without ZeRO-3 nothing reads the flag. ``fuser.optimize`` leaves the user's model unmarked and warns at its first
    call under ZeRO-3 (``src/fuser/zero3.py``)."""

    zero3_lm_head: bool = True
    """Under DeepSpeed ZeRO-3, the lm_head's weight is gathered by the hook of the module that calls it (the causal
    LM, whose forward computes the loss) and DeepSpeed's hooks on the lm_head module are removed, at the first call
    of a model from ``optimize_``/``optimize``: those hooks end the graph before and after the lm_head, so the loss's
    logits would be an input of its graph and the loss would not fuse (``linear_cross_entropy``), its whole logits
    kept. The cost: one ``[vocab, hidden]`` weight stays gathered for the step's forward and backward (DeepSpeed
    keeps such an external parameter until the step ends) (``src/fuser/zero3.py``)."""

    padding_free: bool = False
    """A call with padding in its ``attention_mask`` runs as one packed row of its real tokens: ``input_ids``
    ``[B, T]`` become ``[1, N]``, with the padded call's ``position_ids`` gathered alongside (restarting at each
    right-padded row) and ``labels`` gathered with each row's first one ignored, the mask dropped and
    ``use_cache=False``, so that transformers builds a block-diagonal causal mask from the positions; ``logits``
    (where returned) come back as ``[B, T, V]`` with zeros at the pad positions. The per-token work (projections,
    norms, MLP, lm_head and loss) then runs on real tokens only; the loss, ``num_items_in_batch`` and every gradient
    are the padded call's. Only through ``fuser.optimize`` / ``optimize_`` (the backend alone sees graphs, not
    batches). It assumes a transformers causal LM with ``sdpa`` or ``eager`` attention and the per-token causal-LM
    loss; the first call probes, eagerly on six tokens, that packed documents do not attend to each other (an exact
    zero gradient across them). Each call reads the mask, labels and positions on the host (one device
    synchronisation); every batch has another packed length, so Dynamo compiles a second, dynamic-length graph at the
    second batch; the packed graph's attention takes a mask built from the positions
    (``causal_attention.block_sparse_masks`` runs it on FlexAttention on a GPU, in the dynamic-length graph too).
    Where packing is not shown exact the
    call runs padded and fuser says why once (logger ``"fuser"``, ``fuser.report(model).padding_free``): hidden
    states, attentions, router logits or a cache asked for, ``inputs_embeds`` or other inputs it cannot gather (pixel
    inputs, ``token_type_ids``), a mask with holes, labels that make the padded loss read a pad position, another
    attention implementation, a model whose mask ignores ``position_ids`` (``src/fuser/padding_free.py`` lists every
    case). Off by default: measured on a GPU only on a cut-down model (``docs/defaults.md``)."""

    experimental: ExperimentalConfig = field(default_factory=ExperimentalConfig)
    """Switches kept to compare implementations, which may change or go away in any release. Each default won a
    measurement (``docs/defaults.md`` says which), and the other setting stays so that the measurement can be run
    again, or a kernel debugged, not for users to tune. Set them as
    ``options={"experimental": {"direct_calls": False}}`` or by dotted name,
    ``options={"experimental.gated_mlp.backward_in_place": False}``; a pattern declares its own as
    ``Pattern.experimental_options``."""

    def __post_init__(self) -> None:
        if not isinstance(self.inner_compiler, str) or self.inner_compiler not in INNER_COMPILERS:
            raise ValueError(f"fuser: inner_compiler must be one of {INNER_COMPILERS}, got {self.inner_compiler!r}")
        for name in (
            "keep_logits",
            "strict",
            "ignore_logging",
            "checkpoint_side_effects",
            "ignore_input_require_grads",
            "inline_ops",
            "cuda_graphs",
            "zero3_leaf_layers",
            "zero3_lm_head",
            "padding_free",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"fuser: FuserConfig.{name} must be True or False, got {value!r}")
        if self.cuda_graphs and self.inner_compiler != "inductor":
            raise ValueError(
                f"fuser: cuda_graphs=True records Inductor's compiled graphs; inner_compiler={self.inner_compiler!r} "
                "compiles none. Use inner_compiler='inductor' (the default) or leave cuda_graphs off"
            )
        if self.patterns is not None:
            if isinstance(self.patterns, str):
                raise TypeError(
                    f"fuser: FuserConfig.patterns takes a list or tuple of pattern names, got the string "
                    f"{self.patterns!r}; write patterns=({self.patterns!r},)"
                )
            try:
                names = tuple(self.patterns)
            except TypeError:
                raise TypeError(
                    f"fuser: FuserConfig.patterns takes a list or tuple of pattern names, got {self.patterns!r}"
                ) from None
            bad = [n for n in names if not isinstance(n, str)]
            if bad:
                raise TypeError(f"fuser: FuserConfig.patterns takes pattern names (strings), got {bad!r}")
            object.__setattr__(self, "patterns", names)
            unknown = sorted(set(self.patterns) - set(PATTERNS))
            if unknown:
                raise ValueError(f"fuser: unknown pattern(s) {unknown}; known patterns are {sorted(PATTERNS)}")
        hint = lambda name: FuserConfig._misplaced(f"experimental.{name}")  # noqa: E731
        object.__setattr__(self, "experimental", build(ExperimentalConfig, self.experimental, "experimental", hint))

    @classmethod
    def sections(cls) -> dict[str, type]:
        """The registered patterns' options classes, by the name each goes by (``Pattern.options``)."""
        return registered_options()

    @classmethod
    def _misplaced(cls, path: str) -> str:
        # an option named without "experimental." that only the experimental namespace has, or the reverse
        head, _, rest = path.partition(".")
        if head == "experimental":
            return f"; {rest} is not experimental: set it as {rest}" if _names(cls, rest) else ""
        if _names(ExperimentalConfig, path):
            return f"; {path} is experimental: set it as experimental.{path} (options={{'experimental.{path}': ...}})"
        return ""

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> FuserConfig:
        """Map ``torch.compile(..., backend="fuser", options={...})`` onto the config: its fields by name, a
        pattern's options as a nested dict (``{"gated_mlp": {"backward_in_place": False}}``) or by dotted names
        (``{"gated_mlp.backward_in_place": False}``)."""
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"fuser: options must be a dict of FuserConfig fields, got {type(options).__name__}")
        options = nest_dotted(options or {})
        fields = [f.name for f in reference.public_fields(cls)]
        unknown = sorted(set(options) - set(cls.option_names()), key=str)
        if unknown:
            more = "".join(cls._misplaced(str(name)) for name in unknown)
            raise ValueError(
                f"fuser: unknown option(s) {unknown}; FuserConfig fields are {sorted(fields)}, and the patterns' "
                f"options {sorted(cls.sections())}{more}"
            )
        return cls(**options)

    def enabled(self, pattern_name: str) -> bool:
        if self.patterns is None:
            return PATTERNS[pattern_name].default
        return pattern_name in self.patterns


def options_reference(markdown: bool = False) -> str:
    """Every option of :class:`FuserConfig`, from the descriptions under its fields and under the fields of each
    registered pattern's options: plain text for FuserConfig's docstring, or Markdown (``docs/options.md``)."""
    if not markdown:
        return reference.plain_text(FuserConfig)
    intro = [
        "# Options",
        "",
        "<!-- Generated by `python scripts/options_doc.py` from the docstring under each field of",
        "     src/fuser/config.py's FuserConfig and each registered pattern's options dataclass: edit those, then run",
        "     it. tests/test_options_doc.py fails when this file is out of date. -->",
        "",
        "Every behaviour switch of fuser is a field of `fuser.FuserConfig`; there are no environment variables or",
        "module flags. Pass a config as `fuser.optimize(model, config)` / `fuser.optimize_(model, config)` (a",
        "`FuserConfig` or a dict of its fields), or by name as",
        '`torch.compile(model, backend="fuser", options={...})`. A pattern\'s options are a nested dict whose',
        "left-out fields keep their defaults, or dotted names:",
        '`FuserConfig(gated_mlp={"recompute_for_down_weight": False})`, `options={"rms_norm_linear": {"lora": True}}`,',
        '`options={"rms_norm_linear.lora": True}`. A pattern registered from outside fuser brings its own options',
        "(`Pattern.options`), set the same way. The switches kept only to compare implementations are listed apart,",
        "at the end of this page, under `experimental`. Why each default is what it is: [defaults.md](defaults.md).",
    ]
    return reference.markdown(FuserConfig, intro)


class _WithOptionsReference:
    """A class docstring followed by :func:`options_reference`, rendered when read (``help(FuserConfig)``,
    ``FuserConfig.__doc__``) rather than at import: ``type.__doc__`` calls a descriptor found under ``__doc__``."""

    def __init__(self, intro: str) -> None:
        self.intro = inspect.cleandoc(intro)

    def __get__(self, instance: object, owner: type | None = None) -> str:
        # rendered at each read: a pattern registered since brings options of its own
        return f"{self.intro}\n\nFields:\n\n{options_reference()}\n"


FuserConfig.__doc__ = _WithOptionsReference(FuserConfig.__doc__ or "")
reserve_names(
    {
        name
        for cls in (FuserConfig, ExperimentalConfig)
        for name in [*dir(cls), *(f.name for f in dataclasses.fields(cls))]  # a default_factory field is no attribute
        if not name.startswith("_")
    },
    {**registered_options(), **registered_options(experimental=True)},
)
