"""What is alive on the GPU at the peak of one call, grouped by where it was allocated.

`peak_breakdown(fn, device)` runs `fn` once with the CUDA caching allocator's history on
(`torch.cuda.memory._record_memory_history`), replays the allocations and frees of that call to
find its peak, and groups the blocks alive then by the innermost frame in the trainer's own code
(else the innermost frame: compiled code, autograd's engine). What was allocated before the call
(weights, optimizer state, inputs) is one row, "before the call". A bench's record keeps the
rows, so a peak can be attributed before it is worked on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

GIB = 1 << 30
OWN = ("/trainer/",)  # frames of these folders name a row
MAX_ENTRIES = 2_000_000


def peak_breakdown(
    fn: Callable[[], Any], device: torch.device, *, rows: int = 12
) -> dict[str, Any]:
    """`fn()` under the allocator's history: its peak in GiB and the top `rows` groups then."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(
        stacks="python", max_entries=MAX_ENTRIES, device=device
    )
    try:
        fn()
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)
    trace = snapshot["device_traces"][torch.device(device).index or 0]
    alive = _alive_at_peak(trace)
    groups: Counter[str] = Counter()
    for size, frames in alive.values():
        groups[_where(frames)] += size
    top = groups.most_common(rows)
    rest = sum(groups.values()) - sum(size for _, size in top)
    table = [{"where": "before the call", "gib": before / GIB}]
    table += [{"where": where, "gib": size / GIB} for where, size in top]
    if rest:
        table.append({"where": f"{len(groups) - len(top)} other places", "gib": rest / GIB})
    return {"peak_gib": (before + sum(s for s, _ in alive.values())) / GIB, "rows": table}


def _alive_at_peak(trace: list[dict[str, Any]]) -> dict[int, tuple[int, list[dict[str, Any]]]]:
    """The blocks allocated during the trace and alive at its highest point (two passes: where
    the highest point is, then the blocks alive there)."""
    total = best = peak_at = 0
    sizes: dict[int, int] = {}
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            sizes[event["addr"]] = event["size"]
            total += event["size"]
            if total > best:
                best, peak_at = total, i
        elif event["action"] == "free_completed" and event["addr"] in sizes:
            total -= sizes.pop(event["addr"])
    alive: dict[int, tuple[int, list[dict[str, Any]]]] = {}
    for event in trace[: peak_at + 1]:
        if event["action"] == "alloc":
            alive[event["addr"]] = (event["size"], event.get("frames", []))
        elif event["action"] == "free_completed":
            alive.pop(event["addr"], None)
    return alive


def _where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame of our own code, else the innermost frame, as `file:line function`."""
    for frame in frames:
        if any(part in frame["filename"] for part in OWN):
            return _name(frame)
    for frame in frames:
        if frame["filename"].endswith(".py"):
            kind = "compiled code" if "torchinductor" in frame["filename"] else None
            return kind or _name(frame)
    return "no Python frame (autograd's engine, C++)"


def _name(frame: dict[str, Any]) -> str:
    filename = frame["filename"]
    short = filename.split("/trainer/", 1)[-1] if "/trainer/" in filename else filename
    return f"{short}:{frame['line']} {frame['name']}"
