"""``--memory-at-peak``: what is live at the peak of one more training step, by allocation site, from a replay
of the CUDA allocator's trace.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch


def live_at_peak(events: list[dict]) -> tuple[int, list[dict]]:
    """Replay an allocator trace (``alloc`` / ``free_requested`` / ``free_completed`` events of ``addr`` and
    ``size``): the most bytes allocated at once (blocks allocated before the trace began not counted), and the
    events of the blocks live at that moment. A block counts as freed at its first free event."""
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


# groups listed by --memory-at-peak: 30 left the 1B job's 1.4 GiB difference to Liger-Kernel in the unlisted ones
MEMORY_GROUPS = 80


def memory_at_peak(result, args, ids, train_step, sync, device: torch.device) -> dict[str, Any] | None:
    """One more step with the CUDA allocator's history recorded; replay its trace to the moment the allocated
    bytes peak and write what is live then, grouped by where it was allocated (the first frame outside torch's
    own files, with its source line: Inductor's generated code names the buffer and its shape there), to
    ``memory_<job>_<mode>.md`` in ``--memory-at-peak``."""
    if device.type != "cuda":
        print("train_step: --memory-at-peak needs CUDA; skipped", file=sys.stderr)
        return None
    import linecache

    sync()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)
    try:
        train_step(ids)
        sync()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, peak_live = live_at_peak(snapshot["device_traces"][device.index or 0])

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
    gib = 2.0**30
    lines = [
        f"# Memory at the peak of one step: {result['job']}, {result['mode']}",
        "",
        f"- command: `{result['command']}`",
        f"- date: {result['date']}; device: {result['device']}",
        f"- allocated before the step (parameters, gradients, optimizer state, caches): {base / gib:.2f} GiB;"
        f" allocated during the step, at its peak: {peak / gib:.2f} GiB; sum {(base + peak) / gib:.2f} GiB",
        f"- {len(peak_live)} blocks live at the peak; the {MEMORY_GROUPS} largest groups by allocation site:",
        "",
        "| GiB | blocks | largest MiB | allocated at |",
        "|---:|---:|---:|---|",
    ]
    for site, sizes in top:
        lines.append(f"| {sum(sizes) / gib:.3f} | {len(sizes)} | {max(sizes) / 2**20:.1f} | {site} |")
    out_dir = Path(args.memory_at_peak)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"memory_{result['job']}_{result['mode']}.md").write_text("\n".join(lines) + "\n")
    return {"before_gib": base / gib, "step_peak_gib": peak / gib, "blocks_at_peak": len(peak_live)}
