"""FuserConfig: every knob of the optimizer, as one frozen (hashable) dataclass."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from fuser.options import build as build_options
from fuser.patterns import PATTERNS
from fuser.patterns.causal_attention import CausalAttentionConfig
from fuser.patterns.gated_mlp import GatedMLPConfig
from fuser.patterns.linear_cross_entropy import LinearCrossEntropyConfig
from fuser.patterns.lora_sum import LoraSumConfig
from fuser.patterns.rms_norm import RmsNormConfig, RmsNormLinearConfig
from fuser.patterns.upcast_linear import UpcastLinearConfig

INNER_COMPILERS = ("inductor", "aot_eager", "eager")

__all__ = [
    "INNER_COMPILERS",
    "CausalAttentionConfig",
    "FuserConfig",
    "GatedMLPConfig",
    "LinearCrossEntropyConfig",
    "LoraSumConfig",
    "RmsNormConfig",
    "RmsNormLinearConfig",
    "UpcastLinearConfig",
]


@dataclass(frozen=True)
class FuserConfig:
    """What fuser rewrites and what compiles the result.

    patterns:        names of the patterns to apply (``None``: every registered pattern that is on by default;
                     ``fuser.DEFAULT_PATTERNS`` names them).
    inner_compiler:  what compiles the rewritten graph: ``"inductor"`` (default), ``"aot_eager"`` or ``"eager"``.
    keep_logits:     when a training graph returns the logits it computes the loss from, keep them: the
                     ``linear_cross_entropy`` pattern then leaves that loss unfused. ``False`` (default): the loss
                     is fused and the logits are never computed; the graph returns ``None`` in their place
                     (``outputs.logits is None``). Evaluation (no gradient wanted) always keeps returned logits.
    strict:          raise instead of falling back to the unrewritten graph when the rewrite fails (tests use it).
    ignore_logging:  while Dynamo traces the calls that ``fuser.optimize``, ``optimize_`` and ``explain`` compile,
                     skip the ``logging.Logger`` methods that print a message at most once (transformers'
                     ``warning_once``, ``info_once``) instead of breaking the graph there (default ``True``): a
                     GPT-2-style model's ``loss_function`` logs one between its lm_head and its loss, which could
                     not fuse across the break. Their message is then not printed by compiled code. Scoped to
                     those calls (``fuser/tracing.py``); ``torch.compile(m, backend="fuser")`` cannot apply it.
    checkpoint_side_effects: while Dynamo traces those same calls, a gradient-checkpointed layer that changes
                     Python state is traced, not run eagerly (default ``True``): Dynamo then applies the change
                     once, in the forward, and does not replay it when the backward recomputes the layer (its
                     ``skip_fwd_side_effects_in_bwd_under_checkpoint``). transformers >= 5.25 with the ``kernels``
                     package sets and restores a context variable in each attention layer's forward (its kernel
                     routing), so without this every checkpointed decoder layer breaks the graph and nothing in
                     it fuses: TRL's ``SFTTrainer``, which checkpoints by default, among them. Set ``False`` for a
                     model whose checkpointed layers need a side effect replayed. Scoped like ``ignore_logging``.
    direct_calls:    Inductor's compiled graphs call the fused ops through their ``direct`` overloads (default
                     ``True``): the same functions without the custom-op wrapper and autograd kernel, which graphs
                     past AOT autograd never need, to save host time per call (``fuser/engine/direct_calls.py``).
    inline_ops:      Inductor launches the fused ops' Triton kernels from its generated code (default ``True``):
                     each call in a compiled GPU graph is replaced, at compile time, by what its Python body does
                     for those shapes (its buffers and kernel launches), so a call no longer runs that body (70–250
                     µs of host time each on the H200's host). Same kernels, same arguments. It helps a host-bound
                     step (Gemma-3-4B LoRA: 0.98x Inductor with calls on the H200, 1.3x with it there, 1.34x in one
                     run on an H100) and leaves a GPU-bound one as it was. Measured after the 2026-12-06 fix, a
                     full fine-tune's memory is that of the calls (the first backward's gradients were kept
                     before). It costs compile time (Gemma on the H200: 134-192 s against the calls' 99 s; on an
                     H100 146 s against Inductor's own 154 s:
                     ``benchmarks/results/inline_ops_default_h100_2026-12-06.md``). A call that might not compute
                     the same inlined (it writes an input, its shapes are dynamic, it calls a matmul that the
                     caller's autocast would change, its tensors are not on a GPU) stays a call;
                     ``fuser.report(model).not_inlined`` says why (``fuser/engine/inline_ops.py``). ``False`` keeps
                     every call, e.g. to compare or to debug a kernel from Python.
    embedding_grads: an embedding's weight gradient, with a tied lm_head's gradient added, is written by one op in
                     one pass over ``[V, H]`` (default ``True``; ``fuser/patterns/embedding_grads.py``) instead of
                     Inductor's zero-filled fp32 buffer, scatter and cast.
    zero3_leaf_layers: where DeepSpeed is installed, ``fuser.optimize_`` and ``fuser.optimize`` mark the model's
                     decoder layers (the entries of its outermost ``nn.ModuleList`` of one repeated class) as DeepSpeed
                     ZeRO-3 leaf modules (default ``True``), unless one is marked either way already: ZeRO-3 then
                     gathers a layer's parameters together, with one hook, and the layer reaches fuser as one graph
                     (otherwise each submodule's hook breaks the graph and no block in the layer fuses). Without
                     ZeRO-3 nothing reads the flag. ``fuser/zero3.py``.
    zero3_lm_head:   under DeepSpeed ZeRO-3, the lm_head's weight is gathered by the hook of the module that calls it
                     (the causal LM, whose forward computes the loss) and DeepSpeed's hooks on the lm_head module are
                     removed, at the first call of a model from ``optimize_``/``optimize`` (default ``True``): those
                     hooks end the graph before and after the lm_head, so the loss's logits would be an input of its
                     graph and the loss would not fuse (``linear_cross_entropy``), its whole logits kept. The cost:
                     one ``[vocab, hidden]`` weight stays gathered for the step's forward and backward (DeepSpeed keeps
                     such an external parameter until the step ends). ``fuser/zero3.py``.
    cuda_graphs:     Inductor records the compiled forward and backward graphs as CUDA graphs and replays them
                     (its ``triton.cudagraphs``, what ``mode="reduce-overhead"`` turns on; default ``False``). A step
                     then costs the host microseconds instead of a launch per kernel, for models whose step is
                     host-bound (many short kernels: Gemma-3-4B LoRA on an H200). The costs: more GPU memory (the
                     graphs' own memory pool: +7.3 GiB on that model), one recording per new input shape (pad
                     batches to a few fixed lengths), and a step's outputs are overwritten by the next replay
                     (``.clone()`` what is kept; a loop that does not run forward then backward each step calls
                     ``torch.compiler.cudagraph_mark_step_begin()`` first). A graph Inductor will not record (CPU
                     tensors, an input mutated in place) runs as before; fuser warns where Inductor declines it
                     while fuser compiles the forward (a backward compiles later: ``TORCH_LOGS=cudagraphs`` shows
                     every graph declined). Needs
                     ``inner_compiler="inductor"``. Gradient accumulation works: where ``.grad`` was ``None``,
                     autograd keeps the backward replay's output buffer itself as ``.grad`` (PyTorch issue 169545),
                     and fuser copies it out of the graphs' memory before the next call replays over it
                     (``fuser/engine/graph_pool_grads.py``); without accumulation nothing is copied.

    Each pattern with options of its own has them in one field, a frozen dataclass documented where the pattern
    is; give it as that dataclass or as a dict of its fields (``options=`` takes the same dicts), the fields left
    out keep their defaults:

    linear_cross_entropy:  :class:`LinearCrossEntropyConfig` ``(dw_kernel="cublas", dw_accumulator="input",
                           streams=True)``: how the fused loss accumulates the lm_head's weight gradient.
    causal_attention:      :class:`CausalAttentionConfig` ``(gqa_fold=True, runtime_check=False, sliding_window=True,
                           block_sparse_masks=False)``.
    gated_mlp:             :class:`GatedMLPConfig` ``(recompute_for_down_weight=True, backward_in_place=True,
                           backward_writes_product=True)``, for swiglu and geglu.
    upcast_linear:         :class:`UpcastLinearConfig` ``(triton=True, recompute_gated_input=True,
                           group_shared_inputs=True)``; ``triton`` also switches lora_sum's kernels, which are the
                           same.
    lora_sum:              :class:`LoraSumConfig` ``(fp32_base=True, gated_in_slices=False)``: a LoRA sum stored
                           rounded adds its term to the base linear's unrounded fp32 output; the gated MLP's fp32
                           gate/up sums are formed in row slices (off: measured slower, and not enough memory saved).
    rms_norm:              :class:`RmsNormConfig` ``(residual_add=True, gradient_sums=True)``: a residual add
                           before a fused norm joins the norm's op, forward and backward; the norm's backward sums
                           its projections' input gradients itself.
    rms_norm_linear:       :class:`RmsNormLinearConfig` ``(lora=False)``: whether norms that feed peft's LoRA A
                           adapters are taken too.

    e.g. ``FuserConfig(linear_cross_entropy={"dw_accumulator": "fp32"})``, or by name from a trainer:
    ``torch.compile(model, backend="fuser", options={"causal_attention": {"gqa_fold": False}})``.
    """

    patterns: tuple[str, ...] | None = None
    inner_compiler: str = "inductor"
    keep_logits: bool = False
    strict: bool = False
    ignore_logging: bool = True
    checkpoint_side_effects: bool = True
    direct_calls: bool = True
    inline_ops: bool = True
    embedding_grads: bool = True
    cuda_graphs: bool = False
    zero3_leaf_layers: bool = True
    zero3_lm_head: bool = True
    linear_cross_entropy: LinearCrossEntropyConfig = field(default_factory=LinearCrossEntropyConfig)
    causal_attention: CausalAttentionConfig = field(default_factory=CausalAttentionConfig)
    gated_mlp: GatedMLPConfig = field(default_factory=GatedMLPConfig)
    upcast_linear: UpcastLinearConfig = field(default_factory=UpcastLinearConfig)
    lora_sum: LoraSumConfig = field(default_factory=LoraSumConfig)
    rms_norm: RmsNormConfig = field(default_factory=RmsNormConfig)
    rms_norm_linear: RmsNormLinearConfig = field(default_factory=RmsNormLinearConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.inner_compiler, str) or self.inner_compiler not in INNER_COMPILERS:
            raise ValueError(f"fuser: inner_compiler must be one of {INNER_COMPILERS}, got {self.inner_compiler!r}")
        for name in (
            "keep_logits",
            "strict",
            "ignore_logging",
            "checkpoint_side_effects",
            "direct_calls",
            "inline_ops",
            "embedding_grads",
            "cuda_graphs",
            "zero3_leaf_layers",
            "zero3_lm_head",
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
        for name, cls in _pattern_options().items():
            object.__setattr__(self, name, build_options(cls, getattr(self, name), name))

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> FuserConfig:
        """Map ``torch.compile(..., backend="fuser", options={...})`` onto the config's fields; a pattern's
        options are a nested dict (``{"linear_cross_entropy": {"dw_kernel": "triton"}}``)."""
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"fuser: options must be a dict of FuserConfig fields, got {type(options).__name__}")
        options = dict(options or {})
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - fields, key=str)
        if unknown:
            raise ValueError(f"fuser: unknown option(s) {unknown}; FuserConfig fields are {sorted(fields)}")
        return cls(**options)

    def enabled(self, pattern_name: str) -> bool:
        if self.patterns is None:
            return PATTERNS[pattern_name].default
        return pattern_name in self.patterns


def _pattern_options() -> dict[str, type]:
    """FuserConfig's fields that hold a pattern's options dataclass, by name."""
    return {
        f.name: f.default_factory
        for f in dataclasses.fields(FuserConfig)
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)
    }
