"""The harness every model test file shares: one training step, eagerly or through fuser; what fuser fused,
refined and rewrote in it; its loss and every gradient against eager's or a higher-precision run's.

The tiny models and batches are ``tiny.py``'s (with the step checks other test directories import from there:
``assert_training_step_equals_eager``, ``assert_step_as_close_to_fp32_as_eager``, ``assert_same_step``,
``lora_step``); the Inductor steps several files compare with, each computed once per process, are
``inductor_steps.py``'s. The pytest fixtures around these (``rewritten``, ``inductor_caches_off``) are in
``conftest.py`` beside this file.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

import fuser
from tests.models.tiny import N_LAYERS, batch, build, from_config, grads, rel

Step = tuple[torch.Tensor, dict[str, torch.Tensor]]  # (loss, every gradient by parameter name)

# a hidden-1024 Llama layer (2 of them) for the GPU tests at a real width: the Triton kernels' blocks tile it
WIDE_LLAMA = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 8, "num_key_value_heads": 4,
              "head_dim": 128, "attn_implementation": "sdpa"}  # fmt: skip


def build_arch(arch: str, layers: int = N_LAYERS) -> torch.nn.Module:
    """A tiny fp32 causal LM of ``layers`` decoder layers: ``tiny.build(arch)`` (Llama, Mistral, Qwen3, Gemma, OLMo-2:
    random norm weights), or Phi-3 (packed qkv and gate/up projections) or Gemma-3 (1 + w norms around attention and
    MLP, a window of 8)."""
    sizes = {"attn_implementation": "sdpa", "num_hidden_layers": layers}
    if arch == "phi3":
        return from_config("Phi3Config", {**sizes, "pad_token_id": 0})
    if arch == "gemma3":
        return from_config("Gemma3TextConfig", {**sizes, "sliding_window": 8})
    return build(arch, layers=layers)


def train_step(model: torch.nn.Module, config=None, data: dict | None = None, autocast: bool = False, run=None) -> Step:
    """(loss, gradients) of one forward+backward of ``model`` on ``data`` (default ``batch()``): eagerly, through
    ``fuser.optimize(model, config)``, or through ``run`` (``model`` compiled already); under CPU bf16 autocast with
    ``autocast``. The gradients are ``model``'s parameters'."""
    if run is None:
        run = model if config is None else fuser.optimize(model, config)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = run(**(batch() if data is None else data))
    out.loss.backward()
    return out.loss.detach(), grads(model)


def post_grad_step(model: torch.nn.Module, config, data: dict | None = None, autocast: bool = False, device=None):
    """``train_step`` through fuser (Inductor: ``config``'s inner compiler), the batch moved to ``device`` if given,
    and what fuser's post-grad passes rewrote in it ({pass: calls}, every pass the backend has run); Dynamo is reset
    after."""
    backend = fuser.backend(config)
    before = dict(backend.post_grad_counts)
    data = batch() if data is None else data
    if device is not None:
        data = {k: v.to(device) for k, v in data.items()}
    with torch.autocast(device or "cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fuser.optimize(model, config)(**data)
    out.loss.backward()
    counts = {k: v - before.get(k, 0) for k, v in backend.post_grad_counts.items()}
    torch._dynamo.reset()
    return (out.loss.detach(), grads(model)), counts


def fused(config, pattern: str, since: int = 0) -> int:
    """How many ``pattern`` ops the backend of ``config`` fused in its compiles from the ``since``-th on (equal
    configs share one backend, and its results accumulate)."""
    return sum(result.counts.get(pattern, 0) for result in fuser.backend(config).results[since:])


def refined(config, since: int = 0) -> dict[str, int]:
    """What the refinements (``after_apply``) refined in the backend's compiles from the ``since``-th on."""
    total: dict[str, int] = {}
    for result in fuser.backend(config).results[since:]:
        for name, n in result.refined.items():
            total[name] = total.get(name, 0) + n
    return total


def calls(graphs, op) -> list[torch.fx.Node]:
    """The calls of ``op`` in ``graphs`` (e.g. those the ``rewritten`` fixture recorded)."""
    return [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function" and n.target is op]


@contextlib.contextmanager
def inductor_caches_off() -> Iterator[None]:
    """Inductor's FX graph cache and AOT autograd's cache off: a graph from either skips fuser's post-grad passes,
    and with them their counts. The kernels' own compile cache stays on (``force_disable_caches`` would recompile
    every C++ kernel in a fresh directory: a minute or more per test)."""
    import torch._functorch.config as functorch_config

    with torch._inductor.config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


def errors(step: Step, reference: Step) -> tuple[float, dict[str, float]]:
    """The loss's and each gradient's relative distance from ``reference``'s; the same gradients on both sides."""
    (loss, got), (loss_ref, want) = step, reference
    assert got.keys() == want.keys() and got, (sorted(got), sorted(want))
    return rel(loss, loss_ref), {name: rel(g, want[name]) for name, g in got.items()}


def assert_equals_eager(step: Step, eager: Step, loss_tol: float, grad_tol: float) -> None:
    """An fp32 step against eager's: the loss within ``loss_tol`` and every gradient within ``grad_tol`` relative."""
    loss_err, grad_errs = errors(step, eager)
    assert loss_err <= loss_tol, (step[0], eager[0])
    for name, err in grad_errs.items():
        assert err <= grad_tol, f"{name}: {err:.2e}"


def assert_no_further_than_eager(step: Step, eager: Step, reference: Step, factor: float, floor: float) -> None:
    """A half-precision step against eager's at the same precision, both against a higher-precision ``reference``:
    the loss's and every gradient's relative error within ``factor`` times eager's plus ``floor``."""
    loss_err, grad_errs = errors(step, reference)
    eager_loss_err, eager_errs = errors(eager, reference)
    assert loss_err <= factor * eager_loss_err + floor, (step[0], eager[0], reference[0])
    for name, err in grad_errs.items():
        assert err <= factor * eager_errs[name] + floor, f"{name}: fuser {err:.2e}, eager {eager_errs[name]:.2e}"


def assert_as_close_to_fp32_as_eager(step: Step, eager: Step, fp32: Step) -> None:
    """A half-precision (or autocast) step against eager's, both against the same model's fp32 step: the loss within
    2x eager's distance plus 1e-3 of the loss; the gradients' relative errors summed over the model no larger than
    eager's; each gradient within 2x eager's distance + 1e-3. One gradient's half-precision error is one draw of
    rounding noise (``tiny.assert_step_as_close_to_fp32_as_eager`` says how far it was measured to go); a wrong
    gradient is off by about its own size, far past either bar."""
    (loss, got), (loss16, grads16), (loss32, grads32) = step, eager, fp32
    assert abs(loss - loss32) <= 2 * abs(loss16 - loss32) + 1e-3 * abs(loss32), (loss, loss16, loss32)
    errors = {name: (rel(g, grads32[name]), rel(grads16[name], grads32[name])) for name, g in got.items()}
    assert errors and sum(e for e, _ in errors.values()) <= sum(e for _, e in errors.values()), errors
    for name, (err, err_eager) in errors.items():
        assert err <= 2 * err_eager + 1e-3, f"{name}: fuser {err:.2e}, eager {err_eager:.2e} vs fp32"
