"""The code states contracts and reasons; evidence lives in docs/ and benchmarks/results/.

Comments, docstrings and messages in ``src/fuser/`` carry no dates, GPU names, issue numbers, result-file paths or
measured figures (times, throughputs, speed-up ratios, percentages, fractional memory sizes): those go stale the day
they are written, and belong beside the command, date, GPU and versions that produced them — ``docs/defaults.md``
(why a default is what it is, by option), ``docs/notes/`` (kernel choices and post-mortems), ``benchmarks/results/``.
Only comments and string literals are read (``tokenize``), so code such as ``n % 2`` is not mistaken for a figure.
"""

from __future__ import annotations

import io
import pathlib
import re
import tokenize

import pytest

FUSER = pathlib.Path(__file__).resolve().parent.parent / "src" / "fuser"

RULES = {
    "a GPU name": r"\b(?:[HAB]100|H200|B200|A10G?|V100|L40S?|RTX ?\d{4}|MI[23]\d0X?)\b",
    "a date": r"\b20\d\d-\d\d-\d\d\b",
    "an issue number": r"\b[Ii]ssues? \d+|(?<![\w&])#\d+\b",
    "a results file": r"benchmarks/results|\bHISTORY\.md\b|_[hab][12]00_|_cpu_20\d\d",
    "a throughput": r"\btok(?:ens)?/s\b|\b[TGM]B/s\b",
    "a measured time": r"\d(?:\.\d+)?\s?(?:ms|µs|us|ns)\b",
    "a speed-up ratio": r"\d(?:\.\d+)?[x×](?![\w.])",
    "a percentage": r"(?<![.:])\b\d+(?:\.\d+)?\s?%",  # not a format spec such as {share:.0%}
    "a measured memory size": r"\d\.\d+\s?(?:GiB|MiB|GB|MB)\b",
}


def _comments_and_strings(path: pathlib.Path):
    """(line number, text) of every comment and string literal (docstrings, messages) in ``path``."""
    source = path.read_text(encoding="utf-8")
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.STRING):
            for offset, line in enumerate(token.string.splitlines()):
                yield token.start[0] + offset, line


def find_evidence(path: pathlib.Path) -> list[str]:
    found = []
    for number, line in _comments_and_strings(path):
        for what, pattern in RULES.items():
            match = re.search(pattern, line)
            if match:
                found.append(f"{path.relative_to(FUSER.parent)}:{number}: {what} ({match.group(0)!r}): {line.strip()}")
    return found


def test_no_evidence_in_fuser_comments_docstrings_or_messages():
    found = [hit for path in sorted(FUSER.rglob("*.py")) for hit in find_evidence(path)]
    assert not found, (
        "evidence in src/fuser/ (state the contract or the reason there; put the figure, with its command, date, GPU "
        "and versions, in docs/defaults.md, docs/notes/ or benchmarks/results/, and point to it):\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "text",
    [
        "# took 0.552 to 0.453 ms on the H200",
        '"""3–5x faster (issue 16)"""',
        "# see benchmarks/results/tune_rms_norm_h200_2026-11-30.md",
        "# 13,945 → 15,356 tokens/s",
        "# 0.4 % slower, peak 30.3 GiB",
        "# PyTorch #169545",
    ],
)
def test_the_rules_catch_evidence(tmp_path, text):
    probe = tmp_path / "probe.py"
    probe.write_text(text + "\n", encoding="utf-8")
    hits = [what for _, line in _comments_and_strings(probe) for what, rule in RULES.items() if re.search(rule, line)]
    assert hits, f"no rule caught {text!r}"


def test_code_is_not_read_as_evidence(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("n = rows % 2\nx = 4096 % block\nblock_m = 2048 // block_n\n", encoding="utf-8")
    assert not list(_comments_and_strings(probe))
