"""Training steps of the tiny models through Inductor that several post-grad-pass test modules compare with, each
computed once per pytest process instead of once per test that reads it.

The default step (``FuserConfig(strict=True)``) of one model was compiled by up to five tests of test_gated_mlp,
test_rms_norm and test_direct_calls (through Inductor on CPU a checkpointed peft model's step takes 30-45 s). A step
is a function of its config and of fixed seeds (``build``, ``lora_model``, ``batch``), so it is the same whichever
test computes it first; it is computed as each of those tests did, from a clean Dynamo cache and fresh fuser
backends, with Inductor's graph caches off (a cached graph skips the post-grad passes and their counts), and
Inductor's generated code is kept. The tests that read it share one pytest-xdist group (``XDIST_GROUP``): one worker
computes each step once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Mapping
from types import MappingProxyType

import pytest
import torch

import fuser
from tests.models.harness import inductor_caches_off
from tests.models.tiny import batch, build, checkpointed, grads, lora_model

DEFAULT = fuser.FuserConfig(strict=True)  # the default inner compiler: Inductor
XDIST_GROUP = pytest.mark.xdist_group("inductor_steps")
# Decoder layers of these models: one. What the tests read from the steps is per layer or per norm (the post-grad
# passes' rewrites, the fused ops, the steps bit for bit the steps with a pass off), and the layers are identical, so
# a second layer only doubled each Dynamo trace and Inductor compile; the tests that compare with a step build their
# own models with this count and compute their expectations from it.
N_LAYERS = 1

# name → the model, built afresh (its weights from fixed seeds)
MODELS = {
    "llama": lambda: build("llama", layers=N_LAYERS).train(),
    "gemma": lambda: build("gemma", layers=N_LAYERS).train(),
    "llama bf16": lambda: build("llama", torch.bfloat16, layers=N_LAYERS).train(),
    "gemma bf16": lambda: build("gemma", torch.bfloat16, layers=N_LAYERS).train(),
    "qwen3 bf16": lambda: build("qwen3", torch.bfloat16, layers=N_LAYERS).train(),
    "checkpointed llama": lambda: checkpointed(build("llama", layers=N_LAYERS)),
    # a bf16 Llama with peft's fp32 adapters on every linear layer
    "lora": lambda: lora_model(layers=N_LAYERS),
    "checkpointed lora": lambda: checkpointed(lora_model(layers=N_LAYERS)),
}


@dataclasses.dataclass(frozen=True)
class Step:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]  # every gradient the step formed, by parameter name
    counts: Mapping[str, int]  # the fused ops, by pattern, in the step's graphs (read-only)
    post_grad_counts: Mapping[str, int]  # what fuser's post-grad passes rewrote in the step's graphs (read-only)
    code: str  # Inductor's generated code, forward and backward

    def loss_and_grads(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Copies, as ``lora_step`` returns them (a test must not change the step the next one reads)."""
        return self.loss.clone(), {name: g.clone() for name, g in self.grads.items()}


@contextlib.contextmanager
def isolated_compile() -> Iterator[None]:
    """A compile as each test makes it: from a clean Dynamo cache and fresh fuser backends, with Inductor's graph
    caches off (a cached graph skips the post-grad passes and their counts); both cleared again after."""
    import fuser.dynamo_backend

    torch._dynamo.reset()
    fuser.dynamo_backend._BACKENDS.clear()
    with inductor_caches_off():
        yield
    torch._dynamo.reset()
    fuser.dynamo_backend._BACKENDS.clear()


@functools.cache
def inductor_step(model: str, config: fuser.FuserConfig = DEFAULT) -> Step:
    """One training step of ``MODELS[model]`` through ``fuser.optimize(model, config)`` on ``batch()``."""
    from torch._inductor.utils import run_and_get_code

    assert config.inner_compiler == "inductor", config
    with (
        isolated_compile(),
        torch.random.fork_rng(),  # the builders seed the global RNG: the calling test's stays as it was
    ):
        built = MODELS[model]()
        run = fuser.optimize(built, config)

        def step() -> torch.Tensor:
            out = run(**batch())
            out.loss.backward()
            return out.loss.detach()

        loss, code = run_and_get_code(step)
        backend = fuser.backend(config)
        counts, post_grad = (MappingProxyType(dict(c)) for c in (backend.counts, backend.post_grad_counts))
    return Step(loss, grads(built), counts, post_grad, "\n".join(code))
