"""Pieces every kernel benchmark here shares: accuracy, the copy ceiling, and the markdown report."""

from __future__ import annotations

import torch

FAIL_ABOVE = 2e-2  # max relative error (vs an fp32 reference) above which an implementation's time is not shown
IMPLS = ("eager", "inductor", "liger", "fuser")


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


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" for _ in columns) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
