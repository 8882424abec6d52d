"""Gradients that autograd keeps straight from a recorded CUDA graph's memory pool, moved out before the next replay.

With ``FuserConfig(cuda_graphs=True)`` Inductor replays the compiled backward into buffers of its CUDA-graph pool.
When a parameter's ``.grad`` is ``None``, autograd's ``AccumulateGrad`` does not copy the incoming gradient: it
keeps that very tensor as ``.grad`` (it "steals" it). The next replay (the next micro-batch's forward) writes the
same pool memory, so under gradient accumulation the first micro-batch's ``.grad`` is overwritten before the second
adds to it: torch raises "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run"
(a known PyTorch behaviour, linked from ``docs/defaults.md``, ``cuda_graphs``; older releases summed wrongly
without an error). The same happens after
``zero_grad(set_to_none=False)``, which zeroes the pool buffer in place.

Here, each call of a compiled graph first moves every ``.grad`` that is still a previous backward's pool output
into memory of its own (a copy), then runs, then marks the backward nodes of what it returned so that the
parameters whose ``.grad`` that backward creates are remembered. The copy is made only where a ``.grad`` would be
overwritten: after an optimizer step and ``zero_grad()`` (``.grad`` is ``None`` again) nothing is copied, so a
step without accumulation costs a walk over a few autograd nodes and nothing on the GPU.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from fuser import _compat

# parameters whose .grad a compiled backward created from its own output (weak), with that output's address
_PENDING: list[tuple[weakref.ref[torch.Tensor], int]] = []


def move_pool_grads_out() -> int:
    """Give every parameter whose ``.grad`` is still the compiled backward's output tensor (same address as when
    autograd took it) a copy of it instead; returns how many were copied."""
    copied = 0
    pending = list(_PENDING)
    _PENDING.clear()
    for ref, address in pending:
        param = ref()
        grad = None if param is None else param.grad
        if grad is not None and grad.data_ptr() == address:
            param.grad = grad.clone()
            copied += 1
    return copied


def _remember_stolen(grad_inputs: tuple[torch.Tensor | None, ...], node: Any) -> None:
    """A compiled backward node's hook: note each leaf whose ``.grad`` is ``None`` now, so ``AccumulateGrad`` is
    about to keep this node's output tensor as its ``.grad``. Holds no reference to the tensor (a reference would
    make autograd copy it, which is correct but costs the copy at every step)."""
    for grad, (next_fn, _) in zip(grad_inputs, node.next_functions, strict=False):
        if grad is None or next_fn is None or not _compat.is_accumulate_grad(next_fn):
            continue
        leaf = next_fn.variable
        if leaf.grad is None:
            _PENDING.append((weakref.ref(leaf), grad.data_ptr()))


def _watch(outputs: Any) -> None:
    """Hook the compiled backward node behind each tensor in ``outputs`` (through the view nodes that AOT autograd
    puts on an aliased output), once per node."""
    seen: set[int] = set()
    stack = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
    depth = 0
    while stack and depth < 4:  # an output is the compiled node's own, or a view or two of one
        following = []
        for node in stack:
            if id(node) in seen:
                continue
            seen.add(id(node))
            if _compat.is_compiled_backward(node):
                node.register_hook(lambda grad_inputs, grad_outputs, node=node: _remember_stolen(grad_inputs, node))
            elif not _compat.is_accumulate_grad(node):
                following.extend(fn for fn, _ in node.next_functions if fn is not None)
        stack = following
        depth += 1


def _tensors(outputs: Any) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (tuple, list)):
        return [t for t in outputs if isinstance(t, torch.Tensor)]
    return []


def keeping_grads_out_of_pool(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` (what Inductor returned for one graph, called by Dynamo's code) wrapped: before it runs, the
    gradients of earlier backward replays are moved out of the pool; after, the backward of its outputs is
    watched. Attributes Dynamo reads (``_boxed_call``) are kept."""

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _PENDING:
            move_pool_grads_out()
        outputs = compiled(*args, **kwargs)
        if torch.is_grad_enabled():
            _watch(outputs)
        return outputs

    return call
