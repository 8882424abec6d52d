"""``FuserConfig.ignore_logging`` (src/fuser/tracing.py): a ``logger.warning_once`` between the lm_head and the loss, as
transformers' ``loss_function`` logs it for GPT-2-style classes, breaks no graph under ``fuser.optimize``,
``optimize_`` and ``explain``, so the loss fuses and the step equals eager; Dynamo's setting holds only inside those
calls; switched off (or through ``torch.compile(backend="fuser")``) the break stays, and the reports say where."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

import fuser
from fuser.tracing import skipped_logging_calls

pytest.importorskip("transformers")
import transformers.utils.logging  # noqa: E402,F401  (adds warning_once / info_once to logging.Logger)

LOG = logging.getLogger("tests.tracing")
H, V = 16, 37
AOT = {"strict": True, "inner_compiler": "aot_eager"}


class WarnsBeforeTheLoss(torch.nn.Module):
    """An lm_head, a ``warning_once`` (transformers' ``loss_function``: an unrecognised ``loss_type``), the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(H, V, bias=False)

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(h)
        LOG.warning_once("`loss_type=None` was set in the config but it is unrecognized.")
        return F.cross_entropy(logits.float().view(-1, V), labels.view(-1))


@pytest.fixture
def inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 7, H, generator=g, requires_grad=True), torch.randint(0, V, (2, 7), generator=g)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return WarnsBeforeTheLoss()


def _ignored() -> set:
    config = torch._dynamo.config
    return set(getattr(config, "ignore_logging_functions", None) or getattr(config, "ignore_logger_methods", set()))


def _compiled_since(backend, start: int) -> tuple[dict[str, int], int]:
    """(fused counts, graphs) of what ``backend`` compiled after its first ``start`` graphs (a backend is one object
    per config, shared with the other tests)."""
    results = backend.results[start:]
    counts: dict[str, int] = {}
    for result in results:
        for name, n in result.counts.items():
            counts[name] = counts.get(name, 0) + n
    return counts, len(results)


def _step(run, h, labels):
    h = h.detach().clone().requires_grad_()
    loss = run(h, labels)
    loss.backward()
    return loss.detach(), h.grad


def _assert_equal_to_eager(compiled, model, h, labels):
    loss, dh = _step(compiled, h, labels)
    eager = copy.deepcopy(model)
    loss_ref, dh_ref = _step(eager, h, labels)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dh, dh_ref, rtol=1e-5, atol=1e-6)


def test_the_once_methods_are_the_ones_skipped():
    assert skipped_logging_calls() == [logging.Logger.warning_once, logging.Logger.info_once]


def test_the_skipped_set_can_be_logged_with_compile_metrics():
    """Dynamo logs its config with every compile's metrics by sorting each set and JSON-dumping the result; torch 2.11
    does not leave the ignored-logging set out, and two ``functools.lru_cache`` wrappers (``warning_once``,
    ``info_once``) cannot be sorted: inside fuser's context the set sorts and dumps, and still holds the methods."""
    import json

    from fuser import _compat

    with _compat.dynamo_ignoring_logging(skipped_logging_calls()):
        ignored = _ignored()
        assert json.dumps(sorted(ignored))
        assert logging.Logger.warning_once in ignored and logging.Logger.info_once in ignored
        assert logging.Logger.warning not in ignored


def test_optimize_fuses_the_loss_across_a_warning_once_and_equals_eager(model, inputs):
    before, backend = _ignored(), fuser.backend(AOT)
    start, breaks = len(backend.results), len(backend.breaks)
    compiled = fuser.optimize(model, AOT)
    _assert_equal_to_eager(compiled, model, *inputs)
    assert _compiled_since(backend, start) == ({"linear_cross_entropy": 1}, 1)
    assert backend.breaks[breaks:] == []
    assert _ignored() == before  # held only inside the call
    assert type(compiled).__name__ == "OptimizedModule" and list(compiled.state_dict()) == ["_orig_mod.lm_head.weight"]


def test_optimize_in_place_fuses_the_loss_across_a_warning_once(model, inputs):
    keys, backend = list(model.state_dict()), fuser.backend(AOT)
    start, reference = len(backend.results), copy.deepcopy(model)
    assert fuser.optimize_(model, AOT) is model
    _assert_equal_to_eager(model, reference, *inputs)
    assert _compiled_since(backend, start) == ({"linear_cross_entropy": 1}, 1)
    assert type(model) is WarnsBeforeTheLoss and list(model.state_dict()) == keys


def test_other_compiled_code_still_breaks_at_the_call(model, inputs):
    fuser.optimize(model, AOT)(*inputs)
    graphs = []
    torch.compile(copy.deepcopy(model), backend=lambda gm, _: graphs.append(gm) or gm.forward)(*inputs)
    assert len(graphs) == 2  # Dynamo's default, outside fuser's calls


def test_switched_off_the_break_stays_and_explain_says_where_and_why(model, inputs):
    report = fuser.explain(model, *inputs, config=fuser.FuserConfig(ignore_logging=False))
    assert report.counts == {} and report.graphs == 2, str(report)
    (miss,) = [nm for nm in report.near_misses if nm.pattern == "linear_cross_entropy"]
    assert "the logits are the input `logits`" in miss.reason and "graph break" in miss.reason, miss.reason
    (brk,) = report.breaks
    assert "test_tracing.py:" in brk.where and "LOG.warning_once(" in brk.where, brk.where
    assert any("logging.Logger" in m for m in report.break_messages), report.break_messages
    text = str(report)
    assert "graph breaks" in text and "LOG.warning_once(" in text and "Dynamo's graph-break messages" in text
    assert fuser.explain(model, *inputs).counts == {"linear_cross_entropy": 1}  # on by default


def test_by_name_the_break_stays_and_the_backends_report_says_where(model, inputs):
    backend = fuser.backend(AOT)
    start, breaks = len(backend.results), len(backend.breaks)
    loss = torch.compile(model, backend="fuser", options=dict(AOT))(*inputs)
    loss.backward()
    assert _compiled_since(backend, start) == ({}, 2)
    (brk,) = backend.breaks[breaks:]
    assert "LOG.warning_once(" in brk.where
    assert any("LOG.warning_once(" in b.where for b in fuser.report().breaks)


def _kernel_routed_model() -> torch.nn.Module:
    """Two gradient-checkpointed RMSNorm layers routed as transformers >= 5.25 routes its attention layers through the
    ``kernels`` package (``use_kernelized_func``: each forward sets and restores a context variable), then an lm_head
    and the loss."""
    kernels = pytest.importorskip("kernels")

    @kernels.use_kernel_forward_from_hub("FuserTestScale")
    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * 0.5

    @kernels.use_kernelized_func(scale)
    class NormLayer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(1.0 + 0.2 * torch.randn(H))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return scale(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([NormLayer(), NormLayer()])
            self.lm_head = torch.nn.Linear(H, V, bias=False)

        def forward(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
            return F.cross_entropy(self.lm_head(h).float().view(-1, V), labels.view(-1))

    torch.manual_seed(0)
    return Model()


@pytest.mark.parametrize("api", ["optimize", "optimize_"])
def test_a_checkpointed_layer_that_sets_and_restores_state_is_traced_and_fused(inputs, api):
    """With ``checkpoint_side_effects`` (default) the checkpointed layers are traced: one graph, both norms and the
    loss fused, the step equal to eager, and Dynamo's setting held only inside the call."""
    model = _kernel_routed_model()
    reference = copy.deepcopy(model)
    backend = fuser.backend(AOT)
    start = len(backend.results)
    run = fuser.optimize(model, AOT) if api == "optimize" else fuser.optimize_(model, AOT)
    _assert_equal_to_eager(run, reference, *inputs)
    assert _compiled_since(backend, start) == ({"linear_cross_entropy": 1, "rms_norm": 2}, 1)
    assert not torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint


def test_switched_off_a_checkpointed_layer_that_sets_state_runs_eagerly_and_explain_shows_it(inputs):
    """``checkpoint_side_effects=False``: Dynamo's default, which runs the layers eagerly; their norms do not fuse,
    and explain shows Dynamo's reason."""
    model = _kernel_routed_model()
    torch._dynamo.reset()  # Dynamo marks a frame it gave up on as skipped for good: clear that before and after
    off = fuser.explain(model, *inputs, config=fuser.FuserConfig(checkpoint_side_effects=False))
    assert "rms_norm" not in off.counts, str(off)
    (message,) = [m for m in off.break_messages if "Unsafe side effect" in m]
    assert "checkpoint_side_effects=True" in message and message in str(off), message
    torch._dynamo.reset()
    assert fuser.explain(model, *inputs).counts == {"linear_cross_entropy": 1, "rms_norm": 2}  # on by default


def test_a_checkpointed_transformers_model_fuses_every_block():
    """transformers' own gradient checkpointing on a tiny Llama (with transformers >= 5.25 and ``kernels``, each
    attention layer sets and restores its kernel routing): one graph, every block fused."""
    from tests.models.tiny import batch, build, checkpointed, expected_norms, fused_norms

    model = checkpointed(build("llama"))
    backend = fuser.backend(AOT)
    start = len(backend.results)
    fuser.optimize_(model, AOT)(**batch()).loss.backward()
    counts, graphs = _compiled_since(backend, start)
    assert graphs == 1 and fused_norms(counts) == expected_norms("llama"), counts
    assert counts.get("rope") == 2 and counts.get("swiglu") == 2, counts


def _require_grads_hooks(model: torch.nn.Module) -> list:
    return list(model.get_input_embeddings()._forward_hooks.values())


@pytest.mark.parametrize("api", ["optimize", "optimize_"])
def test_a_checkpointed_lora_model_traces_once_and_trains_as_eager(api):
    """peft LoRA with transformers' non-reentrant checkpointing, whose ``gradient_checkpointing_enable`` hooks the
    input embeddings (``make_inputs_require_grads``): with ``ignore_input_require_grads`` the forward is one graph,
    traced once (Dynamo gives up on no frame), the step equals eager's, and the hook is the model's after the call."""
    from tests.models.tiny import batch, build, checkpointed, grads, with_lora

    model = checkpointed(with_lora(build("llama")))
    (hook,) = _require_grads_hooks(model)
    eager = copy.deepcopy(model)
    want = eager(**batch())
    want.loss.backward()
    backend = fuser.backend(AOT)
    start = len(backend.results)
    compiled = fuser.optimize(model, AOT) if api == "optimize" else fuser.optimize_(model, AOT)
    got = compiled(**batch())
    got.loss.backward()
    counts, graphs = _compiled_since(backend, start)
    blocks = {k: counts.get(k) for k in ("swiglu", "rope", "causal_attention", "linear_cross_entropy")}
    assert graphs == 1 and blocks == {"swiglu": 2, "rope": 2, "causal_attention": 2, "linear_cross_entropy": 1}
    assert not backend.gave_up and _require_grads_hooks(model) == [hook]
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
    want_grads, got_grads = grads(eager), grads(model)
    assert want_grads.keys() == got_grads.keys() and want_grads
    for name, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_hook_stays_under_reentrant_checkpointing_or_when_switched_off():
    """Reentrant checkpointing needs the hook (its layers get no gradients otherwise): it is kept there, and where
    ``ignore_input_require_grads`` is off; under non-reentrant checkpointing it is a no-op inside a call's scope
    and the model's own after."""
    from fuser.dynamo_backend import _calls_scope
    from tests.models.tiny import build, with_lora

    def enabled(**kwargs):
        model = with_lora(build("llama"))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return model, _require_grads_hooks(model)

    for kwargs in ({"use_reentrant": True}, {}):  # without the argument torch's checkpoint is reentrant
        model, hooks = enabled(**kwargs)
        with _calls_scope(model, fuser.backend(AOT))():
            assert _require_grads_hooks(model) == hooks, kwargs
    model, hooks = enabled(use_reentrant=False)
    with _calls_scope(model, fuser.backend({**AOT, "ignore_input_require_grads": False}))():
        assert _require_grads_hooks(model) == hooks
    with _calls_scope(model, fuser.backend(AOT))():
        assert _require_grads_hooks(model) != hooks and len(_require_grads_hooks(model)) == 1
    assert _require_grads_hooks(model) == hooks
