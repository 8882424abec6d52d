"""DeepSpeed ZeRO-3: each decoder layer one ZeRO-3 leaf module, so that its blocks are in one graph.

ZeRO-3 gathers a module's parameters in a forward pre-hook that DeepSpeed registers on every submodule and marks
``torch.compiler.disable``: Dynamo breaks the graph at each of them, so a decoder layer comes to fuser in pieces
(its norm, each projection, its gated activation apart) and none of its blocks can be matched. A *leaf* module
(``deepspeed.utils.set_z3_leaf_modules``, DeepSpeed's own mechanism, made for MoE layers) has its parameters
gathered at once by its own hook, and DeepSpeed registers no hooks inside it: the layer is then one graph.

:func:`mark_layers_as_zero3_leaves` marks the layers so, chosen by structure, not by class name: the entries of the
outermost ``nn.ModuleList`` whose entries are two or more modules of one class holding parameters (transformers'
``model.layers``, GPT-2's ``h``, peft-wrapped or not). A layer's parameters are then gathered together while the
layer runs, forward and backward, as DeepSpeed recommends for MoE layers; no more than one layer's.

DeepSpeed reads the flag when ``deepspeed.initialize`` (the Trainer's, accelerate's) builds its ZeRO-3 hooks, so it
must be set before: :func:`fuser.optimize_` sets it, where DeepSpeed is installed (:func:`fuser.optimize`, which
leaves the user's model as it is, warns at the first call under ZeRO-3 instead). The flag is the attribute
``_z3_leaf`` that ``deepspeed.utils.set_z3_leaf_module`` sets (and nothing else does): it is set directly, so that
fuser never imports DeepSpeed; without ZeRO-3 nothing reads it. A leaf's gradients are collected only when an
input of the leaf needs a gradient, so where the input embedding is frozen (LoRA), the first call after ZeRO-3 has
partitioned the layers registers transformers' ``enable_input_require_grads`` hook
(:func:`first_layer_input_requires_grad`).
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import sys
import warnings
import weakref
from functools import cache
from typing import Any

import torch

log = logging.getLogger("fuser")

# the attribute deepspeed.utils.set_z3_leaf_module(module, flag) sets, and deepspeed.utils.z3_leaf_module reads
Z3_LEAF_ATTRIBUTE = "_z3_leaf"
# the models whose layers mark_layers_as_zero3_leaves marked (optimize_'s): fuser may add the hook they need
MARKED: weakref.WeakSet = weakref.WeakSet()


@cache
def deepspeed_installed() -> bool:
    """Whether DeepSpeed can be imported here (looked up, not imported)."""
    return "deepspeed" in sys.modules or importlib.util.find_spec("deepspeed") is not None


def repeated_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The entries of the outermost ``nn.ModuleList`` (in module order) whose entries are two or more modules of one
    class with parameters: a model's stack of decoder layers. Empty if the model has none."""
    for one in model.modules():  # pre-order: an outer list comes before the lists inside its entries
        if not isinstance(one, torch.nn.ModuleList):
            continue
        entries = list(one)
        if len(entries) >= 2 and len({type(e) for e in entries}) == 1 and any(True for _ in entries[0].parameters()):
            return entries
    return []


def mark_layers_as_zero3_leaves(model: torch.nn.Module) -> int:
    """Mark :func:`repeated_layers` as DeepSpeed ZeRO-3 leaf modules, where DeepSpeed is installed and no layer is
    marked either way already (the user's choice stands); returns how many it marked."""
    if not deepspeed_installed():
        return 0
    layers = repeated_layers(model)
    if not layers or any(hasattr(layer, Z3_LEAF_ATTRIBUTE) for layer in layers):
        return 0
    for layer in layers:
        setattr(layer, Z3_LEAF_ATTRIBUTE, True)
    MARKED.add(model)
    log.debug("fuser: %d %s layers marked as DeepSpeed ZeRO-3 leaf modules", len(layers), type(layers[0]).__name__)
    return len(layers)


def leaf_layers_partitioned(layers: list[torch.nn.Module]) -> bool:
    """Whether ``layers`` (a model's :func:`repeated_layers`) are ZeRO-3 leaf modules and ZeRO-3 has partitioned
    them (their parameters carry DeepSpeed's ``ds_id``)."""
    return (
        bool(layers)
        and getattr(layers[0], Z3_LEAF_ATTRIBUTE, False) is True
        and any(hasattr(p, "ds_id") for p in layers[0].parameters())
    )


def make_inputs_require_grads(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
    """transformers' ``enable_input_require_grads`` hook, as :func:`first_layer_input_requires_grad` registers it."""
    output.requires_grad_(True)


def first_layer_input_requires_grad(model: torch.nn.Module, layers: list[torch.nn.Module]) -> bool:
    """Under ZeRO-3 with ``layers`` (partitioned, :func:`leaf_layers_partitioned`) as leaf modules, make the first
    layer's input need a gradient where nothing else does (a frozen input embedding, as under LoRA): DeepSpeed
    collects a leaf's gradients in a backward hook that, when no input of the leaf needs a gradient, runs before the
    leaf's backward and fails on its released parameters (DeepSpeed's own ``set_z3_leaf_modules`` fails so too).
    The hook is transformers' ``enable_input_require_grads`` one, on the input embeddings;
    ``ignore_input_require_grads`` keeps it under ZeRO-3 leaves. Returns whether it registered one."""
    from fuser.tracing import _input_require_grads_hooks, input_embeddings

    if not any(p.requires_grad for p in layers[0].parameters()) or _input_require_grads_hooks(model):
        return False
    frozen = [e for e in input_embeddings(model) if not any(p.requires_grad for p in e.parameters())]
    for embedding in frozen:
        embedding.register_forward_hook(make_inputs_require_grads)
    if frozen:
        log.info(
            "fuser: the input embeddings' output now requires grad (transformers' enable_input_require_grads): "
            "under DeepSpeed ZeRO-3 the decoder layers are leaf modules, whose gradients DeepSpeed collects only when "
            "an input of the layer needs a gradient"
        )
    return bool(frozen)


def warn_if_layers_are_not_leaves(model: torch.nn.Module) -> bool:
    """Under DeepSpeed ZeRO-3 (its hooks on the model's :func:`repeated_layers`), warn once where the layers are not
    leaf modules: each submodule's hook then breaks the graph, and no block inside a layer can fuse. Returns whether
    the check could be made (DeepSpeed's hooks are in place), so that the caller stops asking."""
    layers = repeated_layers(model)
    if not layers or not _deepspeed_hook_keys(layers[0]._forward_pre_hooks):
        return False
    if not getattr(layers[0], Z3_LEAF_ATTRIBUTE, False):
        warnings.warn(
            f"fuser: DeepSpeed ZeRO-3 gathers the parameters of each submodule of the {type(layers[0]).__name__} "
            "layers with its own hook, which breaks the graph at every one, so no block inside a layer fuses. "
            "Call fuser.optimize_(model) before deepspeed.initialize (the Trainer's) instead of fuser.optimize: "
            "it marks the layers as ZeRO-3 leaf modules (FuserConfig.zero3_leaf_layers); or mark them yourself "
            "with deepspeed.utils.set_z3_leaf_modules.",
            stacklevel=4,
        )
    return True


# DeepSpeed's module hooks are closures defined in this module (its ZeRO-3 parameter coordination)
_DEEPSPEED_HOOKS_MODULE = "deepspeed.runtime.zero.parameter_offload"


def _output_embeddings(model: torch.nn.Module) -> torch.nn.Module | None:
    """The lm_head: transformers' ``get_output_embeddings()`` of the model or of the model peft wraps."""
    for candidate in (model, getattr(model, "get_base_model", lambda: None)()):
        get = getattr(candidate, "get_output_embeddings", None)
        head = get() if callable(get) else None
        if isinstance(head, torch.nn.Module):
            return head
    return None


def _is_deepspeed_hook(hook: object, depth: int = 0) -> bool:
    """Whether ``hook`` is one of DeepSpeed's ZeRO-3 module hooks, or wraps one (``torch.compiler.disable`` wraps
    with ``functools.wraps``; DeepSpeed's NVTX decorator holds the function in its closure)."""
    hook = inspect.unwrap(hook) if callable(hook) else hook
    if getattr(hook, "__module__", "") == _DEEPSPEED_HOOKS_MODULE:
        return True
    cells = getattr(hook, "__closure__", None) or ()
    return depth < 2 and any(_is_deepspeed_hook(cell.cell_contents, depth + 1) for cell in cells if callable_cell(cell))


def callable_cell(cell: object) -> bool:
    try:
        return callable(cell.cell_contents)
    except ValueError:  # an empty cell
        return False


def _deepspeed_hook_keys(hooks: dict) -> list[int]:
    return [key for key, hook in hooks.items() if _is_deepspeed_hook(hook)]


def gather_lm_head_with_its_caller(model: torch.nn.Module) -> bool:
    """Under DeepSpeed ZeRO-3, let the lm_head and the loss be one graph: the lm_head's weight becomes an external
    parameter (``deepspeed.zero.register_external_parameter``) of the module that calls the lm_head (the causal LM,
    whose forward computes the loss too), which then gathers it with its own hook, and the hooks DeepSpeed put on the
    lm_head module itself are removed: they ended the graph before the lm_head and after it, so the loss's logits
    were an input of its graph and the loss could not fuse. The weight's gradient is reduced into its partition as
    any parameter's (DeepSpeed's gradient hooks are on the parameter, not the module). The cost: DeepSpeed keeps an
    external parameter gathered until the end of the step, so one ``[vocab, hidden]`` weight is whole for the
    forward and backward instead of around the lm_head's two uses. Returns whether it changed anything (once per
    model: without DeepSpeed's hooks on the lm_head, nothing)."""
    if "deepspeed" not in sys.modules:
        return False
    head = _output_embeddings(model)
    if head is None or not _deepspeed_hook_keys(head._forward_pre_hooks):
        return False
    weight = getattr(head, "weight", None)
    caller = next((m for m in model.modules() if any(child is head for child in m.children())), None)
    if caller is None or not hasattr(weight, "ds_id") or not hasattr(caller, "ds_id"):
        return False
    import deepspeed

    deepspeed.zero.register_external_parameter(caller, weight)
    if getattr(head, "bias", None) is not None:
        deepspeed.zero.register_external_parameter(caller, head.bias)
    for hooks in (head._forward_pre_hooks, head._forward_hooks):
        for key in _deepspeed_hook_keys(hooks):
            del hooks[key]
            for extra in (
                "_forward_pre_hooks_with_kwargs",
                "_forward_hooks_with_kwargs",
                "_forward_hooks_always_called",
            ):
                getattr(head, extra, {}).pop(key, None)
    log.debug("fuser: DeepSpeed ZeRO-3 gathers the lm_head's weight in %s's hook", type(caller).__name__)
    return True
