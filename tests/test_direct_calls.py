"""Direct calls (``fuser.inductor.direct_calls``): Inductor's compiled graphs call the fused ops through their
``direct`` overloads, the same functions without the custom-op wrapper; ``experimental.direct_calls=False`` keeps
the default overloads. The overloads compute what the default ones compute, bit for bit; a LoRA training step
through Inductor (CPU, caches off so the post-grad pass runs) calls only direct overloads of functional ops, and
its loss and gradients equal those of the step with the switch off, bit for bit."""

from __future__ import annotations

import copy
import re

import pytest
import torch

import fuser
from fuser.inductor import direct_calls
from tests.models.inductor_steps import N_LAYERS, XDIST_GROUP, inductor_step
from tests.models.tiny import batch, grads, lora_model

OPS = torch.ops.fuser
# one worker runs the module under pytest-xdist (``--dist loadgroup``), beside the other modules that read the steps
# of tests/models/inductor_steps.py (each computed once there)
pytestmark = XDIST_GROUP


@pytest.fixture(autouse=True)
def _no_inductor_cache():
    # a graph from Inductor's (or AOT autograd's) cache skips the post-grad pass
    import torch._functorch.config as functorch_config

    with torch._inductor.config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


def fuser_ops() -> list[str]:
    return sorted(
        name.split("::")[1]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("fuser::") and "." not in name
    )


def test_every_functional_op_has_a_direct_overload_of_its_schema():
    direct = direct_calls.register()
    functional = [n for n in fuser_ops() if not getattr(OPS, n).default._schema.is_mutable]
    mutating = [n for n in fuser_ops() if getattr(OPS, n).default._schema.is_mutable]
    assert functional and mutating  # gated_activation_backward_ and the dx accumulation mutate
    for name in functional:
        default = getattr(OPS, name).default
        overload = direct[default]
        assert overload is getattr(OPS, name).direct
        assert str(overload._schema) == str(default._schema).replace(f"fuser::{name}(", f"fuser::{name}.direct(")
        assert set(overload.tags) == set(default.tags), name
    for name in mutating:
        assert getattr(OPS, name).default not in direct, name


def test_direct_overloads_compute_what_the_default_ones_do():
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.randn(5, 24, generator=g)
    w = torch.randn(24, generator=g)
    a_w = torch.randn(4, 24, generator=g)
    b_w = torch.randn(24, 4, generator=g)
    a = torch.randn(5, 4, generator=g)
    cases = [
        ("rms_norm", (x, w, 1e-6, 0.0, torch.float32, None)),
        ("upcast_linear", (x.to(torch.float16), a_w, None, True)),
        ("lora_sum", (x, a, b_w, 2.0, False, None, True)),
        ("gated_activation", (x, x.flip(0), None, None, 1.0, 1.0, "silu")),
    ]
    direct_calls.register()
    for name, args in cases:
        want = getattr(OPS, name).default(*args)
        got = getattr(OPS, name).direct(*args)
        want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
        for w_, g_ in zip(want, got, strict=True):
            assert not g_.isnan().any(), name
            assert torch.equal(w_, g_), name


def test_direct_overloads_have_the_default_ones_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    direct_calls.register()
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.empty(3, 7, 16, dtype=torch.bfloat16))
        w = mode.from_tensor(torch.empty(16, dtype=torch.bfloat16))
        want = OPS.rms_norm.default(x, w, 1e-6, 0.0, torch.float32, None)
        got = OPS.rms_norm.direct(x, w, 1e-6, 0.0, torch.float32, None)
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]


def step_and_code(config, checkpointing: bool = False):
    """(loss, LoRA gradients, Inductor's generated code) of one step of a tiny bf16 Llama LoRA model (with
    gradient checkpointing: the backward graph recomputes the forward's fused ops, and the gated MLP's backward is
    written in place)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = copy.deepcopy(MODEL)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    run = fuser.optimize(model, config)

    def step():
        out = run(**batch())
        out.loss.backward()
        return out.loss.detach()

    loss, code = run_and_get_code(step)
    return loss, grads(model), "\n".join(code)


MODEL = lora_model(torch.bfloat16, layers=N_LAYERS)  # inductor_steps' "lora" model
CALL = re.compile(r"torch\.ops\.fuser\.(\w+)\.(\w+)\(")


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient checkpointing"])
def test_compiled_step_calls_direct_overloads_and_equals_the_default_ones(checkpointing):
    # step_and_code(fuser.FuserConfig(strict=True), checkpointing), read from inductor_steps (the same model)
    shared = inductor_step("checkpointed lora" if checkpointing else "lora", fuser.FuserConfig(strict=True))
    (loss_on, grads_on), code_on = shared.loss_and_grads(), shared.code
    off_config = fuser.FuserConfig.from_options({"strict": True, "experimental.direct_calls": False})
    loss_off, grads_off, code_off = step_and_code(off_config, checkpointing)
    on, off = CALL.findall(code_on), CALL.findall(code_off)
    assert on and off
    mutating = {n for n in fuser_ops() if getattr(OPS, n).default._schema.is_mutable}
    assert {o for n, o in on if n not in mutating} == {"direct"}, on
    if checkpointing:  # the gated backward written in place: a mutating op, kept on its default overload
        assert ("gated_activation_backward_", "default") in on, on
    assert {o for _, o in off} == {"default"}, off
    assert sorted(n for n, _ in on) == sorted(n for n, _ in off)  # the same calls, only retargeted
    assert torch.equal(loss_on, loss_off)
    assert grads_on.keys() == grads_off.keys()
    for name in grads_on:
        assert torch.equal(grads_on[name], grads_off[name]), name


def test_direct_calls_is_a_bool_option():
    assert fuser.FuserConfig().experimental.direct_calls is True
    assert fuser.FuserConfig.from_options({"experimental.direct_calls": False}).experimental.direct_calls is False
    with pytest.raises(TypeError, match="experimental.direct_calls must be True or False"):
        fuser.FuserConfig(experimental={"direct_calls": "no"})
