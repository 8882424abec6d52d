"""benchmarks/bench_sliding_window.py on CPU, at toy shapes: its mask is transformers' Gemma-3 sliding-window mask,
its fp32 oracle tells the windowed implementations (masked SDPA; FlexAttention's forward, which has no backward on
CPU) from one with another mask (causal SDPA, or flex with another window), and its block count is right."""

from __future__ import annotations

import pytest
import torch

from tests.models.tiny import load_benchmark

bench = load_benchmark("bench_sliding_window")


def test_the_mask_is_transformers_sliding_window_causal_mask():
    masking = pytest.importorskip("transformers.masking_utils")
    seq, window = 37, 8
    mask = masking.and_masks(masking.causal_mask_function, masking.sliding_window_overlay(window))
    want = torch.tensor([[bool(mask(0, 0, torch.tensor(i), torch.tensor(j))) for j in range(seq)] for i in range(seq)])
    assert torch.equal(bench.window_mask(seq, window, "cpu"), want)


def test_the_oracle_tells_the_window_from_other_masks():
    seed = torch.seed() % 2**31
    q, k, v, dout = bench.inputs(2, 48, 4, 2, 16, "cpu", torch.float32, seed=seed)
    window, scale = 12, 0.25
    runs = bench.implementations(window, scale, compiled=False)
    assert bench.error(runs["masked sdpa"], q, k, v, dout, window, scale) < 1e-5
    assert bench.error(runs["causal sdpa (not the window)"], q, k, v, dout, window, scale) > 0.1
    frozen = [t.detach() for t in (q, k, v)]
    assert bench.error(runs["flex (window)"], *frozen, dout, window, scale) < 1e-5
    other_window = bench.implementations(window // 2, scale, compiled=False)["flex (window)"]
    assert bench.error(other_window, *frozen, dout, window, scale) > 0.1


def test_block_counts():
    assert bench.blocks(256, 128, 128) == (3, 3)
    assert bench.blocks(512, 128, 128) == (7, 10)  # the window drops the blocks two or more below the diagonal
    assert bench.blocks(2048, 4096) == (136, 136)  # a window longer than the sequence is the causal mask
