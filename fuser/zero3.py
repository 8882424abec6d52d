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
must be set before: :func:`fuser.optimize_` sets it, where DeepSpeed is installed. The flag is the attribute
``_z3_leaf`` that ``deepspeed.utils.set_z3_leaf_module`` sets (and nothing else does): it is set directly, so that
fuser never imports DeepSpeed; without ZeRO-3 nothing reads it.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from functools import cache

import torch

log = logging.getLogger("fuser")

# the attribute deepspeed.utils.set_z3_leaf_module(module, flag) sets, and deepspeed.utils.z3_leaf_module reads
Z3_LEAF_ATTRIBUTE = "_z3_leaf"


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
    log.debug("fuser: %d %s layers marked as DeepSpeed ZeRO-3 leaf modules", len(layers), type(layers[0]).__name__)
    return len(layers)
