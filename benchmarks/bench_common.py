"""Pieces the benchmarks here share: the kernel timers, accuracy, the copy ceiling, and markdown tables."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import torch

FAIL_ABOVE = 2e-2  # max relative error (vs an fp32 reference) above which an implementation's time is not shown
IMPLS = ("eager", "inductor", "liger", "fuser")


L2_BYTES = 60 << 20  # the L2 cache the cycled timer's buffers must exceed


def time_graph_and_launched(
    step: Callable[[], object], grads: Iterable[torch.Tensor] = (), warm_up_also: Iterable[Callable[[], object]] = ()
) -> tuple[float, float]:
    """Median ms of ``step`` (one forward + backward), each by ``triton.testing.do_bench(warmup=25, rep=100)``,
    which flushes L2 before every run: (GPU time, of a CUDA-graph replay of the step; launched from Python, the
    host's cost included).

    ``grads`` are set to None before every run and before the capture, so every replay writes fresh gradients and
    nothing accumulates. The step (with ``warm_up_also``) first runs 3 times on a side stream, as CUDA-graph capture
    requires: compiles and Triton's JIT happen there, untimed.
    """
    import triton.testing

    grads, warm_up_also = list(grads), list(warm_up_also)

    def reset_grads() -> None:
        for tensor in grads:
            tensor.grad = None

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            reset_grads()
            step()
            for fn in warm_up_also:
                fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    launched = triton.testing.do_bench(step, warmup=25, rep=100, grad_to_none=grads, return_mode="median")
    reset_grads()
    gpu = cuda_graph_ms(step)
    reset_grads()
    return gpu, launched


def saved_storage_bytes(forward: Callable[[], object], exclude: Iterable[torch.Tensor]) -> int:
    """Bytes of the unique CUDA storages autograd saves during one ``forward()``, those of ``exclude`` (parameters,
    inputs) left out: what a block holds between its forward and backward."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip and t.device.type == "cuda":
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return sum(storages.values())


def block_step_figures(
    step: Callable[[], object], forward: Callable[[], object], grads: list[torch.Tensor], exclude: list[torch.Tensor]
) -> tuple[float, int, int]:
    """A compiled block's (fwd+bwd ms, saved bytes, peak bytes above the step's start): ``step`` (forward and
    backward) warmed up 3 times (compiles), timed by ``triton.testing.do_bench`` (warmup 25 ms, rep 200 ms, median,
    ``grads`` set to None between runs); :func:`saved_storage_bytes` of ``forward``; the peak of one more step."""
    import triton

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median", grad_to_none=grads)
    saved = saved_storage_bytes(forward, exclude)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return ms, saved, torch.cuda.max_memory_allocated() - base


def fused_counts_since(config, since: int) -> dict[str, int]:
    """The fused-op counts of the graphs ``fuser.backend(config)`` compiled after its first ``since`` ones, summed."""
    import fuser

    counts: dict[str, int] = {}
    for result in fuser.backend(config).results[since:]:
        for name, n in result.counts.items():
            counts[name] = counts.get(name, 0) + n
    return counts


def cuda_graph_ms(fn: Callable[[], object]) -> float:
    """Median ms of replaying a CUDA graph of one call of ``fn`` (warmed up already): its GPU time alone."""
    import triton.testing

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
    del graph
    return ms


def buffers_beyond_l2(nbytes: int) -> int:
    """How many buffers of ``nbytes`` one cycle takes so that together they exceed the L2 cache three times."""
    return max(2, -(-3 * L2_BYTES // nbytes))


def bf16_buffers(rows: int, cols: int, count: int) -> list[torch.Tensor]:
    return [torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) for _ in range(count)]


def cycled_graph_ms(launch: Callable[[int], object], count: int, rep: int) -> float:
    """Median ms of ``launch(i)`` by ``triton.testing.do_bench_cudagraph``, ``i`` cycling through ``count`` buffer
    sets (see :func:`buffers_beyond_l2`) so that no launch finds its inputs in L2: a kernel's time from DRAM."""
    from triton.testing import do_bench_cudagraph

    state = itertools.count()

    def fn() -> None:
        launch(next(state) % count)

    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=rep, return_mode="median")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).norm() / expected.norm()).item()


def measure_copy_ceiling() -> float:
    """Device-to-device copy bandwidth in GB/s, bytes read + written, over a 2 GiB buffer."""
    import triton.testing

    src = torch.empty(2**30, dtype=torch.int16, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    src.fill_(1)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    nbytes = 2 * src.numel() * src.element_size()
    return nbytes / (ms * 1e-3) / 1e9


def fmt_ms(ms: float | None, err: float | None) -> str:
    if err is None:
        return "n/a"
    if err > FAIL_ABOVE:
        return "FAIL"
    return f"{ms:.3f}"


def fmt_err(err: float | None) -> str:
    if err is None:
        return "n/a"
    return f"{err:.1e}" + (" FAIL" if err > FAIL_ABOVE else "")


def timing_columns(times: dict, err: dict, nbytes: int, ceiling: float) -> list[str]:
    """The ms of each implementation, then fuser's GB/s, % of the copy ceiling, and fuser / best other."""
    others = [times[n] for n in ("eager", "inductor", "liger") if times[n] is not None]
    if times["fuser"] is not None:
        gbps = nbytes / (times["fuser"] * 1e-3) / 1e9
        fuser_cols = [f"{gbps:.0f}", f"{gbps / ceiling:.0%}"]
        ratio = f"{times['fuser'] / min(others):.2f}" if others else "n/a"
    else:
        fuser_cols, ratio = ["-", "-"], "-"
    return [fmt_ms(times[n], err[n]) for n in IMPLS] + fuser_cols + [ratio]


def markdown_table(columns: list[str], rows: list[list[str]], label_columns: int = 0) -> str:
    """A markdown table; the first ``label_columns`` columns left-aligned, the others right-aligned."""
    align = ["---" if i < label_columns else "---:" for i in range(len(columns))]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
