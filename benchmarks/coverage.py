"""Coverage (issue 20, "Reach"): for every causal LM in transformers, which of its blocks does fuser fuse?

Every model type of ``transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is built tiny
from its config class (random weights, fp32, CPU: 2 layers, hidden 64, 4 heads of 16, 2 kv heads, intermediate
128, vocab 512, 4 experts of which 2 per token, windows and chunks of 16; ``TINY`` holds every field set, and only
the fields a config has are set). Types whose causal-LM class needs pixel or audio inputs are skipped with the
reason; a build or forward that fails is recorded with its error. The types run in subprocesses of 16 each (a
type past ``--timeout`` seconds is stopped by an alarm; one that crashes or hangs its subprocess is run again
alone), and each buildable model:

- runs one eager forward with labels and counts what it executes: norm modules (forward hooks on modules whose
  class name says RMSNorm, or a Norm module whose forward's source takes an rsqrt / ``** -0.5`` / rms_norm without
  subtracting a mean; and LayerNorms: ``nn.LayerNorm``, or a LayerNorm class whose source subtracts the mean),
  rotary applications (calls of the modeling module's functions and methods whose
  name holds "rot" and "apply", e.g. ``apply_rotary_pos_emb``; outermost calls only, restored afterwards), gated
  MLPs (executed modules holding gate and up projections: ``gate_proj``+``up_proj``, ``w1``+``w3``, or a packed
  ``gate_up_proj`` linear or expert parameter), un-gated MLPs (runs of the first projection of a module holding an
  up and a down projection and no gate: ``fc1``+``fc2``, ``c_fc``+``c_proj``, ``dense_h_to_4h``+``dense_4h_to_h``,
  ``fc_in``+``fc_out``, ``up_proj``+``down_proj``, ``intermediate``+``output``) and a loss from the lm_head (1
  when the output embedding ran and a loss came back);
- runs ``fuser.explain(model, input_ids=ids, labels=ids)`` with the default ``FuserConfig`` and reads the fused ops
  the forward ran (``Report.executed``: a graph Dynamo compiled once and ran for each decoder layer counts each time):
  norm = rms_norm + rms_norm_linear + layer_norm, rope, gated = swiglu + geglu + reglu, mlp = mlp_activation,
  loss = linear_cross_entropy;
- per block: ``fused n/n``, ``m/n`` with the near-miss reason (shortened) when fuser declined or missed some,
  ``absent`` (the eager model does not run it), and ``OVER m/n`` when fuser matched more often than eager runs the
  block — a false match, or a form this harness does not count (the report lists them; the total must be 0).

With ``--train-check``: one fp32 training step through ``fuser.optimize(model, FuserConfig(inner_compiler=
"aot_eager", strict=True))`` (strict: a failed rewrite raises instead of running unfused) and one in eager fp32,
and one in fp64: the loss and every parameter gradient within 1e-4 relative of eager fp32's (norm of the
difference over the norm of fp64's, as tests/models do; over ``GRAD_FLOOR`` of the whole gradient's norm where a
gradient's own norm is smaller), or of fp64's, or no further from fp64's than eager fp32's: ``equal`` /
``not equal`` / the error.

    python benchmarks/coverage.py --out benchmarks/results/coverage_cpu_<date>.md          # every type
    python benchmarks/coverage.py --only llama,qwen3,gemma2 --out /tmp/coverage.md --train-check
    python benchmarks/coverage.py --worker llama          # one type, its JSON record on stdout (what the run calls)
    python benchmarks/coverage.py --vlm --only qwen2_vl,llava --out /tmp/coverage_vlm.md   # image-text models

With ``--vlm`` the model types are those of ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``, built tiny on both sides
and run on image inputs, and each block is reported per side, the text decoder's and the vision tower's
(``coverage_vlm.py`` says how); ``--only``, ``--timeout`` and ``--train-check`` work the same.

The markdown report goes to ``--out``, the records to the same path with ``.json``. Exit status 1 when any block
is matched more often than eager runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import importlib
import importlib.metadata
import inspect
import json
import platform
import re
import shlex
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch

# this checkout's fuser, also where another checkout is installed (`pip install -e .` of a second worktree): the
# run measures the code beside it; the workers, started with this interpreter and file, do the same
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src"), str(Path(__file__).resolve().parents[1])]

BLOCKS = ("norm", "rope", "gated", "mlp", "loss")
# which fuser patterns count for which block
PATTERNS_OF = {
    "norm": ("rms_norm", "rms_norm_linear", "layer_norm"),
    "rope": ("rope",),
    "gated": ("swiglu", "geglu", "reglu"),
    "mlp": ("mlp_activation",),
    "loss": ("linear_cross_entropy",),
}
# an un-gated MLP's (up, down) projections, by the names transformers gives them
UNGATED_PAIRS = (
    ("fc1", "fc2"),
    ("c_fc", "c_proj"),
    ("dense_h_to_4h", "dense_4h_to_h"),
    ("fc_in", "fc_out"),
    ("up_proj", "down_proj"),
    ("intermediate", "output"),  # ProphetNet's feed-forward
)
LAYERS = 2
VOCAB = 512
SEQ = 24
BATCH = 2
GRAD_RTOL = 1e-4
GRAD_FLOOR = 1e-5  # of the whole gradient's norm: below it, a gradient is compared at that absolute scale

# every size field a config may have, and its tiny value; only the fields a config class has are set
TINY: dict[str, Any] = {
    # depth
    "num_hidden_layers": LAYERS,
    "n_layer": LAYERS,
    "num_layers": LAYERS,
    "n_layers": LAYERS,
    "num_decoder_layers": LAYERS,
    "decoder_layers": LAYERS,
    # width
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "dim": 64,
    "embed_dim": 64,
    "word_embed_proj_dim": 64,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "n_inner": 128,
    "decoder_ffn_dim": 128,
    "ffn_hidden_size": 128,
    "d_ff": 128,
    "hidden_dim": 128,
    # heads
    "num_attention_heads": 4,
    "n_head": 4,
    "num_heads": 4,
    "n_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "n_kv_heads": 2,
    "multi_query_group_num": 2,
    "head_dim": 16,
    "kv_channels": 16,
    "rotary_dim": 8,
    # vocabulary and positions
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "n_positions": 256,
    "n_ctx": 256,
    # MoE
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "top_k": 2,
    "moe_k": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    # MLA
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    # linear attention / SSM parts of hybrids
    "linear_num_value_heads": 2,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "mamba_n_heads": 8,  # × mamba_d_head = mamba_expand × hidden
    "mamba_chunk_size": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "qk_head_dim": 16,  # MLA: nope + rope
    "num_expert_group": 1,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "mamba_d_state": 16,
    "mamba_expand": 2,
    "state_size": 16,
    "ssm_state_size": 16,
    "n_groups": 1,
    "mamba_n_groups": 1,
    # windows and chunks
    "sliding_window": 16,
    "attention_chunk_size": 16,
    "chunk_size": 16,
    # dropout off: eager and fuser must compute the same function
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "dropout": 0.0,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}
# fields set only when the default is not None (None there means "feature off")
TINY_IF_SET = {"q_lora_rank": 32, "sliding_window": 16, "attention_chunk_size": 16}
# special tokens above the tiny vocabulary are moved into it
TOKEN_FIELDS = {
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 1,
    "cls_token_id": 1,
    "sep_token_id": 2,
    "mask_token_id": 3,
}
MEDIA_CONFIGS = ("vision_config", "audio_config", "vq_config", "audio_encoder_config", "vision_tower_config")


# --------------------------------------------------------------------------------------------------- building


def _shrink(
    config_cls: type,
    base: Any = None,
    media: dict[str, Any] | None = None,
    in_media: bool = False,
    adjust: Any = None,
) -> Any:
    """A tiny config of ``config_cls``: the ``TINY`` fields it has, special tokens inside the vocabulary. Media
    sub-configs (``MEDIA_CONFIGS``) are kept as they are; with ``media``, they are shrunk too, by ``TINY`` updated
    with ``media`` (an image-text model's vision tower: its image and patch sizes). ``adjust(config_cls, have,
    fields, in_media)``, where given, edits each (sub-)config's tiny ``fields`` before it is built (its validators
    run then), knowing its defaults ``have``."""
    default = base if base is not None else config_cls()
    have = default.to_dict()
    fields: dict[str, Any] = {}
    tiny = {**TINY, **media} if in_media and media is not None else TINY
    for key, value in tiny.items():
        if key in have and not isinstance(have[key], (list, dict)):
            if key in TINY_IF_SET and have[key] is None:
                continue
            if isinstance(have[key], bool) or (isinstance(value, float) and isinstance(have[key], int)):
                continue
            fields[key] = value
    for key, value in TINY_IF_SET.items():
        if have.get(key) is not None:
            fields[key] = value
    for key, value in TOKEN_FIELDS.items():
        token = have.get(key)
        if isinstance(token, int) and token >= VOCAB:
            fields[key] = value
        elif isinstance(token, list):
            fields[key] = value
    if "kv_lora_rank" in have and "head_dim" in have:  # MLA: head_dim is the rope part's, heads are not grouped
        fields.update(head_dim=TINY["qk_rope_head_dim"], num_key_value_heads=TINY["num_attention_heads"])
    # per-layer lists sized for the checkpoint's depth: cut to LAYERS (the config recomputes them when left out)
    for key in ("layer_types", "layers_block_type", "hybrid_override_pattern", "mlp_layer_types", "block_types"):
        value = have.get(key)
        if isinstance(value, list) and len(value) > LAYERS:
            kinds = list(dict.fromkeys(value))  # keep one of each kind the model mixes, first two kinds
            fields[key] = (kinds + value)[:LAYERS] if len(kinds) >= LAYERS else value[:LAYERS]
        elif isinstance(value, str) and len(value) > LAYERS:
            fields[key] = value[:LAYERS]
    for key in have:  # nested configs (text_config, a dbrx's ffn_config, blt's encoder/decoder/patcher) too
        sub = getattr(default, key, None)
        if not hasattr(sub, "to_dict") or not hasattr(type(sub), "model_type"):
            continue
        if key not in MEDIA_CONFIGS:
            fields[key] = _shrink(type(sub), sub, media, in_media, adjust).to_dict()
        elif media is not None:
            fields[key] = _shrink(type(sub), sub, media, True, adjust).to_dict()
    if adjust is not None:
        adjust(config_cls, have, fields, in_media)
    return config_cls(**{**have, **fields}) if base is not None else config_cls(**fields)


def build(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random-weight fp32 model of ``model_type``'s causal-LM class, in eval mode (dropout off)."""
    import transformers
    from transformers import CONFIG_MAPPING

    config = _shrink(CONFIG_MAPPING[model_type])
    config.use_cache = False  # a training forward: no KV cache (and hybrids without attention layers need none)
    cls = getattr(transformers, _causal_lm_classes()[model_type])
    text = getattr(config, "text_config", None)
    if text is not None and not isinstance(config, getattr(cls, "config_class", type(config))):
        config = text  # a composite model type whose causal-LM class is its text model's
    torch.manual_seed(seed)
    try:
        model = cls._from_config(copy.deepcopy(config), attn_implementation="sdpa")
    except (ValueError, NotImplementedError, TypeError):  # no sdpa for this model: its default attention
        torch.manual_seed(seed)
        model = cls._from_config(config)
    return model.float().eval()


def _causal_lm_classes() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def skip_reason(model_type: str) -> str | None:
    """Why ``model_type`` is not built (its causal-LM class needs pixel or audio inputs), or None."""
    from transformers import CONFIG_MAPPING

    cls_name = _causal_lm_classes()[model_type]
    try:
        have = CONFIG_MAPPING[model_type]().to_dict()
    except Exception:  # the build reports it
        return None
    media = [k for k in MEDIA_CONFIGS if have.get(k)]
    if media and "ConditionalGeneration" in cls_name:
        return f"{cls_name} takes pixel/audio inputs ({', '.join(media)})"
    return None


def batch(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)


# --------------------------------------------------------------------------------------------- eager counting


def _is_rms_norm_module(module: torch.nn.Module) -> bool:
    name = type(module).__name__.lower()
    if "rmsnorm" in name or "rms_norm" in name:
        return True
    if "norm" not in name or isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm)):
        return False
    try:
        source = inspect.getsource(type(module))  # forward and the helpers it calls (a ``_norm``)
    except (OSError, TypeError):
        return False
    rms = any(s in source for s in ("rsqrt", "** -0.5", "**-0.5", "pow(-0.5", "rms_norm"))
    centred = any(s in source for s in ("- mean", "-mean", "- u)", "layer_norm"))
    return rms and not centred and ("mean" in source or "sum" in source or "rms_norm" in source)


def _is_layer_norm_module(module: torch.nn.Module) -> bool:
    if isinstance(module, torch.nn.LayerNorm):
        return True
    name = type(module).__name__.lower()
    if "layernorm" not in name and "layer_norm" not in name:
        return False
    try:
        source = inspect.getsource(type(module))
    except (OSError, TypeError):
        return False
    return any(s in source for s in ("- mean", "-mean", "- u)", "layer_norm"))


def _is_norm_module(module: torch.nn.Module) -> bool:
    return _is_rms_norm_module(module) or _is_layer_norm_module(module)


def _ungated_up_projection(module: torch.nn.Module) -> torch.nn.Module | None:
    """The first projection of an un-gated MLP that ``module`` holds (its up and down projections, no gate), or None."""
    if _is_gated_mlp_module(module):
        return None
    children = dict(module.named_children())
    for up, down in UNGATED_PAIRS:
        if up in children and down in children and not {"gate_proj", "w3"} & set(children):
            return children[up]
    return None


def _is_gated_mlp_module(module: torch.nn.Module) -> bool:
    names = {n for n, _ in module.named_children()} | {n for n, _ in module.named_parameters(recurse=False)}
    if "gate_up_proj" in names or {"gate_proj", "up_proj"} <= names or {"w1", "w3"} <= names:
        return True
    if {"input_linear", "output_linear"} <= names and not {"w1", "w2"} & names:  # Granite: packed, chunked in two
        return True
    cls = type(module).__name__.lower()
    children = [c for c in module.children() if isinstance(c, torch.nn.Linear)]
    linears = len(children)
    # packed: one linear of 2 × the other's input (something halves the width between them: a chunk into gate and
    # up), as ModernBERT's Wi, Wo or a vision projector's linear_1, linear_2 (Aya Vision: to another width); not an
    # attention whose packed qkv happens to be twice o_proj's width (Ergo's at the tiny shapes: 4 heads of q, 2 of k
    # and 2 of v)
    attention = "attn" in cls or "attention" in cls
    if linears == 2 and "norm" not in cls and not attention:
        a, b = children
        if a.out_features == 2 * b.in_features:
            return True
    feed_forward = any(w in cls for w in ("mlp", "ffn", "feedforward", "dense", "act"))  # not GatedDeltaNet
    return ("glu" in cls or ("gated" in cls and feed_forward)) and "norm" not in cls and linears >= 2  # CpmAnt


@contextlib.contextmanager
def _count_rotary_calls(model: torch.nn.Module, counter: Counter):
    """Wrap every function and method named *rot*apply* of the model's modeling modules (and the forward of such a
    function turned into a module); outermost calls count."""
    modules = {
        sys.modules[type(m).__module__] for m in model.modules() if type(m).__module__.startswith("transformers")
    }
    depth = [0]

    def wrap(fn):
        def counted(*args, **kwargs):
            depth[0] += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:  # rotated tensors: q and k of one call are 2
                counter["rope"] += sum(isinstance(t, torch.Tensor) for t in out) if isinstance(out, tuple) else 1
            return out

        return counted

    patched: list[tuple[Any, str, Any]] = []
    for mod in modules:
        for name, obj in list(vars(mod).items()):
            lower = name.lower()
            if inspect.isfunction(obj) and "rot" in lower and "apply" in lower:
                patched.append((mod, name, obj))
            elif isinstance(obj, torch.nn.Module) and "rot" in lower and "apply" in lower:
                # transformers >= 5.25 with the `kernels` package: the function became a module (its class made
                # for it alone), which each attention layer calls through a private instance of the same class
                patched.append((type(obj), "forward", type(obj).forward))
            elif inspect.isclass(obj) and obj.__module__ == mod.__name__:
                for attr, fn in list(vars(obj).items()):
                    if inspect.isfunction(fn) and "rot" in attr.lower() and "apply" in attr.lower():
                        patched.append((obj, attr, fn))
    try:
        for owner, name, fn in patched:
            setattr(owner, name, wrap(fn))
        yield
    finally:
        for owner, name, fn in patched:
            setattr(owner, name, fn)


def eager_counts(model: torch.nn.Module, ids: torch.Tensor) -> tuple[dict[str, Any], Any]:
    """What one eager forward with labels runs: RMSNorms, rotary applications, gated MLPs, an lm_head loss (and
    ``gated_modules``, the paths of the gated MLP modules that ran)."""
    counter: Counter = Counter()
    handles = []
    ran_gated: set[str] = set()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for block, test in (("norm", _is_norm_module), ("gated", _is_gated_mlp_module)):
        for path, module in [(p, m) for p, m in model.named_modules() if test(m)]:
            if not any(test(d) for d in module.modules() if d is not module):
                if block == "gated":
                    handles.append(module.register_forward_hook(lambda *_, p=path: ran_gated.add(p)))
                # the innermost only: a wrapper such as a gated norm around an RMSNorm module counts once
                handles.append(module.register_forward_hook(lambda *_, b=block: counter.update([b])))
    for module in model.modules():
        up = _ungated_up_projection(module)
        if up is not None:
            handles.append(up.register_forward_hook(lambda *_: counter.update(["mlp"])))
    if head is not None:
        handles.append(head.register_forward_hook(lambda *_: counter.update(["head"])))
    try:
        with _count_rotary_calls(model, counter), torch.no_grad():
            out = model(input_ids=ids, labels=ids)
    finally:
        for h in handles:
            h.remove()
    loss = getattr(out, "loss", None)
    counts = {b: counter[b] for b in ("norm", "rope", "gated", "mlp")}
    counts["loss"] = int(loss is not None and counter["head"] > 0)
    counts["gated_modules"] = sorted(ran_gated)
    return counts, out


# ------------------------------------------------------------------------------------------------ fuser side


# the engine's two sentences for an anchor op no match covered, and their short forms for the table
_NO_FORM = re.compile(
    r"this `(?P<op>[^`]+)` looked like part of \S+, but the code around it is none of its known forms"
    r"(?:: the closest, the '(?P<form>[^']+)' form, needs (?P<needs>.*) where the code has (?P<has>.*))?$"
)
_NOT_FUSED = re.compile(r"this `(?P<op>[^`]+)` is part of a \S+ block \((?P<form>[^)]+) form\), but (?P<why>.*)$")


def _shorten(reason: str, limit: int = 110) -> str:
    reason = " ".join(reason.split())
    if m := _NO_FORM.match(reason):
        reason = f"`{m['op']}` in no known form"
        if m["form"]:
            reason += f" (closest {m['form']}: needs {m['needs']}, has {m['has']})"
    elif m := _NOT_FUSED.match(reason):
        reason = f"`{m['op']}` in a {m['form']} block, but {m['why']}"
    return reason if len(reason) <= limit else reason[: limit - 1] + "…"


def fuser_counts(
    model: torch.nn.Module, ids: torch.Tensor, config: Any = None, gated_modules: list[str] | None = None
) -> tuple[dict[str, Any], dict[str, list[str]], Any]:
    """fuser.explain's counts per block, its near-miss reasons per block (distinct, shortened), and the report;
    ``config`` a ``FuserConfig`` (None: the default). With ``gated_modules`` (the eager gated MLPs' paths), a gated
    match outside them (a gated norm's ``norm(x) * silu(z)`` or a recurrent block's ``act(y) * x`` feeding a
    linear: the product fuser's op computes, but no MLP) is counted apart, under ``gated_elsewhere``."""
    import fuser

    torch._dynamo.reset()
    report = fuser.explain(model, input_ids=ids, labels=ids, config=config)
    # fused ops as the forward ran them, as eager is counted: a graph Dynamo reuses (one decoder layer's, after a
    # graph break in the loop over layers) counts once per run
    executed = report.executed
    runs = dict(zip(map(id, report.matches), report.runs, strict=True)) if report.runs else {}
    counts = {b: sum(executed.get(p, 0) for p in PATTERNS_OF[b]) for b in BLOCKS}
    # rope in rotated tensors, as eager is counted: an op that rotates q and k together is 2
    counts["rope"] = sum(_rotated_tensors(m) * runs.get(id(m), 1) for m in report.matches if m.pattern == "rope")
    counts["gated_elsewhere"] = []
    if gated_modules is not None:
        inside = tuple(gated_modules) + tuple(p + "." for p in gated_modules)
        for m in report.matches:
            if m.pattern in PATTERNS_OF["gated"] and not (m.module in gated_modules or m.module.startswith(inside)):
                counts["gated"] -= runs.get(id(m), 1)
                counts["gated_elsewhere"].append(m.module)
    reasons: dict[str, list[str]] = {b: [] for b in BLOCKS}
    for nm in report.near_misses:
        for b in BLOCKS:
            if nm.pattern in PATTERNS_OF[b]:
                text = _shorten(nm.reason, 400)
                if text not in reasons[b]:
                    reasons[b].append(text)
    return counts, reasons, report


def _rotated_tensors(match: Any) -> int:
    """1 or 2: a rope op rotates q and k together, or one tensor alone (its partner argument an ``EmptyLike``)."""
    from fuser.patterns.base import EmptyLike

    args = getattr(match.replacement, "args", ())
    return 1 if len(args) > 1 and isinstance(args[1], EmptyLike) else 2 if len(args) > 1 else 1


def verdict(eager: int, fused: int, reasons: list[str]) -> dict[str, Any]:
    """One block's cell: status ``fused`` / ``partial`` / ``absent`` / ``over`` and its text."""
    if fused > eager:
        return {"status": "over", "text": f"OVER {fused}/{eager}"}
    if eager == 0:
        return {"status": "absent", "text": "absent"}
    if fused == eager:
        return {"status": "fused", "text": f"fused {fused}/{eager}"}
    why = _shorten(reasons[0]) if reasons else "no near-miss: no form matched"
    return {"status": "partial", "text": f"{fused}/{eager}: {why}"}


def train_check(model: torch.nn.Module, ids: torch.Tensor | dict[str, torch.Tensor], rtol: float = GRAD_RTOL) -> str:
    """One fp32 step through fuser (aot_eager) versus eager fp32 and the same step in fp64: 'equal' (the loss and
    every gradient within ``rtol`` of eager fp32's, or of fp64's, or no further from fp64's than eager fp32's or
    than Inductor's step without fuser; a gradient zero in exact arithmetic, within 2x eager's noise), or
    what differed. ``ids``: the input ids (labels the same), or the whole batch as keyword arguments (an image-text
    model's; its floating tensors, the pixels, are cast with the model). fp64 besides eager: where eager fp32 is
    itself imprecise (a loss near 0, whose softmax gradient is a difference of nearly equal numbers) a more precise
    fused op would otherwise fail. A zero gradient on one side counts as none on the other (a compiled graph returns
    zeros for a parameter that only feeds an unused output: big_bird's pooler)."""
    import fuser

    inner, note = "aot_eager", ""

    batch = ids if isinstance(ids, dict) else {"input_ids": ids, "labels": ids}

    def step(m: torch.nn.Module, how: str, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One step of a copy of ``m`` in ``dtype``: ``how`` "eager", "fuser" or "inductor" (torch.compile alone)."""
        m = copy.deepcopy(m).to(dtype)
        run = {
            "eager": lambda: m,
            "fuser": lambda: fuser.optimize(m, fuser.FuserConfig(inner_compiler=inner, strict=True)),
            "inductor": lambda: torch.compile(m),
        }[how]()
        cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
        loss = run(**cast).loss
        loss.backward()
        return loss.detach().double(), {
            n: p.grad.detach().double() for n, p in m.named_parameters() if p.grad is not None
        }

    torch._dynamo.reset()
    loss_eager, grads_eager = step(model, "eager", torch.float32)
    reference = ""
    try:
        loss64, grads64 = step(model, "eager", torch.float64)
    except RuntimeError as error:  # an op without fp64 kernels (grouped matmuls): eager fp32 is the reference
        loss64, grads64 = loss_eager, grads_eager
        reference = f", against eager fp32 (no fp64 step: {_shorten(str(error), 50)})"
    try:
        loss, grads = step(model, "fuser", torch.float32)
    except RuntimeError as error:
        torch._dynamo.reset()
        try:  # the same step through torch.compile alone: if AOT autograd fails there too, it is not fuser's
            plain = copy.deepcopy(model)
            torch.compile(plain, backend="aot_eager")(**batch).loss.backward()
        except RuntimeError:
            pass
        else:
            raise error
        torch._dynamo.reset()
        inner = "eager"
        note = f", inner compiler eager ({_shorten(str(error), 60)} under aot_eager, also without fuser)"
        loss, grads = step(model, "fuser", torch.float32)
    torch._dynamo.reset()
    bad = []
    if not (
        abs(loss - loss64) <= max(rtol * abs(loss64), abs(loss_eager - loss64))
        or abs(loss - loss_eager) <= rtol * abs(loss_eager)
    ):
        bad.append(f"loss {loss.item():.6g} vs fp64 {loss64.item():.6g} (eager fp32 {loss_eager.item():.6g})")
    one_sided = [n for n in set(grads) ^ set(grads_eager) if (grads.get(n, grads_eager.get(n)) != 0).any()]
    if one_sided:
        bad.append(f"{len(one_sided)} parameters with a nonzero gradient on one side only")
    # a gradient that is zero in exact arithmetic (a key bias, which softmax cancels; a router that routes by hash)
    # is rounding noise: each gradient is compared relative to its own norm, or to GRAD_FLOOR of the whole model's
    # gradient norm where its own is below that
    whole = torch.sqrt(sum(g.pow(2).sum() for g in grads64.values())) if grads64 else torch.tensor(0.0)
    grads_inductor: dict[str, torch.Tensor] | None = None  # computed where a gradient needs it
    for name in sorted(set(grads) & set(grads_eager) & set(grads64)):
        scale = torch.maximum(grads64[name].norm(), GRAD_FLOOR * whole).clamp_min(1e-30)
        err = ((grads[name] - grads64[name]).norm() / scale).item()
        err_eager = ((grads_eager[name] - grads64[name]).norm() / scale).item()
        # equal to eager fp32 within the tolerance (the model tests' rule), or as close to fp64 as eager fp32 is
        from_eager = ((grads[name] - grads_eager[name]).norm() / scale).item()
        if err <= max(rtol, err_eager) or from_eager <= rtol:
            continue
        # a gradient zero in exact arithmetic is one draw of rounding noise: within 2x eager's (tests/models/tiny.py)
        if grads64[name].norm() < GRAD_FLOOR * whole and err <= 2 * err_eager:
            continue
        # no closer than Inductor compiling the same model gets (the project's bar), where eager is the reference
        if grads_inductor is None:
            torch._dynamo.reset()
            grads_inductor = step(model, "inductor", torch.float32)[1]
            torch._dynamo.reset()
        err_inductor = ((grads_inductor[name] - grads64[name]).norm() / scale).item()
        if err <= err_inductor:
            continue
        bad.append(f"grad {name} rel {err:.2e} from fp64 (eager fp32 {err_eager:.2e}, Inductor {err_inductor:.2e})")
    note += reference.replace(":", "")
    if not bad:
        return "equal" + note
    return "not equal" + note + ": " + "; ".join(bad[:3]) + (f" (+{len(bad) - 3})" if len(bad) > 3 else "")


def run_one(model_type: str, with_train_check: bool = False, config: Any = None) -> dict[str, Any]:
    """The record of one model type: skipped / failed (with the reason) / its blocks, as ``fuser.explain`` with
    ``config`` (None: the default ``FuserConfig``) finds them."""
    record: dict[str, Any] = {"model_type": model_type, "class": _causal_lm_classes()[model_type]}
    reason = skip_reason(model_type)
    if reason is not None:
        return {**record, "status": "skipped", "reason": reason}
    stage = "build"
    try:
        model = build(model_type)
        ids = batch()
        stage = "eager forward"
        eager, _ = eager_counts(model, ids)
        stage = "fuser.explain"
        fused, reasons, report = fuser_counts(model, ids, config, eager["gated_modules"])
    except Exception as error:  # recorded, the run goes on
        text = _shorten(f"{type(error).__name__}: {error}", 200)
        return {**record, "status": "failed", "reason": f"{stage}: {text}", "traceback": traceback.format_exc()[-2000:]}
    blocks = {
        b: {"eager": eager[b], "fused": fused[b], "reasons": reasons[b], **verdict(eager[b], fused[b], reasons[b])}
        for b in BLOCKS
    }
    record.update(status="ok", blocks=blocks, counts=dict(report.counts), graph_breaks=report.graph_breaks)
    if fused["gated_elsewhere"]:
        record["gated_elsewhere"] = fused["gated_elsewhere"]
        blocks["gated"]["text"] += f" (+{len(fused['gated_elsewhere'])} outside an MLP)"
    record["variants"] = sorted({f"{m.pattern}:{m.variant}" for m in report.matches})
    if with_train_check:
        try:
            # a fresh build (the same seed, the same weights): a model that ran a forward may hold non-leaf tensors
            # (recurrent_gemma's states), which copy.deepcopy refuses
            record["train_check"] = train_check(build(model_type), ids)
        except Exception as error:
            record["train_check"] = _shorten(f"error: {type(error).__name__}: {error}", 200)
    return record


def fully_fused(record: dict[str, Any]) -> bool:
    return (
        record.get("status") == "ok"
        and all(record["blocks"][b]["status"] in ("fused", "absent") for b in BLOCKS)
        and any(record["blocks"][b]["status"] == "fused" for b in BLOCKS)
    )


def why_not(record: dict[str, Any]) -> list[str]:
    """The reasons a buildable model is not fully fused, one entry per block that is not."""
    out = []
    for b in BLOCKS:
        cell = record["blocks"][b]
        if cell["status"] == "over":
            out.append(f"{b} {cell['text']}")
        elif cell["status"] == "partial":
            reasons = [_shorten(r, 200) for r in cell["reasons"][:3]] or ["no near-miss: no form matched"]
            out.append(f"{b} {cell['fused']}/{cell['eager']}: " + "; ".join(reasons))
    return out


def common_reasons(records: list[dict[str, Any]]) -> list[tuple[str, str, int]]:
    """(block, reason, architectures) over the blocks not fully fused, node names' numbers folded, most first."""
    found: Counter = Counter()
    for r in records:
        if r["status"] != "ok":
            continue
        for b in BLOCKS:
            cell = r["blocks"][b]
            if cell["status"] == "partial":
                reasons = cell["reasons"] or ["no near-miss: no form matched"]
                for reason in {re.sub(r"_\d+\b", "_N", _shorten(x, 160)) for x in reasons}:
                    found[(b, reason)] += 1
    return [(b, reason, n) for (b, reason), n in found.most_common()]


# ----------------------------------------------------------------------------------------------------- report


def _worker_records(
    model_types: list[str], timeout: float, with_train_check: bool, vlm: bool = False
) -> tuple[list[dict], str]:
    """Run ``--worker`` on ``model_types`` in one subprocess; the records it printed, and its last stderr line."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", ",".join(model_types), "--timeout", str(timeout)]
    if with_train_check:
        cmd.append("--train-check")
    if vlm:
        cmd.append("--vlm")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout * len(model_types) + 60)
        stdout, stderr = done.stdout, done.stderr
        ending = f"exit {done.returncode}"
    except subprocess.TimeoutExpired as expired:
        stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout or ""
        stderr = expired.stderr.decode() if isinstance(expired.stderr, bytes) else expired.stderr or ""
        ending = f"killed after {timeout:.0f} s"
    records = [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]
    tail = stderr.strip().splitlines()[-1] if stderr.strip() else "no output"
    return records, f"{ending}: {_shorten(tail, 200)}"


def run_all(
    model_types: list[str], timeout: float, with_train_check: bool, chunk: int = 16, log=print, vlm: bool = False
) -> list[dict[str, Any]]:
    """Subprocesses of ``chunk`` model types each (imports cost more than a tiny model): a type that hangs past
    ``timeout`` is stopped by an alarm inside the worker; one that crashes the worker, or hangs where the alarm
    cannot reach, is run again alone, and recorded as failed if it fails alone too."""
    by_type: dict[str, dict[str, Any]] = {}
    done_count = 0

    def take(records: list[dict[str, Any]]) -> None:
        nonlocal done_count
        for record in records:
            by_type[record["model_type"]] = record
            done_count += 1
            summary = record.get("reason") or _summary(record)
            log(
                f"[{done_count}/{len(model_types)}] {record['model_type']} {record['status']} "
                f"({record.get('seconds', '?')} s): {summary[:160]}"
            )

    for i in range(0, len(model_types), chunk):
        part = model_types[i : i + chunk]
        records, _ = _worker_records(part, timeout, with_train_check, vlm)
        take(records)
        for model_type in [t for t in part if t not in by_type]:
            records, why = _worker_records([model_type], timeout, with_train_check, vlm)
            take(records or [{"model_type": model_type, "status": "failed", "reason": f"worker {why}"}])
    return [by_type[t] for t in model_types]


def _summary(record: dict[str, Any]) -> str:
    """A record's cells on one line: its blocks, or (an image-text model's) its blocks per side."""
    if "sides" in record:
        return " / ".join(
            side + ": " + ", ".join(f"{b} {c['text']}" for b, c in cells.items() if c["status"] != "absent")
            for side, cells in record["sides"].items()
        )
    return " | ".join(record["blocks"][b]["text"] for b in BLOCKS)


def totals(records: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in records if r["status"] == "ok"]
    per_block = {}
    for b in BLOCKS:
        cells = [r["blocks"][b] for r in ok]
        per_block[b] = {
            "architectures_running_it": sum(c["eager"] > 0 for c in cells),
            "architectures_fused": sum(c["status"] == "fused" for c in cells),
            "eager_ops": sum(c["eager"] for c in cells),
            "fused_ops": sum(min(c["fused"], c["eager"]) for c in cells),
            "over": sum(c["status"] == "over" for c in cells),
        }
    return {
        "model_types": len(records),
        "skipped": sum(r["status"] == "skipped" for r in records),
        "failed": sum(r["status"] == "failed" for r in records),
        "buildable": len(ok),
        "fully_fused": sum(fully_fused(r) for r in ok),
        "false_matches": sum(per_block[b]["over"] for b in BLOCKS),
        "per_block": per_block,
        "train_check": dict(Counter(r["train_check"].split(":")[0] for r in ok if "train_check" in r)),
    }


def _versions() -> str:
    names = ("torch", "transformers", "triton")
    found = []
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{name} {importlib.metadata.version(name)}")
    return ", ".join(found) + f", python {platform.python_version()}"


def markdown(records: list[dict[str, Any]], command: str, started: str, seconds: float) -> str:
    t = totals(records)
    lines = [
        "# Coverage: which blocks of each transformers causal LM fuser fuses (CPU, fp32, tiny random weights)",
        "",
        f"- command: `{command}`",
        f"- date: {started} (UTC), {seconds / 60:.1f} min",
        f"- versions: {_versions()}; device: CPU ({platform.machine()})",
        f"- models: {LAYERS} layers, hidden 64, 4 heads × 16, 2 kv heads, intermediate 128, vocab {VOCAB}, "
        f"4 experts (2 per token), batch {BATCH} × {SEQ} tokens with labels; `fuser.explain` with the default "
        "FuserConfig",
        "- cells: `fused n/n`; `m/n: reason` (fuser fused m of the n the eager model runs; the first near-miss "
        "reason, shortened); `absent` (eager does not run it); `OVER m/n` (fuser matched more than eager runs)",
        "- eager counts: RMSNorm and LayerNorm modules executed, calls of `*rot*apply*` functions, executed modules "
        "with gate+up (or packed gate_up) projections, runs of an un-gated MLP's first projection, 1 for a loss from "
        "the lm_head",
        "",
        "## Summary",
        "",
        f"**{t['fully_fused']} of {t['buildable']} buildable architectures have every block fused** "
        f"({t['model_types']} model types: {t['skipped']} skipped for pixel/audio inputs, {t['failed']} failed to "
        f"build or run). False matches (fuser above eager): **{t['false_matches']}**.",
        "",
        "| block | architectures running it | fully fused | ops eager runs | ops fused | over |",
        "|---|---|---|---|---|---|",
    ]
    for b, s in t["per_block"].items():
        lines.append(
            f"| {b} | {s['architectures_running_it']} | {s['architectures_fused']} | {s['eager_ops']} | "
            f"{s['fused_ops']} | {s['over']} |"
        )
    if t["train_check"]:
        lines += [
            "",
            "Training step (fp32, aot_eager) vs eager: " + ", ".join(f"{k}: {v}" for k, v in t["train_check"].items()),
        ]
    train = any("train_check" in r for r in records)
    lines += [
        "",
        "## Architectures",
        "",
        "| model type | " + " | ".join(BLOCKS) + " | all |" + (" train step |" if train else ""),
    ]
    lines.append("|---" * (len(BLOCKS) + 2 + train) + "|")
    for r in records:
        if r["status"] != "ok":
            continue
        cells = [r["blocks"][b]["text"].replace("|", "\\|") for b in BLOCKS]
        row = f"| {r['model_type']} | " + " | ".join(cells) + f" | {'yes' if fully_fused(r) else 'no'} |"
        if train:
            row += f" {r.get('train_check', '').replace('|', '/')} |"
        lines.append(row)
    lines += ["", "## Most common reasons (architectures per block and reason)", "", "| block | reason | archs |"]
    lines.append("|---|---|---|")
    for b, reason, n in common_reasons(records)[:25]:
        lines.append(f"| {b} | {reason.replace('|', '/')} | {n} |")
    lines += ["", "## Why not: each buildable architecture not fully fused", ""]
    for r in records:
        if r["status"] == "ok" and not fully_fused(r):
            reasons = why_not(r) or ["nothing the harness counts (no norm, RoPE, MLP or lm_head loss)"]
            lines.append(f"- **{r['model_type']}**: " + "; ".join(reasons))
    lines += ["", "## Skipped and failed", ""]
    for r in records:
        if r["status"] in ("skipped", "failed"):
            lines.append(f"- **{r['model_type']}** ({r['status']}): {r['reason']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="coverage.md", help="markdown report; the JSON records go beside it")
    parser.add_argument("--only", default="", help="comma-separated model types (default: every one of the suite)")
    parser.add_argument("--vlm", action="store_true", help="image-text models, per side (coverage_vlm.py)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per model type")
    parser.add_argument("--train-check", action="store_true", help="one fp32 training step vs eager per model")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # toy sizes: threads only spin on a shared machine
    if args.vlm:
        import coverage_vlm

        classes, run, report, count = (
            coverage_vlm.model_classes(),
            coverage_vlm.run_one,
            coverage_vlm.markdown,
            coverage_vlm.totals,
        )
        suite = "image-text-to-text"
    else:
        classes, run, report, count, suite = _causal_lm_classes(), run_one, markdown, totals, "causal-LM"
    if args.worker:
        import logging
        import warnings

        warnings.filterwarnings("ignore")
        logging.disable(logging.WARNING)
        import signal

        def alarm(*_):
            raise TimeoutError(f"timed out after {args.timeout:.0f} s")

        signal.signal(signal.SIGALRM, alarm)
        for model_type in args.worker.split(","):
            start = time.time()
            signal.alarm(int(args.timeout))
            try:
                record = run(model_type, args.train_check)
            finally:
                signal.alarm(0)
            record["seconds"] = round(time.time() - start, 1)
            print(json.dumps(record), flush=True)
        return 0

    types = [t for t in args.only.split(",") if t] or list(classes)
    unknown = sorted(set(types) - set(classes))
    if unknown:
        parser.error(f"not {suite} model types of this transformers: {unknown}")
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    t0 = time.time()
    records = run_all(types, args.timeout, args.train_check, log=lambda s: print(s, flush=True), vlm=args.vlm)
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report(records, command, started, time.time() - t0))
    t = count(records)
    payload = {"command": command, "date": started, "versions": _versions(), "totals": t, "records": records}
    out.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    print(
        f"{t['fully_fused']} of {t['buildable']} buildable architectures fully fused; "
        f"false matches {t['false_matches']}; report in {out}"
    )
    return 1 if t["false_matches"] else 0


if __name__ == "__main__":
    sys.exit(main())
