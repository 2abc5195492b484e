"""Timing, peak-memory and reporting helpers shared by the benchmarks."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python bench/x.py` imports this file as `common`
    sys.path.insert(0, str(ROOT))

from bench.records import write_json  # noqa: E402

GIB = float(1 << 30)
ANCHOR_TFLOPS = 790.0  # bf16 matrix rate measured on an H200 (anchors/h200.md)


def help_parser(doc: str | None) -> argparse.ArgumentParser:
    """A script's parser whose `--help` is the script's docstring: its first paragraph, the
    options, then the rest as written (the commands, the rows and columns, the goals)."""
    head, _, rest = (doc or "").strip().partition("\n\n")
    return argparse.ArgumentParser(
        description=head, epilog=rest or None, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def repo_on_path() -> None:
    """Let `python bench/x.py` import the trainer package from the checkout."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)


def log(msg: str) -> None:
    """One progress line with the wall-clock time, flushed (the runs are watched as they go)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device: torch.device, *, warmup: int, reps: int) -> float:
    """Median wall time of `fn` in ms after `warmup` calls (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_gib(fn: Callable[[], Any], device: torch.device) -> float | None:
    """Peak allocated memory of one call beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - before) / GIB


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return (
            f"{value:.{digits}e}" if value and abs(value) < 10**-digits else f"{value:.{digits}f}"
        )
    return str(value)


def markdown(rows: list[dict[str, Any]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def write(out: str | None, payload: dict[str, Any]) -> None:
    if out:
        write_json(out, payload)


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "device": str(device)}
    try:  # its attention paths (masks, grouped heads) decide decoding speed
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = None
    return env


def report(
    out: str | None,
    *,
    title: str,
    shape: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    rows: list[dict[str, Any]],
    columns: list[str],
    summary: dict[str, Any],
) -> None:
    """Print the table and its summary, and write them with the environment as JSON to `out`."""
    print(title)
    print(markdown(rows, columns))
    for key, value in summary.items():
        print(f"- {key}: {value}")
    payload = {"shape": shape, "dtype": str(dtype), "env": environment(device)}
    write(out, {**payload, "rows": rows, "summary": summary})
