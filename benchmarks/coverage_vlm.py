"""Coverage of image-text models (``coverage.py --vlm``): tiny builds, real image inputs, blocks per side.

Every model type of ``transformers``' ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` is built tiny from its config
(``coverage._shrink`` on the text side, and on the vision tower with ``VISION`` on top: image 32, patches of 8, two
layers, width 64; the tiny vocabulary holds every special token) and run with labels on a batch of two samples, each
one image and text around the image's tokens:

- ``pixel_values`` in the layout the forward reads (``layout``): ``[batch, channels, H, W]``, or a grid of
  flattened patches with ``image_grid_thw``, several crops or tiles per image with ``image_sizes``, a pixel mask
  or aspect-ratio ids and masks; which one is read from the forward's arguments and the config, and ``LAYOUTS``
  names the few models that need another (``VISION_OF``, ``TOP``: the sizes a few configs tie together);
- as many image tokens in ``input_ids`` as the vision tower gives features: one call of the model's
  ``get_image_features`` on those pixels counts them (a model that takes no image tokens gets none);
- the tensors processors return beside them where the forward takes them: ``mm_token_type_ids``,
  ``token_type_ids`` (1 on image tokens; PaliGemma's: 0 on the image and the prompt), Mllama's
  ``cross_attention_mask``, IDEFICS's ``image_attention_mask``, Kosmos-2's ``image_embeds_position_mask``,
  InstructBLIP's ``qformer_input_ids``, VideoLLaMA-3's ``image_merge_sizes`` (no ``attention_mask``: as
  ``coverage.py`` runs the causal LMs);
- labels: the input ids, with the image tokens ignored (-100), as collators do.

A model that cannot be built so, or whose forward fails on these inputs, is recorded with the stage and the error.

Sides. Each block is the text decoder's or the vision tower's, by the module it runs in. A module is on the vision
side when a part of its path names it so (``VISION_PATH``: vision, visual, image, patch, video, the projector,
connector, merger, aligner or adapter that feeds image features to the decoder, a perceiver, resampler or Q-Former);
every other module, and code outside any module (the loss), is on the text side. Eager counts take the side from the
path of the module that runs the block. A fused op or a decline takes it from Dynamo's records of its nodes where
they say it: the innermost module class around them (``nn_module_stack``) that the model uses on one side only, else
the method of such a class that their stack trace passes through, else their module path where it says vision (a
vision module the top-level forward calls itself); where none does (a frame resumed after a graph break, or compiled
from a shared norm class's own forward, records no module above itself), from the module whose forward ran the
graph, each time it ran (read from the Python frames around the compiled graph's call).

Attention is counted per call: eager, calls of ``F.scaled_dot_product_attention``, or (a model without SDPA)
executions of modules whose class name says attention; fused, the SDPA calls in the graphs fuser would compile that
take no mask (PyTorch's fused kernels run them as they are; a bidirectional vision attention without mask is one),
plus those ``causal_attention`` rewrites to ``is_causal`` or a window, plus the attention written by hand (matmul,
softmax, matmul; ``nn.MultiheadAttention`` returning its weights) that ``softmax_attention`` turns into an SDPA call,
counted as that call: without a mask fused, with one masked. A masked SDPA call that fuser leaves masked is a miss,
with ``causal_attention``'s or ``softmax_attention``'s reason where it declined.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import traceback
from collections import Counter
from typing import Any

import coverage as text_coverage
import torch

BATCH = 2
TEXT = 24  # text tokens per sample, around the image's tokens
IMAGE = 32  # pixels per side
# the vision tower's sizes, on top of coverage.TINY's (which give its width, heads and depth where it names them so)
VISION: dict[str, Any] = {
    "image_size": IMAGE,
    "patch_size": 8,
    "num_channels": 3,
    "in_channels": 3,
    "depth": 2,
    "num_global_layers": 1,  # Mllama's global encoder
    "attention_heads": 4,
    "mlp_ratio": 2,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 64,
    "projection_dim": 64,
    "vision_output_dim": 128,  # Mllama's: its width × (the one intermediate layer kept + the last)
    "text_hidden_size": 64,
    "encoder_layers": 2,  # an audio tower's, where the model has one
    "encoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
}
# top-level fields of the composite config (one crop per image for the any-resolution models)
TOP: dict[str, Any] = {
    "mm_tokens_per_image": 4,
    "num_query_tokens": 4,
    "image_seq_length": 4,
    "projection_dim": 64,
    "image_grid_pinpoints": [[IMAGE, IMAGE]],
    "latent_query_num": 4,  # Kosmos-2's image tokens
    "projector_patch_to_query_dict": {(IMAGE // 8) ** 2: 4},  # Aria's: patches of 8 → 4 queries
}
# vision-config sizes some models tie together otherwise (Llama-4: the MLP's width is the pixel-shuffled width)
VISION_OF: dict[str, dict[str, Any]] = {
    "llama4": {"intermediate_size": 256, "projector_input_dim": 64, "projector_output_dim": 64, "vision_output_dim": 64}
}
# lists of layer indices (feature layers, cross-attention layers): kept inside the tiny depth
LAYER_LISTS = (
    "intermediate_layers_indices",
    "cross_attention_layers",
    "vision_feature_layers",
    "vision_feature_layer",
    "deepstack_visual_indexes",
)
# a part of a module path that puts it on the vision side
VISION_PATH = re.compile(
    r"vision|visual|image|img|patch|pixel|vit\b|projector|connector|merger|perceiver|resampler|qformer|query_tokens"
    r"|vqmodel|mm_proj|adapter|aligner|language_projection|video",
    re.IGNORECASE,
)
SIDES = ("text", "vision")
TRAIN_RTOL = 1e-5  # --train-check: loss and every gradient, relative


# --------------------------------------------------------------------------------------------------- building


def model_classes() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return dict(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def _is_token_field(key: str) -> bool:
    return ("token" in key and key.endswith(("_id", "_index"))) or key.endswith("_token")


def _default_mrope_section(config_cls: type) -> list[int] | None:
    """The M-RoPE sections the modeling code beside ``config_cls`` assumes where the config names none."""
    import importlib

    module = config_cls.__module__.replace(".configuration_", ".modeling_")
    with contextlib.suppress(ImportError, OSError, TypeError):
        source = inspect.getsource(importlib.import_module(module))
        if m := re.search(r'get\("mrope_section",\s*\[([\d,\s]+)\]\)', source):
            return [int(v) for v in m[1].split(",")]
    return None


def _rotary_half(merged: dict[str, Any]) -> int | None:
    """Half the rotary dims of the tiny config ``merged``: what M-RoPE's sections add up to."""
    heads = merged.get("num_attention_heads")
    head = merged.get("qk_rope_head_dim") or merged.get("head_dim")
    if not isinstance(head, int) and isinstance(heads, int) and isinstance(merged.get("hidden_size"), int):
        head = merged["hidden_size"] // heads
    if not isinstance(head, int):
        return None
    rope = merged.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor") or merged.get("partial_rotary_factor") or 1.0
    return int(head * partial) // 2


def _adjust(remap: dict[int, int], vision: dict[str, Any]):
    """``coverage._shrink``'s ``adjust`` for an image-text model: what the tiny sizes imply beyond ``TINY``;
    ``vision``, the model's own vision-config sizes (``VISION_OF``)."""

    def adjust(config_cls: type, have: dict[str, Any], fields: dict[str, Any], in_media: bool) -> None:
        if in_media:
            fields.update({k: v for k, v in vision.items() if k in have})
        if in_media:  # the tiny ints where a vision config has floats or per-axis lists
            for key, value in {**text_coverage.TINY, **VISION}.items():
                old = have.get(key)
                if isinstance(old, bool) or not isinstance(value, int):
                    continue
                if isinstance(old, float):
                    fields[key] = float(value)
                elif isinstance(old, list) and old and all(isinstance(v, int) for v in old) and key in VISION:
                    fields[key] = [value] * len(old)
        fields.update({k: v for k, v in TOP.items() if have.get(k) is not None})
        if isinstance(have.get("layers"), int) and not isinstance(have["layers"], bool):  # Kosmos-2's text depth
            fields["layers"] = text_coverage.LAYERS
        for key in ("image_token_id", "image_token_index"):  # a config that leaves it to the checkpoint (BLIP-2)
            if key in have and have[key] is None and not in_media:
                fields[key] = remap.setdefault(-1, text_coverage.VOCAB - 1 - len(remap))
        merged = {**have, **fields}
        depth = have.get("num_hidden_layers")
        for key, value in merged.items():
            if _is_token_field(str(key)) and isinstance(value, int) and value >= text_coverage.VOCAB:
                # one id is given one new id wherever it appears (the top config and the text config)
                fields[key] = remap.setdefault(value, text_coverage.VOCAB - 1 - len(remap))
            elif key in LAYER_LISTS and isinstance(value, list) and value and all(isinstance(v, int) for v in value):
                kept = [v for v in value if -text_coverage.LAYERS <= v < text_coverage.LAYERS]
                fields[key] = kept or [text_coverage.LAYERS - 1]
            elif (  # a value per layer of the checkpoint: one per tiny layer
                isinstance(value, list)
                and key not in fields
                and isinstance(depth, int)
                and depth > text_coverage.LAYERS
                and len(value) == depth
                and all(isinstance(v, (int, float, str, bool)) for v in value)
            ):
                fields[key] = value[: text_coverage.LAYERS]
        rope = merged.get("rope_parameters")
        half = _rotary_half(merged)
        if isinstance(rope, dict) and "rope_type" in rope and half:
            sections = rope.get("mrope_section")
            if sections is None and "mrope_section" in getattr(config_cls, "ignore_keys_at_rope_validation", ()):
                sections = _default_mrope_section(config_cls)
            if sections:  # rescaled to the tiny head: they must add up to half its rotary dims
                scaled = [max(1, v * half // sum(sections)) for v in sections]
                scaled[0] += half - sum(scaled)
                fields["rope_parameters"] = {**rope, "mrope_section": scaled}

    return adjust


def tiny_config(model_type: str) -> Any:
    from transformers import CONFIG_MAPPING

    adjust = _adjust({}, VISION_OF.get(model_type, {}))
    config = text_coverage._shrink(CONFIG_MAPPING[model_type], media=VISION, adjust=adjust)
    config.use_cache = False  # a training forward: no KV cache
    return config


def build(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random-weight fp32 model of ``model_type``'s image-text class, in eval mode (dropout off)."""
    import transformers

    config = tiny_config(model_type)
    cls = getattr(transformers, model_classes()[model_type])
    torch.manual_seed(seed)
    try:
        model = cls._from_config(config, attn_implementation="sdpa")
    except (ValueError, NotImplementedError, TypeError):  # no sdpa for this model: its default attention
        torch.manual_seed(seed)
        model = cls._from_config(tiny_config(model_type))
    return model.float().eval()


# ----------------------------------------------------------------------------------------------------- inputs

# models whose pixels no rule below reads from the forward and the config: model type → layout
LAYOUTS: dict[str, str] = {"idefics": "crops"}
# token_type_ids as the model reads them: 1 on image tokens (Gemma-3), or 0 on the prefix, image and prompt (PaliGemma)
PREFIX_TOKEN_TYPES = ("paligemma",)


def _forward_args(model: torch.nn.Module) -> set[str]:
    return set(inspect.signature(type(model).forward).parameters)


def _vision(config: Any) -> Any:
    return getattr(config, "vision_config", None) or config


def _size(value: Any) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def layout(model_type: str, model: torch.nn.Module) -> str:
    """How the forward takes an image (the module docstring lists them)."""
    if model_type in LAYOUTS:
        return LAYOUTS[model_type]
    args = _forward_args(model)
    config = model.config
    if "image_grid_thw" in args:
        return "grid"
    if "aspect_ratio_ids" in args:
        return "tiles"
    if "pixel_attention_mask" in args:
        return "crops_masked"
    if getattr(config, "image_grid_pinpoints", None):
        return "anyres"
    if "image_sizes" in args and getattr(_vision(config), "model_type", "") == "pixtral":
        return "sized"
    return "square"


def pixels(model_type: str, model: torch.nn.Module, seed: int = 2) -> dict[str, torch.Tensor]:
    """The image inputs of a batch of ``BATCH`` images of ``IMAGE`` × ``IMAGE`` pixels, in the model's layout."""
    g = torch.Generator().manual_seed(seed)
    vision = _vision(model.config)
    channels = getattr(vision, "num_channels", None) or getattr(vision, "in_channels", None) or 3
    side = _size(getattr(vision, "image_size", IMAGE) or IMAGE)
    kind = layout(model_type, model)
    if kind == "grid":  # flattened patches of patch² × temporal pixels, in merge × merge groups
        patch = _size(vision.patch_size)
        merge = _merge_size(vision)
        temporal = getattr(vision, "temporal_patch_size", None) or 1
        grid = IMAGE // patch
        grid -= grid % merge
        rows = BATCH * grid * grid
        return {
            "pixel_values": torch.randn(rows, channels * temporal * patch * patch, generator=g),
            "image_grid_thw": torch.tensor([[1, grid, grid]] * BATCH),
        }
    square = torch.randn(BATCH, channels, side, side, generator=g)
    if kind == "square":
        return {"pixel_values": square}
    if kind == "sized":
        return {"pixel_values": square, "image_sizes": torch.tensor([[side, side]] * BATCH)}
    if kind == "crops":  # one crop per image
        return {"pixel_values": square[:, None]}
    if kind == "crops_masked":  # one crop per image, every pixel real
        return {
            "pixel_values": square[:, None],
            "pixel_attention_mask": torch.ones(BATCH, 1, side, side, dtype=torch.bool),
        }
    if kind == "anyres":  # the whole image and one crop, as image_grid_pinpoints [[side, side]] gives
        return {"pixel_values": torch.stack([square, square], 1), "image_sizes": torch.tensor([[side, side]] * BATCH)}
    if kind == "tiles":  # one image of one tile (aspect ratio 1:1) per sample, of max_num_tiles
        tiles = getattr(vision, "max_num_tiles", 1)
        values = torch.zeros(BATCH, 1, tiles, channels, side, side)
        values[:, :, 0] = square[:, None]
        mask = torch.zeros(BATCH, 1, tiles, dtype=torch.long)
        mask[:, :, 0] = 1
        return {
            "pixel_values": values,
            "aspect_ratio_ids": torch.ones(BATCH, 1, dtype=torch.long),
            "aspect_ratio_mask": mask,
        }
    raise ValueError(f"no image layout {kind!r}")


def _merge_size(vision: Any) -> int:
    merge = getattr(vision, "spatial_merge_size", None) or getattr(vision, "merge_size", None) or 1
    return _size(merge)


def _rows(features: Any) -> int:
    """How many image tokens ``get_image_features``' answer stands for (its embeddings' rows)."""
    if hasattr(features, "pooler_output") and features.pooler_output is not None:
        features = features.pooler_output
    elif hasattr(features, "last_hidden_state"):
        features = features.last_hidden_state
    if isinstance(features, torch.Tensor):
        return int(features.shape[:-1].numel())
    if isinstance(features, (list, tuple)):
        return sum(_rows(f) for f in features)
    raise TypeError(f"get_image_features returned a {type(features).__name__}")


def image_token_id(config: Any) -> int | None:
    for owner in (config, getattr(config, "text_config", None)):
        for name in ("image_token_id", "image_token_index"):
            value = getattr(owner, name, None)
            if isinstance(value, int):
                return value
    return None


def _bracket_ids(config: Any) -> tuple[int | None, int | None]:
    """The tokens that open and close an image in the prompt, where the config names them."""
    found = []
    for names in (
        ("boi_token_id", "boi_token_index", "image_start_token_id", "vision_start_token_id"),
        ("eoi_token_id", "eoi_token_index", "image_end_token_id", "vision_end_token_id"),
    ):
        found.append(next((getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)), None))
    return found[0], found[1]


def _special_ids(config: Any) -> set[int]:
    """Every token id the config names (at any level), which text tokens must not be."""
    found = set()
    for key, value in config.to_dict().items():
        if isinstance(value, dict):
            found |= {v for k, v in value.items() if _is_token_field(str(k)) and isinstance(v, int)}
        elif _is_token_field(str(key)) and isinstance(value, int):
            found.add(value)
    return found


def _image_features(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    """``get_image_features`` of the model, or of its inner model where only that one has it (DeepSeek-VL)."""
    owner = model if hasattr(model, "get_image_features") else getattr(model, "model", model)
    with torch.no_grad():
        return owner.get_image_features(**batch)


def inputs(model_type: str, model: torch.nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    """A batch of ``BATCH`` samples, each one image (``pixels``) and ``TEXT`` text tokens around its image tokens,
    with labels and the token masks the forward takes."""
    config = model.config
    args = _forward_args(model)
    batch = pixels(model_type, model)
    if "pixel_values" not in args:  # a model of this mapping that reads no image (Evolla reads proteins)
        raise ValueError(f"{type(model).__name__}.forward takes no pixel_values")
    vision = _vision(config)
    if "image_merge_sizes" in args:  # VideoLLaMA-3: the merge of each image's patches
        batch["image_merge_sizes"] = torch.tensor([_merge_size(vision)] * BATCH)
    if "qformer_input_ids" in args:  # InstructBLIP: the instruction, also read by the Q-Former
        batch["qformer_input_ids"] = torch.randint(4, 64, (BATCH, 8), generator=torch.Generator().manual_seed(seed))
    image_token = image_token_id(config)
    per_image = 0
    if "cross_attention_mask" in args:
        per_image = 1  # one image token; the decoder reads the image through cross-attention
    elif "image_embeds_position_mask" in args:  # Kosmos-2: the image's latent queries where the mask says
        image_token, per_image = text_coverage.VOCAB - 64, config.latent_query_num
    elif image_token is not None:
        per_image = _rows(_image_features(model, batch)) // BATCH
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor(sorted(set(range(4, text_coverage.VOCAB - 64)) - _special_ids(config)))
    text = allowed[torch.randint(len(allowed), (BATCH, TEXT), generator=g)]
    opening, closing = _bracket_ids(config)
    image = (
        [t for t in (opening,) if t is not None] + [image_token] * per_image + [t for t in (closing,) if t is not None]
    )
    prompt = 4  # text tokens before the image
    rows = [torch.cat([row[:prompt], torch.tensor(image, dtype=torch.long), row[prompt:]]) for row in text]
    ids = torch.stack(rows) if image else text
    is_image = ids == image_token if image_token is not None else torch.zeros_like(ids, dtype=torch.bool)
    batch["input_ids"] = ids
    labels = ids.masked_fill(is_image, -100)
    batch["labels"] = labels
    if "mm_token_type_ids" in args:
        batch["mm_token_type_ids"] = is_image.long()
    if "image_embeds_position_mask" in args:
        batch["image_embeds_position_mask"] = is_image.long()
    if "image_attention_mask" in args:  # IDEFICS: every text token sees the sample's one image
        batch["image_attention_mask"] = torch.ones(BATCH, ids.shape[1], 1, dtype=torch.long)
    if "token_type_ids" in args:
        if model_type in PREFIX_TOKEN_TYPES:  # 0: the image and the prompt, attended both ways; 1: the answer
            suffix = torch.zeros_like(ids)
            suffix[:, prompt + len(image) :] = 1
            batch["token_type_ids"] = suffix
            batch["labels"] = labels.masked_fill(suffix == 0, -100)
        else:
            batch["token_type_ids"] = is_image.long()
    if "cross_attention_mask" in args:  # every text token sees the image's first tile
        tiles = batch["pixel_values"].shape[2]
        mask = torch.zeros(BATCH, ids.shape[1], 1, tiles, dtype=torch.long)
        mask[..., 0] = 1
        batch["cross_attention_mask"] = mask
    return batch


# ------------------------------------------------------------------------------------------------------ sides

BLOCKS = ("norm", "rope", "gated", "mlp", "attention", "loss")
PATTERNS_OF = {**text_coverage.PATTERNS_OF, "attention": ("causal_attention", "softmax_attention")}


def side_of_path(path: str) -> str:
    """``vision`` when a part of the module path names the vision tower or what feeds it to the decoder."""
    return "vision" if any(VISION_PATH.search(part) for part in path.split(".")) else "text"


class Sides:
    """Which side a graph node of ``model`` is on (the module docstring's rule): as Dynamo recorded it where that
    says (``static``), else the side of the module whose forward runs the graph (``running``)."""

    def __init__(self, model: torch.nn.Module):
        seen: dict[str, set[str]] = {}
        spans: dict[str, list[tuple[int, int, str]]] = {}  # source file → (first, last line, class) of methods
        for path, module in model.named_modules():
            if not path:
                continue
            cls = type(module)
            if cls.__name__ not in seen:
                for fn in vars(cls).values():
                    with contextlib.suppress(OSError, TypeError, ValueError):
                        fn = inspect.unwrap(fn)  # a decorated forward: its own lines, not the decorator's
                        lines, first = inspect.getsourcelines(fn)
                        spans.setdefault(inspect.getsourcefile(fn), []).append(
                            (first, first + len(lines), cls.__name__)
                        )
            seen.setdefault(cls.__name__, set()).add(side_of_path(path))
        # the classes the model uses on one side only
        self.classes = {name: next(iter(sides)) for name, sides in seen.items() if len(sides) == 1}
        self.spans = spans
        self.paths = {id(module): path for path, module in model.named_modules() if path}

    def _of_trace(self, trace: str) -> str | None:
        """The side of the innermost method of a one-side class in a node's stack trace."""
        for file, line in reversed(re.findall(r'File "([^"]+)", line (\d+)', trace)):
            for first, last, name in self.spans.get(file, ()):
                if first <= int(line) < last and name in self.classes:
                    return self.classes[name]
        return None

    def static(self, nodes: Any) -> str | None:
        """The side of the graph nodes of one block as Dynamo recorded them: the innermost module class of one side
        around them, else the method of such a class in their stack trace (a frame resumed after a graph break
        records no module above its own), else the vision side where their module path says so, else None."""
        from fuser.engine.canonical import module_path

        for node in nodes:
            for path, kind in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
                if not str(path).startswith("G[") and _class_name(kind) in self.classes:
                    return self.classes[_class_name(kind)]
            if side := self._of_trace(node.meta.get("stack_trace") or ""):
                return side
            if side_of_path(module_path(node)) == "vision":  # a vision module called from the top-level forward
                return "vision"
        return None

    def classes_around(self, nodes: Any) -> set[str]:
        """The module classes Dynamo recorded around ``nodes``, and those whose methods their stack traces pass
        through (the frame's own module, which its records leave out)."""
        names = set()
        for node in nodes:
            names |= {_class_name(kind) for _, kind in (node.meta.get("nn_module_stack") or {}).values()}
            for file, line in re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or ""):
                names |= {name for first, last, name in self.spans.get(file, ()) if first <= int(line) < last}
        return names

    def running(self) -> str | None:
        """The side of the innermost module of the model whose forward is running (read from the Python frames: a
        compiled graph runs inside the frame of the module it was traced from)."""
        frame = inspect.currentframe()
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module) and id(owner) in self.paths:
                return side_of_path(self.paths[id(owner)])
            frame = frame.f_back
        return None


def _class_name(kind: Any) -> str:
    """A module class's name, from the class or the qualified name Dynamo recorded in ``nn_module_stack``."""
    return getattr(kind, "__name__", None) or str(kind).rsplit(".", 1)[-1].strip("'>")


@contextlib.contextmanager
def _module_stack(model: torch.nn.Module, stack: list[str]):
    """``stack`` holds the paths of the modules whose forward is running, innermost last."""
    handles = []
    for path, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda *_, p=path: stack.append(p)))
        handles.append(module.register_forward_hook(lambda *_: None if stack.pop() else None, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# un-gated MLPs a module may hold besides the one ``coverage._ungated_up_projection`` finds: (up, down) names
EXTRA_UNGATED_PAIRS = (("intermediate_query", "output_query"),)  # a Q-Former layer's feed-forward of its queries


def _linears(module: torch.nn.Module) -> list[torch.nn.Linear]:
    """The linear layers among ``module``'s children, and in its children that are lists or sequences of layers."""
    found = []
    for child in module.children():
        layers = list(child) if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)) else [child]
        found += [c for c in layers if isinstance(c, torch.nn.Linear)]
    return found


def _is_activation(module: torch.nn.Module) -> bool:
    return type(module).__module__ in ("torch.nn.modules.activation", "transformers.activations")


def _ungated_mlp_counters(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose runs count ``module``'s un-gated MLPs: a module that holds at least two linears and one
    activation module and is no gated MLP nor attention (a projector's ``linear_1, act, linear_2``, a merger's
    ``Sequential(Linear, GELU, Linear)``: ``module`` itself, a run that ran its activation), the activation modules
    of one holding several; else ``coverage._ungated_up_projection``'s first
    projection (an MLP that calls its activation as a function), and a Q-Former layer's second feed-forward."""
    children = dict(module.named_children())
    if text_coverage._is_gated_mlp_module(module):
        # a gated MLP with a second activation before it (GLM-4V's patch merger: proj → norm → act1 → gated MLP):
        # the activation modules besides the gate's ``act_fn`` are an un-gated block between projections
        activations = {name: c for name, c in children.items() if _is_activation(c)}
        return [c for name, c in activations.items() if name != "act_fn"] if len(activations) > 1 else []
    if _is_attention_module(module):
        return []
    activations = [c for c in children.values() if _is_activation(c)]  # a Sequential's count as its own
    runs = not isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict))  # a list is never called itself
    if len(activations) == 1 and len(_linears(module)) >= 2 and runs:
        # one MLP a run of the module, however often it calls its activation (Llama-4's pixel-shuffle MLP applies
        # it again after fc2: an activation of the block's output, no second MLP)
        return [module]
    if activations and len(_linears(module)) >= 2:
        return activations
    first = text_coverage._ungated_up_projection(module)
    found = [children[up] for up, down in EXTRA_UNGATED_PAIRS if up in children and down in children]
    return [first, *found] if first is not None else found


def _is_attention_module(module: torch.nn.Module) -> bool:
    return "attention" in type(module).__name__.lower()


@contextlib.contextmanager
def _count_sdpa(counter: Counter, stack: list[str]):
    """Count calls of ``F.scaled_dot_product_attention`` per side of the module running it."""
    original = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        counter[(side_of_path(stack[-1] if stack else ""), "attention")] += 1
        counter[(side_of_path(stack[-1] if stack else ""), "sdpa")] += 1
        return original(*args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = counted
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def eager_counts(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What one eager forward with labels runs, per side: norms, rotary applications, gated and un-gated MLPs,
    attention calls, the lm_head's loss (``coverage.eager_counts``' rules, each block on the side of its module);
    ``ran`` the modules per side that ran, ``gated_classes`` the gated MLP classes that ran."""
    counter: Counter = Counter()
    stack: list[str] = []
    handles = []
    gated_classes: set[str] = set()
    ran: Counter = Counter()
    sdpa_before: dict[torch.nn.Module, int] = {}
    tests = (("norm", text_coverage._is_norm_module), ("gated", text_coverage._is_gated_mlp_module))
    for block, test in tests:
        for path, module in [(p, m) for p, m in model.named_modules() if test(m)]:
            if not any(test(d) for d in module.modules() if d is not module):  # innermost only
                side = side_of_path(path)
                if block == "gated":
                    gated_classes.add(type(module).__name__)
                handles.append(module.register_forward_hook(lambda *_, k=(side, block): counter.update([k])))
    for path, module in model.named_modules():
        side = side_of_path(path)
        for up in _ungated_mlp_counters(module):
            if up is module:  # one count a run of the module in which its activation ran (at least once)
                activation = next(c for c in module.children() if _is_activation(c))
                calls = Counter()
                handles += [
                    activation.register_forward_hook(lambda *_, c=calls: c.update(["act"])),
                    module.register_forward_pre_hook(lambda *_, c=calls: c.clear()),
                    module.register_forward_hook(
                        lambda *_, c=calls, k=(side, "mlp"): counter.update([k] if c["act"] else [])
                    ),
                ]
                continue
            handles.append(up.register_forward_hook(lambda *_, k=(side, "mlp"): counter.update([k])))
        if path:
            handles.append(module.register_forward_hook(lambda *_, s=side: ran.update([s])))
        inner = [d for d in module.modules() if d is not module and _is_attention_module(d)]
        if _is_attention_module(module) and not inner:
            # an attention module that calls no SDPA (a model without it: matmul and softmax) counts once a call
            before = lambda *_, m=module: sdpa_before.__setitem__(m, _sdpa(counter))  # noqa: E731
            after = lambda *_, m=module, s=side: _no_sdpa(counter, sdpa_before, m, s)  # noqa: E731
            handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    head = _output_embeddings(model)
    if head is not None:
        handles.append(head.register_forward_hook(lambda *_: counter.update([("text", "head")])))
    rotary = _SideCounter(counter, stack)
    try:
        with _module_stack(model, stack), _count_sdpa(counter, stack), torch.no_grad():
            with text_coverage._count_rotary_calls(model, rotary):
                out = model(**batch)
    finally:
        for h in handles:
            h.remove()
    counts: dict[str, Any] = {}
    for side in SIDES:
        counts[side] = {b: counter[(side, b)] for b in BLOCKS if b != "loss"}
        counts[side]["eager_attention"] = counter[(side, "eager_attention")]
        counts[side]["eager_attention_classes"] = sorted(
            {name for (s, name), _ in counter.items() if s == side and name[:1].isupper()}
        )
    loss = getattr(out, "loss", None)
    counts["text"]["loss"] = int(loss is not None and counter[("text", "head")] > 0)
    counts["vision"]["loss"] = 0
    counts["ran"] = dict(ran)
    counts["gated_classes"] = sorted(gated_classes)
    return counts


def _output_embeddings(model: torch.nn.Module) -> torch.nn.Module | None:
    """The lm_head: the model's output embeddings, else the first a submodule gives (BLIP's text decoder: the
    top-level model returns None)."""
    for module in model.modules():
        try:
            head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
        except (NotImplementedError, AttributeError):
            head = None
        if head is not None:
            return head
    return None


def _sdpa(counter: Counter) -> int:
    return sum(v for (_, block), v in counter.items() if block == "sdpa")


def _no_sdpa(counter: Counter, before: dict[torch.nn.Module, int], module: torch.nn.Module, side: str) -> None:
    if _sdpa(counter) == before.pop(module, -1):
        counter.update([(side, "attention"), (side, "eager_attention"), (side, type(module).__name__)])


class _SideCounter(Counter):
    """A counter whose increments also count in ``target`` under (side of the running module, key)."""

    def __init__(self, target: Counter, stack: list[str]):
        super().__init__()
        self.target, self.stack = target, stack

    def __setitem__(self, key: Any, value: int) -> None:
        delta = value - self.get(key, 0)
        super().__setitem__(key, value)
        self.target[(side_of_path(self.stack[-1] if self.stack else ""), key)] += delta


# ------------------------------------------------------------------------------------------------ fuser side


def _sdpa_calls(gm: torch.fx.GraphModule, rewritten: set[Any], sides: Sides) -> list[tuple[str | None, str]]:
    """(static side, how it runs) of each SDPA call in ``gm``: ``native`` (no mask), ``rewritten`` (a mask fuser's
    ``causal_attention`` replaces) or ``masked``."""
    calls = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.nn.functional.scaled_dot_product_attention:
            mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
            how = "rewritten" if node in rewritten else "native" if mask is None else "masked"
            calls.append((sides.static([node]), how))
    return calls


def _written_sdpa_call(match: Any, sides: Sides) -> tuple[str | None, str]:
    """(static side, how it runs) of the SDPA call a ``softmax_attention`` match writes: ``native`` without a mask,
    ``masked`` with one (an additive mask, or ``nn.MultiheadAttention``'s ``attn_mask``/``key_padding_mask``)."""
    masks = ("mask", "attn_mask", "key_padding_mask")
    masked = any(isinstance(match.found.bindings.get(name), torch.fx.Node) for name in masks)
    return sides.static([match.found.root, *match.found.nodes]), "masked" if masked else "native"


def fuser_counts(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], eager: dict[str, Any], config: Any = None
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, list[str]]], Any]:
    """``fuser.explain``'s fused ops as the forward ran them, per side and block, the near-miss reasons per side and
    block (distinct, shortened), and the report. Attention: the SDPA calls of the graphs (read while explain
    matches them) that run without a mask or that ``causal_attention`` rewrites, and those ``softmax_attention``
    writes without a mask, once per run of their graph. A
    gated match outside the eager model's gated MLP classes (a gated norm's ``norm(x) * silu(z)``) counts apart,
    under ``gated_elsewhere``."""
    import importlib

    import fuser

    fuser_report = importlib.import_module("fuser.report")  # the module; ``fuser.report`` is also a function

    sides = Sides(model)
    graph_sides: list[Counter] = []  # per captured graph: the side of the module running it, per run
    sdpa: list[list[tuple[str | None, str]]] = []  # per captured graph: its SDPA calls
    graph_of: dict[int, int] = {}  # id of a match or near-miss → its graph
    find_matches = fuser_report.find_matches

    def find_and_read(gm: torch.fx.GraphModule, patterns: Any, cfg: Any) -> Any:
        result = find_matches(gm, patterns, cfg)
        index = len(graph_sides)
        graph_of.update({id(x): index for x in (*result.matches, *result.near_misses)})
        rewritten = {m.found.root for m in result.matches if m.pattern == "causal_attention"}
        written = [m for m in result.matches if m.pattern == "softmax_attention"]
        sdpa.append(_sdpa_calls(gm, rewritten, sides) + [_written_sdpa_call(m, sides) for m in written])
        ran: Counter = Counter()
        graph_sides.append(ran)
        getattr(gm, "real_recompile", lambda: None)()  # a lazy graph module's forward calls gm.forward again
        forward = gm.forward

        def counted(*args: Any) -> Any:
            ran[sides.running() or "text"] += 1
            return forward(*args)

        gm.forward = counted  # explain runs each captured graph through gm.forward
        return result

    torch._dynamo.reset()
    fuser_report.find_matches = find_and_read
    try:
        report = fuser.explain(model, config=config, **batch)
    finally:
        fuser_report.find_matches = find_matches

    def runs_by_side(static: str | None, graph: int) -> Counter:
        """A block's runs per side: all on its static side where Dynamo's records say it, else on the side of the
        module that ran its graph each time."""
        ran = graph_sides[graph]
        return Counter({static: sum(ran.values())}) if static else ran

    counts = {
        s: {b: 0 for b in BLOCKS} | {"gated_elsewhere": [], "native_attention": 0, "masked_attention": 0} for s in SIDES
    }
    block_of = {p: b for b, patterns in PATTERNS_OF.items() for p in patterns}
    gated_classes = set(eager["gated_classes"])
    for m in report.matches:
        block = block_of.get(m.pattern)
        if block is None or block == "attention":  # attention: from the graphs' SDPA calls, below
            continue
        nodes = (m.found.root, *m.found.nodes)
        for side, n in runs_by_side(sides.static(nodes), graph_of[id(m)]).items():
            if block == "gated" and not gated_classes & sides.classes_around(nodes):
                counts[side]["gated_elsewhere"].append(m.module)
                continue
            counts[side][block] += n * (text_coverage._rotated_tensors(m) if block == "rope" else 1)
    for graph, calls in enumerate(sdpa):
        for static, how in calls:
            for side, n in runs_by_side(static, graph).items():
                if how != "masked":
                    counts[side]["attention"] += n
                if how in ("native", "masked"):
                    counts[side][f"{how}_attention"] += n
    reasons: dict[str, dict[str, list[str]]] = {s: {b: [] for b in BLOCKS} for s in SIDES}
    for nm in report.near_misses:
        block = block_of.get(nm.pattern)
        if block is None or not nm.applicable:
            continue
        text = text_coverage._shorten(nm.reason, 400)
        for side in runs_by_side(sides.static((nm.node, *nm.nodes)), graph_of[id(nm)]) or ["text"]:
            if text not in reasons[side][block]:
                reasons[side][block].append(text)
    return counts, reasons, report


# ---------------------------------------------------------------------------------------------------- records

NO_PATTERN = "no pattern for this block"


def _no_near_miss(block: str, eager: dict[str, Any], fused: dict[str, Any], skipped: tuple[str, ...] = ()) -> str:
    """What a block fuser fused fewer of than eager runs, with no decline to say why, is; ``skipped``: the functions
    Dynamo ran eagerly (``Report.skipped_frames``), where a block it never captured would be."""
    if block == "attention":
        if fused["masked_attention"]:
            return f"{NO_PATTERN}: SDPA with a mask fuser does not rewrite (it rewrites causal and window masks)"
        if eager["eager_attention"]:
            names = ", ".join(eager["eager_attention_classes"])
            return f"{NO_PATTERN}: attention that calls no F.scaled_dot_product_attention ({names})"
        return "fewer SDPA calls in the captured graphs than eager runs"
    if skipped:
        return f"not captured: Dynamo ran code eagerly ({'; '.join(skipped)})"
    return "no known form matched, and fuser reported no near-miss"


def verdict(
    block: str, eager: dict[str, Any], fused: dict[str, Any], reasons: list[str], skipped: tuple[str, ...] = ()
) -> dict[str, Any]:
    """One side's block cell, as ``coverage.verdict``; a miss with no near-miss says fuser has no pattern for it, or
    that Dynamo ran code eagerly (``skipped``)."""
    cell = text_coverage.verdict(eager[block], fused[block], reasons or [_no_near_miss(block, eager, fused, skipped)])
    if block == "attention" and cell["status"] == "fused" and fused["native_attention"] == fused["attention"]:
        cell["text"] += " (SDPA, no mask)"
    return cell


def run_one(model_type: str, with_train_check: bool = False, config: Any = None) -> dict[str, Any]:
    """The record of one image-text model type: failed (with the stage and the reason) or its blocks per side."""
    record: dict[str, Any] = {"model_type": model_type, "class": model_classes()[model_type]}
    stage = "build"
    try:
        model = build(model_type)
        stage = "inputs"
        batch = inputs(model_type, model)
        record["inputs"] = {k: list(v.shape) for k, v in batch.items()}
        stage = "eager forward"
        eager = eager_counts(model, batch)
        if not eager["ran"].get("vision"):
            raise RuntimeError("the vision tower did not run on these inputs")
        stage = "fuser.explain"
        fused, reasons, report = fuser_counts(model, batch, eager, config)
    except Exception as error:  # recorded, the run goes on
        text = text_coverage._shorten(f"{type(error).__name__}: {error}", 200)
        return {**record, "status": "failed", "reason": f"{stage}: {text}", "traceback": traceback.format_exc()[-2000:]}
    sides = {}
    for side in SIDES:
        sides[side] = {
            b: {
                "eager": eager[side][b],
                "fused": fused[side][b],
                "reasons": reasons[side][b],
                **verdict(b, eager[side], fused[side], reasons[side][b], tuple(report.skipped_frames)),
            }
            for b in BLOCKS
        }
        if fused[side]["gated_elsewhere"]:
            sides[side]["gated"]["text"] += f" (+{len(fused[side]['gated_elsewhere'])} outside an MLP)"
    record.update(status="ok", sides=sides, counts=dict(report.counts), graph_breaks=report.graph_breaks)
    record["variants"] = sorted({f"{m.pattern}:{m.variant}" for m in report.matches})
    if with_train_check:
        try:
            record["train_check"] = text_coverage.train_check(build(model_type), batch, rtol=TRAIN_RTOL)
        except Exception as error:  # a backend's failure says what it raised after "raised:"
            why = str(error).split("raised:", 1)[-1].split("Set TORCHDYNAMO_VERBOSE")[0]
            record["train_check"] = text_coverage._shorten(f"error: {type(error).__name__}: {why}", 200)
    return record


# the blocks besides attention: norms and LayerNorms, rope, MLPs gated or not, the loss (fuser's own kernels; attention
# counts as fused where SDPA runs it as PyTorch's fused kernels do, which the summary reports on its own too)
KERNEL_BLOCKS = tuple(b for b in BLOCKS if b != "attention")


def side_fused(record: dict[str, Any], side: str, blocks: tuple[str, ...] = BLOCKS) -> bool:
    """Every one of ``blocks`` of ``side`` that the eager model runs is fused (and it runs at least one)."""
    cells = [c for b, c in record["sides"][side].items() if b in blocks]
    return all(c["status"] in ("fused", "absent") for c in cells) and any(c["status"] == "fused" for c in cells)


# ----------------------------------------------------------------------------------------------------- report


def totals(records: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in records if r["status"] == "ok"]
    per_block = {}
    for side in SIDES:
        for b in BLOCKS:
            cells = [r["sides"][side][b] for r in ok]
            per_block[f"{side} {b}"] = {
                "architectures_running_it": sum(c["eager"] > 0 for c in cells),
                "architectures_fused": sum(c["status"] == "fused" for c in cells),
                "eager_ops": sum(c["eager"] for c in cells),
                "fused_ops": sum(min(c["fused"], c["eager"]) for c in cells),
                "over": sum(c["status"] == "over" for c in cells),
            }
    return {
        "model_types": len(records),
        "failed": len(records) - len(ok),
        "buildable": len(ok),
        "text_fused": sum(side_fused(r, "text") for r in ok),
        "vision_fused": sum(side_fused(r, "vision") for r in ok),
        "fully_fused": sum(side_fused(r, "text") and side_fused(r, "vision") for r in ok),
        "kernel_blocks_fused": sum(
            side_fused(r, "text", KERNEL_BLOCKS) and side_fused(r, "vision", KERNEL_BLOCKS) for r in ok
        ),
        "false_matches": sum(s["over"] for s in per_block.values()),
        "per_block": per_block,
        "train_check": dict(Counter(r["train_check"].split(":")[0] for r in ok if "train_check" in r)),
    }


def _reason_key(reason: str) -> str:
    """A reason with what differs between architectures folded: graph nodes, class names, sizes, file lines."""
    reason = re.sub(r"`%[^`]*`", "`(a graph node)`", reason)
    reason = re.sub(r"(F\.scaled_dot_product_attention) \([^)]*\)", r"\1", reason)
    reason = re.sub(r"_\d+\b", "_N", text_coverage._shorten(reason, 160))
    reason = re.sub(r"modeling_\w+\.py:\d+", "modeling_*.py", reason)
    return re.sub(r"\b\d+\b", "N", reason)


def miss_reasons(records: list[dict[str, Any]]) -> list[tuple[str, str, list[str]]]:
    """(side and block, reason, the architectures it blocks), most architectures first."""
    found: dict[tuple[str, str], list[str]] = {}
    for r in records:
        if r["status"] != "ok":
            continue
        for side in SIDES:
            for b, cell in r["sides"][side].items():
                if cell["status"] == "partial":
                    reasons = cell["reasons"] or [cell["text"].split(": ", 1)[-1]]
                    for reason in dict.fromkeys(_reason_key(x) for x in reasons):
                        found.setdefault((f"{side} {b}", reason), []).append(r["model_type"])
    return sorted(((k[0], k[1], v) for k, v in found.items()), key=lambda item: (-len(item[2]), item[0]))


def _cell(cell: dict[str, Any], block: str) -> str:
    if cell["status"] == "absent":
        return ""
    mark = {"fused": "", "partial": " ✗", "over": " OVER"}[cell["status"]]
    return f"{block} {cell['fused']}/{cell['eager']}{mark}"


def markdown(records: list[dict[str, Any]], command: str, started: str, seconds: float) -> str:
    t = totals(records)
    n = t["buildable"]
    lines = [
        "# Coverage: which blocks of each transformers image-text model fuser fuses, per side (CPU, fp32, tiny)",
        "",
        f"- command: `{command}`",
        f"- date: {started} (UTC), {seconds / 60:.1f} min",
        f"- versions: {text_coverage._versions()}; device: CPU",
        "- models: every `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES` type asked for, built tiny from its config: "
        f"text "
        f"{text_coverage.LAYERS} layers, hidden 64, 4 heads × 16, 2 kv heads, vocab {text_coverage.VOCAB}; vision "
        f"tower 2 layers, width 64, image {IMAGE} × {IMAGE}, patches of 8 (`coverage_vlm.VISION`)",
        f"- inputs: {BATCH} samples, each one image (`pixel_values` in the model's layout, with `image_grid_thw`, "
        "`image_sizes`, pixel masks, aspect-ratio ids as it takes them) and "
        f"{TEXT} text tokens around as many image tokens as `get_image_features` gives; labels the ids, image "
        "tokens -100; `fuser.explain` with the default FuserConfig",
        "- sides: a block is the vision side's when a part of its module path says vision, visual, image, patch, "
        "video, projector, connector, merger, aligner, adapter, perceiver, resampler or qformer; everything else, "
        "and the loss, is the text side. A fused op or a decline: the innermost module class around its nodes "
        "that the model uses on one side only, else the method of such a class in its stack trace, else its module "
        "path if it says vision, else the module whose forward ran its graph (`coverage_vlm.py`'s docstring)",
        "- counts (fuser / eager): norm = RMSNorm and LayerNorm modules run; rope = tensors rotated by a "
        "`*rot*apply*` function; gated = gated MLP modules; mlp = un-gated MLPs (activation modules of a module "
        "holding two linears or more, or runs of a known up projection); attention = "
        "SDPA calls (or attention modules calling none), fused when the graph runs them without a mask or fuser "
        "rewrites the mask; loss = the lm_head's loss. ✗ = fewer fused than run; OVER = more (a false match)",
        "",
        "## Summary",
        "",
        f"Of {n} buildable architectures ({t['model_types']} model types; {t['failed']} could not be built tiny or "
        "take these inputs, listed at the end):",
        "",
        f"- **text side all fused: {t['text_fused']}/{n}**",
        f"- **vision side all fused: {t['vision_fused']}/{n}**",
        f"- **both: {t['fully_fused']}/{n}**",
        f"- both sides, every block but attention (norms, rope, MLPs, the loss): **{t['kernel_blocks_fused']}/{n}**",
        f"- false matches (fuser above eager): **{t['false_matches']}**",
        "",
        "| side, block | architectures running it | fully fused | ops eager runs | ops fused | over |",
        "|---|---|---|---|---|---|",
    ]
    for key, s in t["per_block"].items():
        if s["architectures_running_it"] or s["over"]:
            lines.append(
                f"| {key} | {s['architectures_running_it']} | {s['architectures_fused']} | {s['eager_ops']} | "
                f"{s['fused_ops']} | {s['over']} |"
            )
    if t["train_check"]:
        lines += [
            "",
            f"Training step (fp32, aot_eager, strict) vs eager, loss and every gradient within {TRAIN_RTOL:g} "
            "relative: " + ", ".join(f"{k}: {v}" for k, v in t["train_check"].items()),
        ]
    lines += ["", "## Miss reasons, by the architectures they block", "", "| side, block | reason | archs | e.g. |"]
    lines.append("|---|---|---|---|")
    for where, reason, archs in miss_reasons(records):
        lines.append(f"| {where} | {reason.replace('|', '/')} | {len(archs)} | {', '.join(archs[:4])} |")
    train = any("train_check" in r for r in records)
    lines += ["", "## Architectures", "", "| model type | text side | vision side | text all | vision all |"]
    lines[-1] += " train step |" if train else ""
    lines.append("|---" * (5 + train) + "|")
    for r in records:
        if r["status"] != "ok":
            continue
        cells = [", ".join(filter(None, (_cell(c, b) for b, c in r["sides"][s].items()))) for s in SIDES]
        flags = ["yes" if side_fused(r, s) else "no" for s in SIDES]
        row = f"| {r['model_type']} | {cells[0]} | {cells[1]} | {flags[0]} | {flags[1]} |"
        if train:
            row += f" {r.get('train_check', '').replace('|', '/')} |"
        lines.append(row)
    lines += ["", "## Why not: each miss and the reason fuser gives", ""]
    for r in records:
        if r["status"] != "ok":
            continue
        misses = [
            f"{side} {b} {c['text']}"
            for side in SIDES
            for b, c in r["sides"][side].items()
            if c["status"] in ("partial", "over")
        ]
        if misses:
            lines.append(f"- **{r['model_type']}**: " + "; ".join(misses))
    lines += ["", "## Not buildable: cannot be built tiny or take these inputs", ""]
    for r in records:
        if r["status"] != "ok":
            lines.append(f"- **{r['model_type']}**: {r['reason']}")
    return "\n".join(lines) + "\n"
