"""Where a training step's time goes, recorded inside a real run (`run.profile_steps`).

A step of a small drafter can be waiting on the host (Python, kernel launches, the data) as
much as on its kernels; only a profile of the run itself tells which, so `StepProfiler` records
`run.profile_steps` consecutive steps after `run.profile_start` with `torch.profiler` and writes
into `<out>/profile/`: a Chrome trace (`…trace.json.gz`, for https://ui.perfetto.dev), the
kernel table (`….txt`) and a summary (`….json`): wall time per step, kernel time per step (on a
GPU: how busy it was), and the kernels by kind (matrix multiplies, attention, loss, optimizer,
…). The log gets one line with the same figures. `bench/profile_drafter.py` sorts kernels with
the same `KINDS`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

PROFILE_DIR = "profile"

# First match wins: kernel name pattern → kind.
KINDS = [
    ("attention backward", re.compile(r"(flex|flash|attention).*(bwd|backward)", re.I)),
    ("attention forward", re.compile(r"flex|flash|attention", re.I)),
    ("block mask", re.compile(r"mask|create_block", re.I)),
    ("loss kernels", re.compile(r"_stats_kernel|_grad_kernel|logsumexp|cross_entropy", re.I)),
    (
        "matmul",
        re.compile(r"gemm|gemv|cutlass|nvjet|sm90|sm80|cublas|matmul|aten::(mm|addmm|bmm)$", re.I),
    ),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("communication", re.compile(r"nccl", re.I)),
    ("copies", re.compile(r"memcpy|memset", re.I)),
]


def kind_of(name: str) -> str:
    return next((k for k, pattern in KINDS if pattern.search(name)), "other")


def by_kind(events: Iterable[tuple[str, float]], total_us: float) -> list[dict[str, Any]]:
    """(kernel name, µs per step) → one row per kind, largest first, with its share of
    `total_us`."""
    totals: dict[str, float] = {}
    for name, us in events:
        kind = kind_of(name)
        totals[kind] = totals.get(kind, 0.0) + us
    return [
        {"kind": k, "ms_per_step": v / 1e3, "share": v / total_us if total_us else 0.0}
        for k, v in sorted(totals.items(), key=lambda kv: -kv[1])
    ]


def kernel_times(averages: Any, *, gpu: bool) -> list[tuple[str, float]]:
    """(name, µs) of the kernels only, from `prof.key_averages()`: on a GPU the device events
    that are not annotations (an `Optimizer.step` range would count its kernels twice); on the
    CPU each op's self time."""
    if not gpu:
        return [(e.key, e.self_cpu_time_total) for e in averages if e.self_cpu_time_total > 0]
    return [
        (e.key, e.self_device_time_total)
        for e in averages
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
        and e.self_device_time_total > 0
    ]


@dataclass(frozen=True)
class ProfileReport:
    """Steps `first`…`last` of a run as the profiler saw them (times per step)."""

    first: int
    last: int
    device: str
    wall_ms: float
    kernel_ms: float
    kinds: list[dict[str, Any]]
    table: str  # path of the kernel table
    trace: str  # path of the Chrome trace

    @property
    def busy(self) -> float:
        """Kernel time over wall time: near 1, the step waits on its kernels; far below, on
        the host."""
        return self.kernel_ms / self.wall_ms if self.wall_ms else 0.0

    def line(self) -> str:
        top = ", ".join(f"{k['kind']} {k['ms_per_step']:.1f}" for k in self.kinds[:5])
        what = "GPU kernels" if self.device == "cuda" else "CPU ops"
        return (
            f"profile of steps {self.first}–{self.last}: {self.wall_ms:.1f} ms a step, {what} "
            f"{self.kernel_ms:.1f} ms of it ({100 * self.busy:.0f} % busy; ms: {top}) — "
            f"{self.table}, trace {self.trace}"
        )


class StepProfiler:
    """Records `count` steps of a run, the first trained after step `start` (count 0: never;
    a run resumed past `start` records its first steps). `before(done)` and `after(done)` are
    called around each step with the number of steps done so far."""

    def __init__(
        self, out_dir: Path, *, start: int, count: int, device: torch.device, name: str = ""
    ) -> None:
        self.folder = out_dir / PROFILE_DIR
        self.start, self.count = start, count
        self.device = device
        self.name = name
        self._prof: Any = None
        self._recorded = False
        self._began = 0.0
        self._first = 0

    def before(self, done: int) -> None:
        if not self.count or self._recorded or self._prof is not None or done < self.start:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._sync()
        self._prof = torch.profiler.profile(activities=activities)
        self._prof.__enter__()
        self._first = done + 1
        self._began = time.perf_counter()

    def after(self, done: int) -> ProfileReport | None:
        if self._prof is None or done < self._first + self.count - 1:
            return None
        return self.finish(done)

    def finish(self, done: int) -> ProfileReport | None:
        """Stops recording after step `done` (also when the run ends early) and writes the
        files; None when nothing is being recorded or no step was."""
        if self._prof is None:
            return None
        self._sync()
        wall = time.perf_counter() - self._began
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self._recorded = True
        steps = done - self._first + 1
        if steps < 1:
            return None
        return self._write(prof, steps, wall / steps, done)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _write(self, prof: Any, steps: int, step_s: float, last: int) -> ProfileReport:
        gpu = self.device.type == "cuda"
        averages = prof.key_averages()
        events = [(key, us / steps) for key, us in kernel_times(averages, gpu=gpu)]
        kernel_us = sum(us for _, us in events)
        stem = f"{self.name}steps-{self._first}-{last}"
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"{stem}.trace.json.gz"
        prof.export_chrome_trace(str(trace))
        table = self.folder / f"{stem}.txt"
        sort = "self_device_time_total" if gpu else "self_cpu_time_total"
        report = ProfileReport(
            first=self._first,
            last=last,
            device=self.device.type,
            wall_ms=step_s * 1e3,
            kernel_ms=kernel_us / 1e3,
            kinds=by_kind(events, kernel_us),
            table=str(table),
            trace=str(trace),
        )
        kinds = "\n".join(
            f"{k['kind']:<20} {k['ms_per_step']:9.2f} ms  {100 * k['share']:5.1f} %"
            for k in report.kinds
        )
        text = [report.line(), f"kernels by kind, per step:\n{kinds}"]
        text.append(averages.table(sort_by=sort, row_limit=40, max_name_column_width=90))
        if gpu:  # a step waiting on the host: which ops the host spends its time in
            host = averages.table(sort_by="self_cpu_time_total", row_limit=25)
            text.append(f"the host's side, ops by their own CPU time:\n{host}")
        table.write_text("\n\n".join(text) + "\n")
        (self.folder / f"{stem}.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
        return report
