"""``FuserConfig(cuda_graphs=True)``: Inductor records fuser's compiled graphs as CUDA graphs and replays them.

On CPU, Inductor declines to record (a CPU graph), the step runs as without the switch, and fuser warns that the
switch did nothing. On a GPU, a few training steps replay the recorded graphs, with no graph declined, and compute
what eager computes.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fuser
from fuser import _compat
from fuser.inductor import graph_pool_grads
from tests.models.tiny import batch, build, grads, rel

DECLINED = r"fuser: FuserConfig\(cuda_graphs=True\)"  # the start of fuser's warning of a declined graph


def test_cuda_graphs_needs_inductor_and_a_bool():
    assert fuser.FuserConfig.from_options({"cuda_graphs": True}).cuda_graphs
    assert not fuser.FuserConfig().cuda_graphs
    with pytest.raises(ValueError, match="inner_compiler='inductor'"):
        fuser.FuserConfig(cuda_graphs=True, inner_compiler="aot_eager")
    with pytest.raises(TypeError, match="cuda_graphs must be True or False"):
        fuser.FuserConfig(cuda_graphs="yes")


def steps(model, config, data, n):
    """``n`` SGD steps of ``model`` through fuser (``config``) or eagerly (``None``): each step's loss, read before
    the next step replays the graph (a replay overwrites the last one's outputs), and the last step's gradients."""
    run = model if config is None else fuser.optimize(model, config)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        loss = run(**data).loss
        loss.backward()
        losses.append(loss.detach().clone())
        opt.step()
    return torch.stack(losses), grads(model)


def test_cpu_graph_is_declined_with_a_warning_and_runs_as_before():
    """A CPU model: Inductor will not record it; the step computes what eager does, and fuser says the switch had
    no effect (which it cannot say unless it asked Inductor for CUDA graphs)."""
    model = build("llama")
    reference = copy.deepcopy(model)
    data = batch()
    config = fuser.FuserConfig(strict=True, cuda_graphs=True)
    skips = _compat.cudagraph_skips()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, g = steps(model, config, data, 2)
    assert _compat.cudagraph_skips() > skips
    assert any("cuda_graphs=True" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert fuser.report(model).counts.get("rms_norm", 0) > 0
    losses_ref, g_ref = steps(reference, None, data, 2)
    assert rel(losses, losses_ref) <= 1e-5
    for name in g_ref:
        assert rel(g[name], g_ref[name]) <= 1e-4, name


class _PoolBuffer:
    """A stand-in for Inductor's CUDA-graph pool: the backward of :class:`CompiledFunction` writes the weight's
    gradient into one buffer that every call reuses, and hands autograd a view of it (nothing else refers to that
    view, so autograd keeps it as ``.grad`` when ``.grad`` is ``None``, as it does a replay's output)."""

    buffer = torch.zeros(5)


class CompiledFunction(torch.autograd.Function):  # named as AOT autograd's, so its node is CompiledFunctionBackward
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        _PoolBuffer.buffer.copy_((grad * x).sum(0))
        return None, _PoolBuffer.buffer.view_as(_PoolBuffer.buffer)


def _accumulate(call, w, xs, set_to_none=True):
    w.grad = None if set_to_none else torch.zeros_like(w)
    for x in xs:
        (call(x, w) ** 2).sum().backward()
    return w.grad.clone()


def test_accumulated_grads_are_moved_out_of_the_replay_pool_before_the_next_call():
    """Two micro-batches through a graph whose backward reuses one output buffer: without fuser's wrapper the first
    micro-batch's .grad is that buffer, the second backward overwrites it and autograd adds it to itself (the
    wrong sum of PyTorch issue 96693). Wrapped, .grad is moved out before the second call: the sum is exact. After
    zero_grad(set_to_none=True) nothing is left to move (no copy per step without accumulation)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5))
    xs = [torch.randn(3, 5) for _ in range(2)]
    want = sum((2 * x * x * w).sum(0) for x in xs).detach()
    unwrapped = _accumulate(CompiledFunction.apply, w, xs)
    assert rel(unwrapped, want) > 0.1  # the stand-in reproduces the failure the wrapper exists for
    wrapped = graph_pool_grads.keeping_grads_out_of_pool(CompiledFunction.apply)
    assert rel(_accumulate(wrapped, w, xs), want) <= 1e-6
    assert rel(_accumulate(wrapped, w, xs, set_to_none=False), want) <= 1e-6  # zero_grad(set_to_none=False)
    w.grad = None
    (wrapped(xs[0], w) ** 2).sum().backward()
    assert w.grad.data_ptr() == _PoolBuffer.buffer.data_ptr()  # autograd kept the buffer itself
    w.grad = None  # the optimizer step's zero_grad()
    assert graph_pool_grads.move_pool_grads_out() == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("api", ["optimize", "optimize_", "torch.compile"])
def test_cuda_graphs_accumulation_through_fuser_equals_eager(api, device, monkeypatch):
    """Two accumulated micro-batches, then an SGD step, three times, through each way in to fuser with
    cuda_graphs=True, fp32: each parameter's change matches eager's. On the GPU the second step replays the
    recorded graphs (PyTorch issue 169545 without fuser's wrapper); on CPU Inductor declines to record, and the
    wrapper runs all the same."""
    model = build("llama").to(device)
    reference = copy.deepcopy(model)
    data = [{k: v.to(device) for k, v in batch(seq=64, seed=s).items()} for s in (1, 2)]
    config = fuser.FuserConfig(strict=True, cuda_graphs=True)
    if api == "optimize":
        run = fuser.optimize(model, config)
    elif api == "optimize_":
        run = fuser.optimize_(model, config)
    else:
        run = torch.compile(model, backend="fuser", options={"strict": True, "cuda_graphs": True})
    monkeypatch.setattr(graph_pool_grads, "_PENDING", [])  # none left by an earlier test's model in this process
    moved = []
    original = graph_pool_grads.move_pool_grads_out
    monkeypatch.setattr(graph_pool_grads, "move_pool_grads_out", lambda: moved.append(original()) or moved[-1])
    skips = _compat.cudagraph_skips()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore" if device == "cpu" else "error", message=DECLINED)
        got = _accumulated_steps(model, run, data)
    if device == "cuda":
        assert _compat.cudagraph_skips() == skips
    # each step's second micro-batch found the first one's .grad still the backward's own output, and copied it
    assert len(moved) == 3 and all(n == moved[0] > 0 for n in moved), moved
    want = _accumulated_steps(reference, reference, data)
    for name in want:
        assert rel(got[name], want[name]) <= 1e-4, name


def _accumulated_steps(model, run, data):
    """Each parameter's change over three SGD steps of two accumulated micro-batches each."""
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        for one in data:
            (run(**one).loss / len(data)).backward()
        opt.step()
    return {name: p.detach() - start[name] for name, p in model.named_parameters()}


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_gpu_steps_replay_cuda_graphs_and_equal_eager(arch):
    """Four fp32 steps: the first runs the compiled graphs, the second records them, the last two replay. No graph
    is declined, Inductor's graph-tree manager holds recorded graphs, and every step's loss and the last gradients
    match eager's (the bar of the uncaptured fp32 step test, ``tests/models/test_gpu.py``)."""
    from torch._inductor import cudagraph_trees

    model = build(arch).cuda()
    reference = copy.deepcopy(model)
    data = {k: v.cuda() for k, v in batch(seq=64).items()}
    config = fuser.FuserConfig(strict=True, cuda_graphs=True)
    skips = _compat.cudagraph_skips()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=DECLINED)  # fuser's warning of a declined graph fails the test
        losses, g = steps(model, config, data, 4)
    assert _compat.cudagraph_skips() == skips
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None and any(manager.roots.values())
    assert fuser.report(model).counts.get("rms_norm", 0) > 0
    losses_ref, g_ref = steps(reference, None, data, 4)
    assert rel(losses, losses_ref) <= 1e-5, (losses, losses_ref)
    for name in g_ref:
        assert rel(g[name], g_ref[name]) <= 1e-4, name


class _Rows(torch.utils.data.Dataset):
    """Fixed-length token rows, as a tokenised causal-LM dataset hands them to the Trainer."""

    def __init__(self, n: int = 16, seq: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.rows = torch.randint(3, 128, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.rows[i]
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def _trainer_losses(model, out_dir, bf16: bool) -> list[float]:
    """Each micro-batch's loss of a ``transformers.Trainer`` run on the GPU: 4 optimizer steps of 2 accumulated
    micro-batches, constant learning rate."""
    import transformers

    losses: list[float] = []

    class Recording(transformers.Trainer):
        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            losses.append(loss.detach().float().item())
            return loss

    args = transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
        learning_rate=1e-3, lr_scheduler_type="constant", report_to=[], save_strategy="no", bf16=bf16, seed=0,
        data_seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    Recording(model=model, args=args, train_dataset=_Rows()).train()
    return losses


@pytest.mark.gpu
def test_gpu_trainer_bf16_autocast_with_cuda_graphs_trains_like_eager(tmp_path):
    """The setting a user runs: ``fuser.optimize_(model, {"cuda_graphs": True})`` under ``transformers.Trainer``
    with ``bf16=True`` (autocast, fp32 master weights) and gradient accumulation. Inductor records the graphs (none
    declined), and every micro-batch's loss is as close to the fp32 run without fuser as eager autocast's is (the
    bar of ``tests/integrations/test_trainer.py``: 1.5x eager's distance + 4e-3)."""
    import transformers

    transformers.logging.set_verbosity_error()
    base = build("llama")
    fp32 = _trainer_losses(copy.deepcopy(base), tmp_path / "fp32", bf16=False)
    eager = _trainer_losses(copy.deepcopy(base), tmp_path / "eager", bf16=True)
    model = copy.deepcopy(base)
    fuser.optimize_(model, {"cuda_graphs": True})
    skips = _compat.cudagraph_skips()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=DECLINED)
        fused = _trainer_losses(model, tmp_path / "fused", bf16=True)
    assert _compat.cudagraph_skips() == skips
    assert fuser.report(model).counts.get("rms_norm", 0) + fuser.report(model).counts.get("rms_norm_linear", 0) > 0
    assert len(fused) == len(eager) == len(fp32) == 8
    for step, (got, want, ref) in enumerate(zip(fused, eager, fp32, strict=True)):
        assert abs(got - ref) / abs(ref) <= 1.5 * abs(want - ref) / abs(ref) + 4e-3, (step, got, want, ref)
