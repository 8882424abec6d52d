"""benchmarks/bench_linear_cross_entropy.py's rounds, on CPU with a stand-in for the GPU timing: the implementations
alternate round by round, the best round counts, and errors and memory come from the first round."""

from __future__ import annotations

import pytest

from tests.models.tiny import load_benchmark

bench = load_benchmark("bench_linear_cross_entropy")


def test_rounds_alternate_and_the_best_round_counts(monkeypatch):
    timings = {"inductor": [42.2, 37.7, 38.6], "fuser": [39.4, 41.9, None]}  # None: a round that failed
    order = []

    def fake_bench_impl(name, fn, h, w, labels, ref, frozen_weight=False):
        round_ = sum(1 for n in order if n == name)
        order.append(name)
        return {"ms": timings[name][round_], "extra": 100 + round_, "errors": (round_, 0.0, 0.0)}

    monkeypatch.setattr(bench, "bench_impl", fake_bench_impl)
    results = bench.bench_rounds({"inductor": None, "fuser": None}, None, None, None, None, False, 3)
    assert order == ["inductor", "fuser"] * 3
    assert results["inductor"]["ms"] == 37.7 and results["inductor"]["rounds_ms"] == [42.2, 37.7, 38.6]
    assert results["fuser"]["ms"] == 39.4 and results["fuser"]["rounds_ms"] == [39.4, 41.9, None]
    assert results["fuser"]["extra"] == 100 and results["fuser"]["errors"][0] == 0  # the first round's


def test_rounds_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])
    assert "--rounds must be at least 1" in capsys.readouterr().err
