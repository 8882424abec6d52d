"""Inlined ops (``fuser.inductor.inline_ops``): in a compiled GPU graph, a fused op's call is replaced by its body's
buffers and kernel launches, traced at compile time, so that Inductor launches the kernels from its generated code.

Without a GPU, the pass is tested on graphs of fake CUDA tensors: which calls it replaces, what it puts in their
place, and which it leaves, with the reason. Inductor's analysis of which arguments a Triton kernel writes needs a
GPU target; here a stand-in gives the writes read from the kernel's source (where that is the point of the test).
The GPU tests run the compiled steps and compare them with the op calls and with fp32."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_functional as WRAPPER  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import fuser
from fuser import _compat
from fuser.inductor import inline_ops
from fuser.kernels import _triton as tt
from fuser.kernels import launches
from fuser.kernels import rms_norm as R
from tests.models.tiny import batch, build, grads, load_benchmark, rel, with_lora

# what rms_norm's forward kernel stores into, for these launches (no residual: the sum pointer is a placeholder)
RMS_NORM_FWD_WRITES = ["y_ptr", "rstd_ptr"]


@pytest.fixture(autouse=True)
def compiled_kernel(monkeypatch):
    """rms_norm's forward kernel as a ``JITFunction``, and CUDA tensors taking the Triton path, also where the tests
    run Triton's interpreter: wrap_triton leaves an interpreted kernel unwrapped (it runs eagerly), so a launch of
    one is not recorded in a trace; and under the interpreter CUDA tensors take the reference path."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for name, value in list(vars(R).items()):  # the kernel and the jit helpers it calls, which its hash reads
        if isinstance(value, InterpretedFunction):
            monkeypatch.setattr(R, name, JITFunction(value.fn))
    monkeypatch.setattr(tt, "_INTERPRETING", False)


@pytest.fixture
def known_writes(monkeypatch):
    """Inductor's kernel-write analysis, which needs a GPU target, replaced by the writes read off the source."""
    import torch._higher_order_ops.triton_kernel_wrap as wrap
    from triton.runtime.jit import JITFunction

    def writes(kernel_idx, constant_args_idx, kwargs, *rest):
        kernel = wrap.kernel_side_table.get_kernel(kernel_idx)
        while not isinstance(kernel, JITFunction):  # a launch given num_warps is recorded as a one-config autotuner
            kernel = kernel.fn
        assert kernel is R.rms_norm_fwd_kernel, kernel  # the only kernel these tests trace
        return list(RMS_NORM_FWD_WRITES)

    monkeypatch.setattr(wrap, "get_mutated_tensors", writes)


def graph_of(fn, *shapes, dtype=torch.bfloat16, device="cuda"):
    """``fn`` traced on fake tensors of ``shapes``, as a post-grad graph holds its fused-op calls."""
    mode = FakeTensorMode()
    with mode:
        args = [torch.randn(s, dtype=dtype, device=device) for s in shapes]
        return make_fx(fn, tracing_mode="real")(*args)


def norm_then_scale(x, w):
    y, rstd = torch.ops.fuser.rms_norm(x, w, 1e-6, 0.0, torch.float32, None)
    return y * 2, rstd


def calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


def test_launchable_is_the_kernel_itself_outside_a_trace():
    kernel = R.rms_norm_fwd_kernel
    assert tt.launchable(kernel) is kernel
    with launches.tracing_kernels():
        traced = tt.launchable(kernel)
    assert traced is not kernel and traced.kernel is kernel  # torch.library.wrap_triton's wrapper
    assert tt.launchable(kernel) is kernel


def test_a_norm_call_becomes_its_kernel_launch(known_writes):
    gm = graph_of(norm_then_scale, (2, 8, 256), (256,))
    inliner = inline_ops.Inliner()
    assert inliner.inline(gm.graph) == 1
    gm.graph.lint()
    gm.recompile()
    assert inliner.inlined == {"rms_norm": 1} and not inliner.declined
    assert not [n for n in gm.graph.nodes if inline_ops._default_overload(n.target) is not None]
    (launch,) = calls(gm, WRAPPER)
    kwargs = launch.kwargs["kwargs"]
    assert launch.kwargs["tensors_to_clone"] == RMS_NORM_FWD_WRITES
    assert (kwargs["n_rows"], kwargs["n_cols"], kwargs["eps"], kwargs["HAS_WEIGHT"]) == (16, 256, 1e-6, True)
    # the launch reads the graph's inputs: x (as [rows, cols]) and the weight itself
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert kwargs["w_ptr"] is placeholders[1]
    assert kwargs["x_ptr"].target is torch.ops.aten.view.default and kwargs["x_ptr"].args[0] is placeholders[0]
    # the results: y (through the kernel's y buffer, viewed back to x's shape) scaled, and rstd as written
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    y2, rstd = out.args[0]
    assert y2.target is torch.ops.aten.mul.Tensor
    assert rstd.target.__name__ == "getitem" and rstd.args == (launch, "rstd_ptr")
    assert tuple(rstd.meta["val"].shape) == (2, 8) and rstd.meta["val"].dtype == torch.float32


def test_layers_share_one_trace(known_writes):
    def two_norms(x, w):
        a, _ = torch.ops.fuser.rms_norm(x, w, 1e-6, 0.0, torch.float32, None)
        b, _ = torch.ops.fuser.rms_norm(a, w, 1e-6, 0.0, torch.float32, None)
        c, _ = torch.ops.fuser.rms_norm(x, w, 1e-5, 0.0, torch.float32, None)  # another eps: another trace
        return b, c

    gm = graph_of(two_norms, (4, 128), (128,))
    inliner = inline_ops.Inliner()
    assert inliner.inline(gm.graph) == 3
    assert len(calls(gm, WRAPPER)) == 3 and len(inliner._traced) == 2
    assert sorted(n.kwargs["kwargs"]["eps"] for n in calls(gm, WRAPPER)) == [1e-6, 1e-6, 1e-5]


def test_a_kernel_whose_writes_are_not_known_stays_a_call(monkeypatch):
    """Where its write analysis fails (it needs the kernel compiled for a target), Inductor takes every argument as
    written and would copy each back: the call stays a call, with the reason."""
    import torch._higher_order_ops.triton_kernel_wrap as wrap

    def every_tensor(kernel_idx, constant_args_idx, kwargs, *rest):  # what torch falls back to on failure
        return [name for name, value in kwargs.items() if isinstance(value, torch.Tensor)]

    monkeypatch.setattr(wrap, "get_mutated_tensors", every_tensor)
    gm = graph_of(norm_then_scale, (2, 8, 256), (256,))
    inliner = inline_ops.Inliner()
    assert inliner.inline(gm.graph) == 0
    assert len(calls(gm, torch.ops.fuser.rms_norm.default)) == 1 and not calls(gm, WRAPPER)
    assert "could not tell which arguments its kernel writes" in inliner.declined["rms_norm"]


def _locals_kept_after_inlining(inliner: inline_ops.Inliner, inlined: int) -> list[bool]:
    """Twice: a function inlines a norm's graph with ``inliner`` (``inlined`` calls replaced), then assigns a local
    (what AOT autograd's backward frame holds after its compile: the gradients) and returns. Whether each of those
    locals is still alive after a collection, i.e. whether the inliner kept the function's frame."""
    import gc
    import weakref

    class Outputs:
        pass

    def compile_then_run():
        assert inliner.inline(graph_of(norm_then_scale, (2, 8, 256), (256,)).graph) == inlined
        outputs = Outputs()
        return weakref.ref(outputs)

    refs = [compile_then_run(), compile_then_run()]
    gc.collect()
    return [ref() is not None for ref in refs]


def test_a_declined_call_keeps_no_frame_of_its_compile_alive(monkeypatch):
    """A call that stays a call is remembered by its reason, not by the exception that said it: an exception's
    traceback holds every frame up the compile's stack for as long as the inliner lives. AOT autograd compiles a
    backward graph inside the frame that then runs it, and that frame's local is the first backward's outputs:
    on an H100 a 2-layer model at Llama-3.2-1B's widths kept its first step's gradients, 0.716 GiB, for good (the
    1B full fine-tune's 2.3 GiB is its gradients' size too). Here a local assigned after the inlining, in the frame
    that called it, must die with that frame, also when a second graph re-raises the remembered reason."""
    import torch._higher_order_ops.triton_kernel_wrap as wrap

    def every_tensor(kernel_idx, constant_args_idx, kwargs, *rest):  # the analysis fails: the trace declines
        return [name for name, value in kwargs.items() if isinstance(value, torch.Tensor)]

    monkeypatch.setattr(wrap, "get_mutated_tensors", every_tensor)
    inliner = inline_ops.Inliner()
    # the second compile re-raises the reason the first traced
    assert _locals_kept_after_inlining(inliner, inlined=0) == [False, False]
    assert "could not tell which arguments its kernel writes" in inliner.declined["rms_norm"]


def test_an_inlined_call_keeps_no_frame_of_its_compile_alive(known_writes):
    """The same for a call that is inlined: its remembered trace holds nothing of the frames that compiled it."""
    inliner = inline_ops.Inliner()
    assert _locals_kept_after_inlining(inliner, inlined=1) == [False, False]  # the second reuses the first's trace
    assert inliner.inlined == {"rms_norm": 2}


def test_calls_on_cpu_tensors_stay_calls(known_writes):
    gm = graph_of(norm_then_scale, (2, 8, 256), (256,), device="cpu")
    inliner = inline_ops.Inliner()
    assert inliner.inline(gm.graph) == 0 and len(calls(gm, torch.ops.fuser.rms_norm.default)) == 1
    assert "not all on a GPU" in inliner.declined["rms_norm"]


def test_a_call_that_writes_into_its_input_stays_a_call(known_writes):
    op = torch.ops.fuser.gated_activation_backward_
    assert op.default._schema.is_mutable
    mode = FakeTensorMode()
    with mode:
        g, u, dy = (torch.randn(4, 32, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def body(g, u, dy):
        op(dy, g, u, 1.0, 1.0, "silu")
        return g, u

    try:
        gm = make_fx(body, tracing_mode="real")(g, u, dy)
    except Exception as error:  # pragma: no cover - the op's schema changed; the test needs updating
        pytest.fail(f"gated_activation_backward_'s call could not be built: {error!r}")
    inliner = inline_ops.Inliner()
    assert inliner.inline(gm.graph) == 0
    assert "writes into an input" in inliner.declined["gated_activation_backward_"]


def test_dynamic_shapes_stay_calls(known_writes):
    """A graph of symbolic shapes (Dynamo's dynamic recompile): the body's launch choices hold only for the shapes
    traced, so its calls stay calls."""
    args = (torch.randn(2, 8, 256, dtype=torch.bfloat16), torch.randn(256, dtype=torch.bfloat16))
    gm = make_fx(norm_then_scale, tracing_mode="symbolic")(*args)
    assert any(isinstance(s, torch.SymInt) for s in calls(gm, torch.ops.fuser.rms_norm.default)[0].meta["val"][0].shape)
    inliner = inline_ops.Inliner()
    assert inliner.inline(gm.graph) == 0
    assert "dynamic shapes" in inliner.declined["rms_norm"]


@torch.library.custom_op("fuser::_test_scaled_mm", mutates_args=())
def _scaled_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A fused op whose body is a matmul, as ``linear_normed``'s and ``upcast_linear``'s are."""
    return (x @ w) * 2


@_scaled_mm.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


def test_a_call_whose_body_calls_a_matmul_is_inlined():
    """Autocast is no reason to keep a call (the premise is the next test's): the matmul is spliced in."""
    gm = graph_of(lambda x, w: torch.ops.fuser._test_scaled_mm(x, w) + 1, (16, 32), (32, 8))
    inliner = inline_ops.Inliner()
    assert inliner.inline(gm.graph) == 1, inliner.declined
    assert inliner.inlined == {"_test_scaled_mm": 1} and not inliner.declined
    assert calls(gm, torch.ops.aten.mm.default) and not calls(gm, torch.ops.fuser._test_scaled_mm.default)


@torch.library.custom_op("fuser::_test_norm_in_halves", mutates_args=())
def _norm_in_halves_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A fused op whose kernel writes its result a part at a time (the rows of a chunk), as the loss's chunks do."""
    out = torch.empty_like(x)
    rstd = x.new_empty(x.shape[0], dtype=torch.float32)
    half = x.shape[0] // 2
    for start in (0, half):
        part = [t.narrow(0, start, half) for t in (x, out, rstd)]
        R.rms_norm_forward(part[0], R.Norm(w, 1e-6), out=part[1], rstd=part[2])
    return out


@_norm_in_halves_op.register_fake
def _(x, w):
    return torch.empty_like(x)


def test_a_call_whose_kernel_writes_part_of_a_buffer_stays_a_call(known_writes):
    """Inductor writes a kernel's output into a part of a buffer back through an ``as_strided`` that spans the
    whole buffer, reading past the part's own copy (an illegal memory access on a GPU): such a call stays a call."""
    gm = graph_of(lambda x, w: torch.ops.fuser._test_norm_in_halves(x, w) + 1, (16, 256), (256,))
    inliner = inline_ops.Inliner()
    assert inliner.inline(gm.graph) == 0
    assert "into part of a buffer" in inliner.declined["_test_norm_in_halves"], inliner.declined
    assert len(calls(gm, torch.ops.fuser._test_norm_in_halves.default)) == 1 and not calls(gm, WRAPPER)


@torch.library.custom_op("fuser::_test_side_stream", mutates_args=())
def _side_stream_op(x: torch.Tensor) -> torch.Tensor:
    """A fused op whose body moves work to another stream, as the loss's weight gradient does."""
    torch.cuda.set_stream(SIDE_STREAM)
    return x * 2


SIDE_STREAM = object()  # never reached: the trace refuses the switch before it is made


@_side_stream_op.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_call_whose_body_switches_streams_stays_a_call():
    """A trace records no stream: inlined, the body's overlap would be lost, so the call stays a call."""
    gm = graph_of(lambda x: torch.ops.fuser._test_side_stream(x) + 1, (16, 32))
    inliner = inline_ops.Inliner()
    assert inliner.inline(gm.graph) == 0
    assert "CUDA stream" in inliner.declined["_test_side_stream"], inliner.declined
    assert torch.cuda.set_stream is not None and "refusing" not in repr(torch.cuda.set_stream)  # put back


def test_compiled_graphs_call_ops_with_autocast_off():
    """The premise of inlining under autocast: a graph compiled under autocast calls its ops, forward and
    backward, with autocast off (AOT autograd's runtime wrapper), so a call's body computes as its inlined trace
    (made with autocast off) does; and a change of autocast state compiles again, so a graph compiled without
    autocast never runs under it. Should PyTorch change either, calls whose bodies autocast would change must
    stay calls again."""
    seen = []

    @torch.library.custom_op("fuser_test::autocast_probe", mutates_args=())
    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(("forward", torch.is_autocast_enabled("cpu"), (x @ x.t()).dtype))
        return x.clone()

    @probe.register_fake
    def _(x):
        return torch.empty_like(x)

    @torch.library.custom_op("fuser_test::autocast_probe_backward", mutates_args=())
    def probe_backward(g: torch.Tensor) -> torch.Tensor:
        seen.append(("backward", torch.is_autocast_enabled("cpu"), (g @ g.t()).dtype))
        return g.clone()

    @probe_backward.register_fake
    def _(g):
        return torch.empty_like(g)

    probe.register_autograd(lambda ctx, g: probe_backward(g), setup_context=lambda ctx, inputs, output: None)
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return _compat.lookup_dynamo_backend("inductor")(gm, example_inputs)

    @torch.compile(backend=backend)
    def step(x, w):
        return probe((x @ w).float()).sum()

    x, w = torch.randn(8, 8), torch.randn(8, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = step(x, w)
    loss.backward()
    assert seen == [("forward", False, torch.float32), ("backward", False, torch.float32)]
    step(x, w)
    assert len(compiles) == 2  # autocast off now: compiled again


@pytest.fixture
def no_inductor_cache():
    # a graph from Inductor's (or AOT autograd's) cache skips the post-grad pass, and with it the inlining
    import torch._functorch.config as functorch_config

    with torch._inductor.config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


def _step(model, config, data):
    run = model if config is None else fuser.optimize(model, config)
    loss = run(**data).loss
    loss.backward()
    return loss.detach().float(), {n: g.float() for n, g in grads(model).items() if "lora_" in n}


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "gemma", "qwen3"])
def test_gpu_lora_step_launches_the_kernels_from_inductor_as_close_to_fp32(arch, no_inductor_cache):
    """A bf16 LoRA step of a tiny model on the GPU: the norms' (a residual add and norm among them), rotary's and
    LoRA sums' calls, forward and backward, are inlined, none of the calls left is one whose body failed to trace,
    and the loss and LoRA
    gradients are as close to the fp32 model's as eager bf16's (the bar of ``assert_step_as_close_to_fp32_as_eager``)
    and as the same step with ``inline_ops=False``."""
    model = with_lora(build(arch, torch.bfloat16)).cuda()
    data = {k: v.cuda() for k, v in batch(seq=64).items()}
    loss32, g32 = _step(copy.deepcopy(model).float(), None, data)
    loss16, g16 = _step(copy.deepcopy(model), None, data)
    off = copy.deepcopy(model)
    loss_off, g_off = _step(off, fuser.FuserConfig(strict=True, inline_ops=False), data)
    loss, got = _step(model, fuser.FuserConfig(strict=True, inline_ops=True), data)
    report = fuser.report(model)
    inlined = set(report.inlined)
    assert {"rope", "rope_backward", "lora_sum", "lora_sum_grads"} <= inlined, (report.inlined, report.not_inlined)
    assert inlined & {"rms_norm", "add_rms_norm"} and inlined & {"rms_norm_backward", "add_rms_norm_backward"}, inlined
    assert not any("could not be traced" in why for why in report.not_inlined.values()), report.not_inlined
    assert fuser.report(off).inlined == {}
    assert g32.keys() == got.keys() == g16.keys() and got
    for label, (l_cmp, g_cmp) in {"eager bf16": (loss16, g16), "inline_ops=False": (loss_off, g_off)}.items():
        assert abs(loss - loss32) <= 2 * abs(l_cmp - loss32) + 1e-3 * abs(loss32), (label, loss, l_cmp, loss32)
        errors = {n: (rel(g, g32[n]), rel(g_cmp[n], g32[n])) for n, g in got.items()}
        if label == "eager bf16":  # summed over the model, no farther from fp32 than eager
            assert sum(e for e, _ in errors.values()) <= sum(e for _, e in errors.values()), errors
        for n, (err, err_cmp) in errors.items():
            assert err <= 2 * err_cmp + 1e-3, f"{n}: inlined {err:.2e}, {label} {err_cmp:.2e} vs fp32"


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_gpu_autocast_lora_step_inlines_the_matmul_ops_as_close_to_fp32(arch, no_inductor_cache):
    """The Trainer's form: bf16 autocast over a bf16 base with peft's fp32 adapters. The ops whose bodies call a
    matmul (the upcast linears, the loss of a frozen lm_head) are inlined as the others are, and the
    step is as close to the fp32 model's as eager autocast's and as the calls' (``inline_ops=False``)."""
    model = with_lora(build(arch, torch.bfloat16)).cuda()
    data = {k: v.cuda() for k, v in batch(seq=64).items()}

    def amp_step(m, config):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return _step(m, config, data)

    loss32, g32 = _step(copy.deepcopy(model).float(), None, data)
    loss_amp, g_amp = amp_step(copy.deepcopy(model), None)
    off = copy.deepcopy(model)
    loss_off, g_off = amp_step(off, fuser.FuserConfig(strict=True, inline_ops=False))
    loss, got = amp_step(model, fuser.FuserConfig(strict=True, inline_ops=True))
    report = fuser.report(model)
    assert {"upcast_linear", "upcast_linear_grads", "lora_sum"} <= set(report.inlined), report.not_inlined
    assert not any("autocast" in why or "could not be traced" in why for why in report.not_inlined.values())
    # the loss: inlined where the lm_head is frozen (LoRA) and one chunk holds every row (here); a call where its
    # chunks write parts of its buffers, or with its weight trained (its side stream)
    assert "linear_cross_entropy" in report.inlined, report.not_inlined
    assert g32.keys() == got.keys() == g_amp.keys() and got
    for label, (l_cmp, g_cmp) in {"eager autocast": (loss_amp, g_amp), "inline_ops=False": (loss_off, g_off)}.items():
        assert abs(loss - loss32) <= 2 * abs(l_cmp - loss32) + 1e-3 * abs(loss32), (label, loss, l_cmp, loss32)
        for n, g in got.items():
            err, err_cmp = rel(g, g32[n]), rel(g_cmp[n], g32[n])
            assert err <= 2 * err_cmp + 1e-3, f"{n}: inlined {err:.2e}, {label} {err_cmp:.2e} vs fp32"


@pytest.mark.gpu
def test_gpu_full_fine_tune_frees_the_first_steps_gradients(no_inductor_cache):
    """With inline_ops on and the graphs compiled (not from a cache), every step's gradients are freed by the next
    step's ``zero_grad(set_to_none=True)``, the first step's too: on 12-06 an H100 showed the first backward's
    kept for good, through the inliner's remembered exceptions (see the CPU test above). Checked through weak
    references to the gradients' storages, which see a holder Python cannot."""
    model = build("llama", torch.bfloat16).cuda()  # every parameter trains: the full fine-tune
    data = {k: v.cuda() for k, v in batch(seq=64).items()}
    compiled = fuser.optimize(model, fuser.FuserConfig(strict=True, inline_ops=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    watch = load_benchmark("train_step_memory").GradientWatch(list(model.parameters()))
    for _ in range(3):
        watch.begin_step()
        compiled(**data).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert fuser.report(model).inlined, fuser.report(model).not_inlined  # the pass ran: graphs were compiled
    rows = watch.alive()  # (step, gradients delivered, still allocated, bytes)
    assert [(n > 0, alive) for _, n, alive, _ in rows] == [(True, 0)] * 3, rows


def test_a_kernel_launched_directly_in_a_trace_declines_instead_of_running():
    """A body that launched a kernel without ``launchable`` would run it for real on fake tensors (null pointers:
    an illegal memory access on a GPU). The trace refuses that launch, and the call stays a call."""
    launched = []

    def raw_body(x, w):
        y = torch.empty_like(x)
        flags = dict(HAS_WEIGHT=True, NORM_CAST=0, STORE_RSTD=False, HAS_RESIDUAL=False, BLOCK_M=16, BLOCK_N=256)
        R.rms_norm_fwd_kernel[(1,)](x, w, y, y, x, y, 256, 256, 0, 16, 256, 1e-6, 0.0, **flags)
        launched.append(True)
        return y

    mode = FakeTensorMode()
    with mode:
        x, w = torch.randn(16, 256, device="cuda"), torch.randn(256, device="cuda")
    with pytest.raises(inline_ops.Declined, match="launches the Triton kernel rms_norm_fwd_kernel directly"):
        inline_ops._trace(raw_body, (x, w), {}, mode)
    assert not launched


def test_inline_ops_is_an_on_by_default_bool_option():
    assert fuser.FuserConfig().inline_ops is True
    assert fuser.FuserConfig.from_options({"inline_ops": False}).inline_ops is False
    with pytest.raises(TypeError, match="inline_ops must be True or False"):
        fuser.FuserConfig(inline_ops="yes")


def test_calls_sharing_a_trace_write_their_own_buffers_in_place(known_writes):
    """Two calls of one signature share a trace, not its fake values: Inductor's in-place pass then lets each kernel
    write its own output buffer. With shared values both buffers look like one storage, used after the first
    kernel, and Inductor copies a buffer for it instead."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._inductor.fx_passes.post_grad import decompose_triton_kernel_wrapper_functional
    from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops_core

    def two_norms(x, w):
        a, ra = torch.ops.fuser.rms_norm(x, w, 1e-6, 0.0, torch.float32, None)
        b, rb = torch.ops.fuser.rms_norm(x * 2, w, 1e-6, 0.0, torch.float32, None)
        return a, ra, b, rb

    gm = graph_of(two_norms, (4, 8, 256), (256,))
    inliner = inline_ops.Inliner()
    assert inliner.inline(gm.graph) == 2 and len(inliner._traced) == 1
    with enable_python_dispatcher():
        reinplace_inplaceable_ops_core(gm.graph)
    decompose_triton_kernel_wrapper_functional(gm.graph)
    assert len([n for n in gm.graph.nodes if "triton_kernel_wrapper_mutation" in str(n.target)]) == 2
    assert not calls(gm, torch.ops.aten.clone.default), gm.code


def test_kernel_analysis_is_memoized_by_kernel_dtypes_and_constants():
    """Inductor analyses which arguments a Triton kernel writes for every launch in a graph (compiling the kernel
    to Triton IR each time); the memo computes it once per kernel, tensor dtypes and constants, which is all that
    analysis reads, and hands each caller its own copy."""
    from fuser import _compat

    seen = []

    def analysis(kernel, kwargs, tma):
        seen.append(dict(kwargs))
        return ["y_ptr"]

    memo = _compat.memoized_kernel_analysis(analysis)
    mode = FakeTensorMode()
    with mode:
        a, b = torch.randn(4, 8, device="cuda"), torch.randn(16, 2, device="cuda")  # other shapes, same dtype
        c = torch.randn(4, 8, device="cuda", dtype=torch.bfloat16)
    kernel = R.rms_norm_fwd_kernel
    first = memo(kernel, {"y_ptr": a, "n": 4, "BLOCK": 16}, {})
    first.append("changed by its caller")
    assert memo(kernel, {"y_ptr": b, "n": 4, "BLOCK": 16}, {}) == ["y_ptr"] and len(seen) == 1
    memo(kernel, {"y_ptr": c, "n": 4, "BLOCK": 16}, {})  # another dtype
    memo(kernel, {"y_ptr": a, "n": 5, "BLOCK": 16}, {})  # another constant
    memo(R.rms_norm_bwd_kernel, {"y_ptr": a, "n": 4, "BLOCK": 16}, {})  # another kernel
    assert len(seen) == 4
    assert _compat.memoize_kernel_analysis() in (True, False)
    import torch._higher_order_ops.triton_kernel_wrap as wrap

    installed = [getattr(wrap, n) for n in _compat._KERNEL_ANALYSES if hasattr(wrap, n)]
    assert installed and hasattr(installed[0], "fuser_memoized")
    _compat.memoize_kernel_analysis()  # once: not wrapped twice
    assert not hasattr(installed[0].fuser_memoized, "fuser_memoized")


def test_the_report_prints_what_was_inlined_and_why_not():
    from fuser.report import Report

    plain = str(Report(graphs=1))
    assert "inlined" not in plain  # nothing said where the option was off
    report = Report(graphs=1, inlined={"rms_norm": 3}, not_inlined={"linear_cross_entropy": "its body calls aten.mm"})
    text = str(report)
    assert "inlined calls (FuserConfig.inline_ops: Inductor launches their kernels): rms_norm=3" in text
    assert "  not inlined: linear_cross_entropy: its body calls aten.mm" in text
    cpu = "its tensors are not all on a GPU"
    grouped = str(Report(graphs=1, not_inlined={"rope": cpu, "rms_norm": cpu, "swiglu": "a shape is symbolic"}))
    assert "  not inlined: rms_norm, rope: its tensors are not all on a GPU" in grouped  # one line per reason
    assert "  not inlined: swiglu: a shape is symbolic" in grouped
    assert grouped.count("not inlined:") == 2
