"""``--memory-at-peak``: what is live at the peak of one more training step, by allocation site, from a replay
of the CUDA allocator's trace.
"""

from __future__ import annotations

import gc
import sys
import types
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef


def live_at_peak(events: list[dict]) -> tuple[int, list[dict]]:
    """Replay an allocator trace (``alloc`` / ``free_requested`` / ``free_completed`` events of ``addr`` and
    ``size``): the most bytes allocated at once (blocks allocated before the trace began not counted), and the
    events of the blocks live at that moment, the last of them the allocation that reached the peak. A block
    counts as freed at its first free event."""
    live: dict[int, dict] = {}
    now = peak = 0
    peak_live: list[dict] = []
    for ev in events:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            now += ev["size"]
            if now > peak:
                peak, peak_live = now, list(live.values())
        elif ev["action"] in ("free_requested", "free_completed") and ev["addr"] in live:
            now -= live.pop(ev["addr"])["size"]
    return peak, peak_live


# groups listed by --memory-at-peak: 30 left the 1B job's 1.4 GiB difference to Liger-Kernel in the unlisted ones
MEMORY_GROUPS = 80


HISTORY_ENTRIES = 4_000_000  # allocator events kept; the memory step's must all be kept


def record_memory_history() -> None:
    """Record the CUDA allocator's events with Python stacks from now on (before the model is built), so that
    :func:`memory_at_peak` can say where what is live before its step was allocated."""
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=HISTORY_ENTRIES)


class GradientWatch:
    """Weak references to the storage of every gradient autograd hands the trainable parameters, by step: which
    steps' backward outputs are still allocated later (:meth:`alive`), whoever holds them (Python or C++: the
    references are the storages' own, as CUDA-graph trees keep them, not Python objects', which die as soon as the
    hook returns). Tells a gradient the first backward left behind for good from the last step's, kept until the
    next backward. The hooks return None, so autograd keeps the gradients as it would; they cost one Python call
    per parameter and step, so a run with them is not one to report timings from."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.steps: list[list[tuple[StorageWeakRef, int]]] = []
        for param in params:
            param.register_hook(self._seen)

    def begin_step(self) -> None:
        self.steps.append([])

    def _seen(self, grad: torch.Tensor) -> None:
        if self.steps:
            storage = grad.untyped_storage()
            self.steps[-1].append((StorageWeakRef(storage), storage.nbytes()))

    def alive(self) -> list[tuple[int, int, int, int]]:
        """(step, gradients delivered, still allocated, their storage bytes), per step, after a collection."""
        gc.collect()
        rows = []
        for step, refs in enumerate(self.steps):
            live = [size for ref, size in refs if not ref.expired()]
            rows.append((step, len(refs), len(live), sum(live)))
        return rows

    def lines(self, rows: list[tuple[int, int, int, int]]) -> list[str]:
        """``rows`` (:meth:`alive`'s) as the report's lines."""
        out = [
            "Gradients autograd delivered to the parameters in each step, still allocated as the memory step "
            "begins (after the last step's `zero_grad(set_to_none=True)`):",
            "",
        ]
        out += [f"- step {s}: {n_alive} of {n} ({size / 2**30:.3f} GiB)" for s, n, n_alive, size in rows]
        return out


def _describe(obj: Any) -> str:
    if isinstance(obj, dict):
        return f"dict of {len(obj)} (keys {list(obj)[:3]!r})"[:120]
    if isinstance(obj, (list, tuple, set)):
        return f"{type(obj).__name__} of {len(obj)}"
    if isinstance(obj, types.FunctionType):
        return f"function {obj.__qualname__} ({Path(obj.__code__.co_filename).name})"
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def python_holders(known: set[int], limit: int = 8, device_type: str = "cuda") -> list[str]:
    """The largest tensors on ``device_type`` (4 MiB or more) that are not in ``known`` (data pointers of the
    parameters and the optimizer state), with what holds each in Python (two levels of ``gc.get_referrers``).
    A tensor listed without holders is held outside Python (autograd's graph, a C++ cache)."""
    frames = (types.FrameType,)
    found = []
    for obj in gc.get_objects():
        try:
            if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.device.type != device_type:
                continue
            size = obj.untyped_storage().nbytes()
            if size >= 4 << 20 and obj.data_ptr() not in known:
                found.append((size, obj))
        except Exception:  # noqa: BLE001 - a fake or functional tensor kept by a cache has no storage to read
            continue
    found.sort(key=lambda t: -t[0])
    lines = [f"{len(found)} such tensors seen by Python's gc, {sum(s for s, _ in found) / 2**30:.3f} GiB"]
    for size, tensor in found[:limit]:
        lines.append(f"- {tuple(tensor.shape)} {tensor.dtype}, storage {size / 2**20:.1f} MiB, held by:")
        for holder in gc.get_referrers(tensor):
            if isinstance(holder, frames) or holder is found:
                continue
            outer = [_describe(o) for o in gc.get_referrers(holder)[:4] if not isinstance(o, frames)]
            lines.append(f"  - {_describe(holder)}, itself held by: {'; '.join(outer) or '(nothing Python sees)'}")
    return lines


def memory_at_peak(
    result,
    args,
    ids,
    train_step,
    sync,
    device: torch.device,
    known: set[int] | None = None,
    watch: GradientWatch | None = None,
) -> dict[str, Any] | None:
    """One more step with the CUDA allocator's history recorded; replay its trace to the moment the allocated
    bytes peak and write what is live then, grouped by where it was allocated (the first frame outside torch's
    own files, with its source line: Inductor's generated code names the buffer and its shape there), to
    ``memory_<job>_<mode>.md`` in ``--memory-at-peak``."""
    gradients: list[str] = []
    if watch is not None:  # before the memory step adds one of its own
        rows = watch.alive()
        result["gradients_alive"] = [list(row) for row in rows]
        gradients = watch.lines(rows)
    if device.type != "cuda":
        print("train_step: --memory-at-peak needs CUDA; skipped", file=sys.stderr)
        return None
    import linecache

    sync()
    base = torch.cuda.memory_allocated(device)
    dev = device.index if device.index is not None else torch.cuda.current_device()
    holders = python_holders(known) if known is not None else []
    before = torch.cuda.memory._snapshot()  # with record_memory_history() on from the start: blocks with stacks
    recorded = len(before["device_traces"][dev]) if before["device_traces"] else 0
    if not recorded:
        record_memory_history()
    try:
        train_step(ids)
        sync()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][dev]
    if len(events) >= HISTORY_ENTRIES:
        print("train_step: --memory-at-peak: the allocator's trace overflowed; the peak may be wrong", file=sys.stderr)
    peak, peak_live = live_at_peak(events[recorded:])

    def where(ev: dict) -> str:
        for frame in ev.get("frames", []):
            name = frame.get("filename", "")
            if "/torch/" in name and "torchinductor" not in name or name.startswith("<") or name.endswith(".cpp"):
                continue
            source = linecache.getline(name, frame.get("line", 0)).strip()[:110]
            return f"`{Path(name).name}:{frame.get('line')}` {frame.get('name', '')}: `{source}`"
        return "(no Python frame outside torch)"

    groups: dict[str, list[int]] = {}
    for ev in peak_live:
        groups.setdefault(where(ev), []).append(ev["size"])
    top = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:MEMORY_GROUPS]
    by_size: dict[int, int] = {}  # block size -> count: comparable between runs whose generated code differs
    for ev in peak_live:
        by_size[ev["size"]] = by_size.get(ev["size"], 0) + 1
    sizes_line = ", ".join(
        f"{n} × {size / 2**20:.1f} MiB" for size, n in sorted(by_size.items(), key=lambda kv: -kv[0] * kv[1])[:12]
    )
    gib = 2.0**30
    lines = [
        f"# Memory at the peak of one step: {result['job']}, {result['mode']}",
        "",
        f"- command: `{result['command']}`",
        f"- date: {result['date']}; device: {result['device']}",
        f"- allocated before the step (parameters, gradients, optimizer state, caches): {base / gib:.2f} GiB;"
        f" allocated during the step, at its peak: {peak / gib:.2f} GiB; sum {(base + peak) / gib:.2f} GiB",
        f"- the allocation that reached the peak: {where(peak_live[-1]) if peak_live else '(none)'}",
        f"- blocks live at the peak by size (the 12 largest totals): {sizes_line}",
        f"- {len(peak_live)} blocks live at the peak; the {MEMORY_GROUPS} largest groups by allocation site:",
        "",
        "| GiB | blocks | largest MiB | allocated at |",
        "|---:|---:|---:|---|",
    ]
    for site, sizes in top:
        lines.append(f"| {sum(sizes) / gib:.3f} | {len(sizes)} | {max(sizes) / 2**20:.1f} | {site} |")
    before_groups: dict[str, list[int]] = {}  # what is live as the step begins, by where it was allocated
    for segment in before["segments"]:
        if segment.get("device") not in (None, dev):
            continue
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                before_groups.setdefault(where(block), []).append(block["size"])
    if before_groups:
        lines += ["", f"Live as the step begins ({base / gib:.2f} GiB), the 30 largest groups by allocation site:", ""]
        lines += ["| GiB | blocks | largest MiB | allocated at |", "|---:|---:|---:|---|"]
        for site, sizes in sorted(before_groups.items(), key=lambda kv: -sum(kv[1]))[:30]:
            lines.append(f"| {sum(sizes) / gib:.3f} | {len(sizes)} | {max(sizes) / 2**20:.1f} | {site} |")
    if gradients:
        lines += ["", *gradients]
    if known is not None:
        lines += ["", "CUDA tensors live as the step begins that are neither parameters nor optimizer state:", ""]
        lines += holders
    out_dir = Path(args.memory_at_peak)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"memory_{result['job']}_{result['mode']}.md").write_text("\n".join(lines) + "\n")
    return {"before_gib": base / gib, "step_peak_gib": peak / gib, "blocks_at_peak": len(peak_live)}
