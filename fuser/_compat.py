"""The one place that touches private PyTorch APIs, so a torch upgrade breaks one small file.

Supported: torch >= 2.11.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx


def inductor_compile(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config_patches: dict[str, Any]
) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=config_patches)


def lookup_dynamo_backend(name: str) -> Callable[..., Any]:
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(name)


def current_post_grad_custom_post_pass() -> Any:
    import torch._inductor.config as inductor_config

    return inductor_config.post_grad_custom_post_pass


def custom_graph_pass_base() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def statically_equal(a: Any, b: Any) -> bool:
    """``a == b`` for ints or SymInts, decided without adding a guard (unknown counts as unequal)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))
