"""Smoke test of benchmarks/trainer_throughput.py on a CPU: a tiny Llama in a real ``transformers.Trainer``, rows
of random lengths padded by the collator, the ``none`` and ``fuser`` modes, and the table made of them."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.models.tiny import load_benchmark

# two rows of 16-96 tokens, padded to 64 or 128: real tokens are about half of every batch
ARGV = ["--tiny", "--batch", "2", "--lengths", "uniform:16-96", "--steps", "3", "--warmup", "1"]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("trainer_throughput")


@pytest.fixture(autouse=True)
def _one_thread():
    """Toy sizes gain nothing from threads, and on a busy 2-core machine OpenMP's spinning makes them 100× slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_none_and_fuser_rows_count_real_tokens_and_fuser_fuses(bench, tmp_path):
    """Each mode as its process runs it (``--mode``, here in-process for time), then the table of both: the rows
    exist, tokens/s counts the attended tokens alone, both modes start from the same loss, and fuser fused the
    norms, rotations, gated activations and the loss of the padded batches."""
    modes = {}
    for mode, extra in (("none", []), ("fuser", ["--fuser-option", "inner_compiler=aot_eager"])):
        path = tmp_path / f"{mode}.json"
        assert bench.main([*ARGV, "--mode", mode, *extra, "--json", str(path)]) == 0
        modes[mode] = json.loads(path.read_text())
    for result in modes.values():
        assert result["status"] == "ok" and result["steps_run"] == 3
        assert len(result["losses"]) == 3 and all(math.isfinite(x) for x in result["losses"])
        pairs = zip(result["real_tokens"], result["padded_tokens"], strict=True)
        assert all(0 < real < padded for real, padded in pairs)
        assert all(padded % (2 * 64) == 0 for padded in result["padded_tokens"])  # pad_to_multiple_of=64
        assert result["tokens_per_s"] > 0 and result["first_step_s"] > 0
        assert result["trainable_params"] < result["params"]  # LoRA: the base is frozen
    assert modes["none"]["real_tokens"] == modes["fuser"]["real_tokens"]  # the same batches
    assert abs(modes["fuser"]["losses"][0] - modes["none"]["losses"][0]) <= 1e-3 * modes["none"]["losses"][0]
    counts = modes["fuser"]["fuser_counts"]
    assert counts.get("rope") and counts.get("linear_cross_entropy") == 1 and counts.get("rms_norm"), counts

    args = bench.parse_args([*ARGV, "--modes", "none,fuser"])
    record = dict(command="…", date="…", device="CPU", versions=bench.versions(), setup=bench.setup_of(args))
    text = bench.report({**record, "modes": modes})
    assert "| none | " in text and "| fuser | " in text
    assert "row lengths uniform over the integers 16–96 (seed 0)" in text
    assert "linear_cross_entropy=1" in text and "real tokens " in text


def test_missing_package_is_a_row_not_a_crash(bench, tmp_path, monkeypatch):
    """A mode whose package is not importable gives a row that says so; a failing mode's process a row with its
    error's last line (``--combine`` makes one table of both runs' records)."""
    real_find_spec = bench.importlib.util.find_spec
    monkeypatch.setattr(
        bench.importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real_find_spec(name)
    )
    out = tmp_path / "liger.json"
    assert bench.main([*ARGV, "--modes", "liger", "--json", str(out)]) == 0
    failed = json.loads(out.read_text())
    failed["modes"]["unsloth"] = {"mode": "unsloth", "status": "error", "error": "ImportError: no unsloth | here"}
    other = tmp_path / "other.json"
    other.write_text(json.dumps(failed))
    combined = tmp_path / "combined.md"
    assert bench.main(["--combine", str(out), str(other), "--out", str(combined)]) == 1
    text = combined.read_text()
    assert "| liger | not installed: liger_kernel |" in text
    assert "| unsloth | error: ImportError: no unsloth / here |" in text


def test_packing_runs_the_same_rows_without_pads(bench, tmp_path):
    """``--packing`` (DataCollatorWithFlattening): each batch is one row of the same rows' tokens, no pad among
    them, so the real token counts are the padded run's; the setup line says how the batches were made."""
    runs = {}
    for name, extra in (("padded", []), ("packed", ["--packing"])):
        path = tmp_path / f"{name}.json"
        assert bench.main([*ARGV, "--mode", "none", *extra, "--json", str(path)]) == 0
        runs[name] = json.loads(path.read_text())
    packed, padded = runs["packed"], runs["padded"]
    assert packed["status"] == "ok" and all(math.isfinite(x) for x in packed["losses"])
    assert packed["real_tokens"] == packed["padded_tokens"] == padded["real_tokens"]
    args = bench.parse_args([*ARGV, "--packing", "--modes", "none"])
    assert "--packing" in bench.child_command(args, "none", tmp_path / "x.json")
    record = dict(command="…", date="…", device="CPU", versions=bench.versions(), setup=bench.setup_of(args))
    assert "packed into one row a batch by DataCollatorWithFlattening" in bench.report({**record, "modes": {}})
