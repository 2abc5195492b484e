"""`metrics.jsonl` on disk (whole-row appends, trimming on resume, a clean start from scratch),
the per-rank counters of a split run, and the fields drafter rank 0 adds from them to the rows
(written by `trainer.run.trainer`).

A run folder's rows read as one series, strictly increasing in step: a resumed run cuts the
rows past its checkpoint (they come again) and any torn line (`truncate_rows`); a start from
scratch finds no rows to continue, so what an earlier start left there (killed before its first
checkpoint) is moved into `set-aside/<UTC time>/` (`set_aside`), never appended to, never
deleted. `dflash status` shows the last whole row, and TensorBoard draws the same steps
(`trainer.run.curves`).

Every rank publishes its cumulative counters as JSON under `stats/<rank>` in the control store
(at most every 0.2 s); drafter rank 0 reads all of them at each logged step and turns the deltas
since the previous logged step into rates. One `metrics.jsonl` row of a split run holds the
colocated fields (`step`, `time`, `loss`, `ce`, `kl`, `cap`, `lr`, `tokens_per_s`,
`slot_accuracy`, `grad_norm`, `tokens`, `epochs`, and the τ probe's; loss terms are means over
the drafters, `tokens` the sum) and:

- `tokens_per_s`: real tokens trained by all drafters per second of wall time (the job's rate);
- `roles`: `{"target": {...}, "drafter": {...}}` with `tokens_per_s` (tokens produced resp.
  trained by the role per second), `wait_frac` (mean share of wall time the role's ranks spent
  waiting on the other role: targets blocked by backpressure, drafters waiting for a batch) and
  `ranks` (how many);
- `in_flight`: batches produced and not yet received by a drafter, summed over targets;
- `batches`: `{"produced": P, "trained": T}` since the run (re)started;
- `ranks`: one entry per rank, in rank order: `rank`, `role`, `host`, `gpu` (local rank, the
  CUDA device index; null on the CPU), `batches`, `tokens`, `tokens_per_s`, `wait_frac`,
  `in_flight` (targets; 0 for drafters), `mem_gib` and `mem_peak_gib` (CUDA memory allocated by
  torch on that rank, current and peak; null on the CPU).
`dflash status` shows `ranks` as one line per GPU with its role, next to `nvidia-smi` readings.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

METRICS = "metrics.jsonl"
ASIDE = "set-aside"  # what a start from scratch found of an earlier start: ASIDE/<UTC time>/
GIB = 1024**3


class RankStats:
    """This rank's cumulative counters, published to the store."""

    def __init__(self, session) -> None:
        self.session = session
        self.batches = 0
        self.tokens = 0
        self.wait_s = 0.0
        self.in_flight = 0
        self.started = time.perf_counter()
        self._last = 0.0

    def snapshot(self) -> dict:
        dev = self.session.device
        cuda = dev.type == "cuda"
        return {
            "rank": self.session.roles.rank,
            "role": self.session.roles.role,
            "host": socket.gethostname(),
            "gpu": dev.index if cuda else None,
            "batches": self.batches,
            "tokens": self.tokens,
            "wait_s": self.wait_s,
            "elapsed_s": time.perf_counter() - self.started,
            "in_flight": self.in_flight,
            "mem_gib": torch.cuda.memory_allocated(dev) / GIB if cuda else None,
            "mem_peak_gib": torch.cuda.max_memory_allocated(dev) / GIB if cuda else None,
        }

    def publish(self, *, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last < 0.2:
            return
        self._last = now
        self.session.store.set(f"stats/{self.session.roles.rank}", json.dumps(self.snapshot()))


class RoleMetrics:
    """Drafter rank 0: the fields a split run adds to each metrics row and its log line (the
    row itself is the training loop's, `trainer.run.trainer`)."""

    def __init__(self, session) -> None:
        self.session = session
        self.prev: dict[int, dict] = {}
        self.last_entry: dict[int, dict] = {}

    def _ranks(self) -> list[dict]:
        store = self.session.store
        out = []
        for r in range(self.session.roles.world_size):
            key = f"stats/{r}"
            if store.check([key]):
                out.append(json.loads(store.get(key)))
        return out

    def _rank_entries(self) -> list[dict]:
        """Each rank's rates since its previous entry (its last rates when not republished)."""
        ranks = []
        for cur in self._ranks():
            old = self.prev.get(cur["rank"], {"tokens": 0, "wait_s": 0.0, "elapsed_s": 0.0})
            if cur["elapsed_s"] == old["elapsed_s"] and cur["rank"] in self.last_entry:
                ranks.append(self.last_entry[cur["rank"]])
                continue
            span = max(cur["elapsed_s"] - old["elapsed_s"], 1e-9)
            entry = {
                k: cur[k] for k in ("rank", "role", "host", "gpu", "batches", "tokens", "in_flight")
            }
            entry["tokens_per_s"] = (cur["tokens"] - old["tokens"]) / span
            entry["wait_frac"] = min(1.0, (cur["wait_s"] - old["wait_s"]) / span)
            entry["mem_gib"] = cur["mem_gib"]
            entry["mem_peak_gib"] = cur["mem_peak_gib"]
            ranks.append(entry)
            self.prev[cur["rank"]] = cur
            self.last_entry[cur["rank"]] = entry
        return ranks

    def fields(self) -> tuple[dict, str]:
        """(`roles`, `in_flight`, `batches`, `ranks` of the row; the log line's suffix)."""
        ranks = self._rank_entries()
        roles = {}
        for role in ("target", "drafter"):
            mine = [r for r in ranks if r["role"] == role]
            roles[role] = {
                "ranks": len(mine),
                "tokens_per_s": sum(r["tokens_per_s"] for r in mine),
                "wait_frac": sum(r["wait_frac"] for r in mine) / len(mine) if mine else 0.0,
            }
        store = self.session.store
        produced, trained = store.add("produced", 0), store.add("trained", 0)
        in_flight = sum(r["in_flight"] for r in ranks if r["role"] == "target")
        t, d = roles["target"], roles["drafter"]
        suffix = (
            f" | target {t['tokens_per_s']:,.0f} tok/s wait {100 * t['wait_frac']:.0f}% | "
            f"drafter {d['tokens_per_s']:,.0f} tok/s wait {100 * d['wait_frac']:.0f}% | "
            f"in flight {in_flight}"
        )
        row = {
            "roles": roles,
            "in_flight": in_flight,
            "batches": {"produced": produced, "trained": trained},
            "ranks": ranks,
        }
        return row, suffix


def append_row(path: Path, row: dict) -> None:
    """Append `row` as one JSON line, whole or not at all: one `write` of the whole line, and
    when it fails part-way (a full disk) the file is cut back to its size before, then the
    error is raised. Readers therefore never meet half a line written by this process."""
    data = (json.dumps(row) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        before = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as exc:
            os.ftruncate(fd, before)
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Trimmed:
    """What `truncate_rows` did: rows kept, rows after the step dropped, unreadable lines cut."""

    kept: int
    dropped: int
    torn: list[str]  # "line N: why" for each line that was not a whole JSON row


def truncate_rows(path: Path, step: int) -> Trimmed:
    """Keep the rows of steps ≤ `step` (those after the checkpoint being resumed are logged
    again). A line that is not a whole JSON object with a step — the torn last line of a
    write cut short by a full disk or a crash of an older version — is cut, never parsed
    into the run's history. The file is replaced atomically (temp file, fsync, rename)."""
    if not path.is_file():
        return Trimmed(0, 0, [])
    keep: list[bytes] = []
    dropped, torn = 0, []
    for n, line in enumerate(path.read_bytes().split(b"\n"), 1):
        if not line.strip():
            continue
        found, why = _row_step(line)
        if found is None:
            torn.append(f"line {n}: {why}")
        elif found <= step:
            keep.append(line + b"\n")
        else:
            dropped += 1
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(b"".join(keep))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return Trimmed(len(keep), dropped, torn)


def set_aside(out_dir: Path, names: Sequence[str]) -> Path | None:
    """Move the entries `names` of `out_dir` that exist (and are not empty) into a new
    `set-aside/<UTC time>/`; the folder, or None when there was nothing to move. Renames only:
    nothing is copied or deleted (an empty file is removed: it holds no row)."""
    found = []
    for name in names:
        path = out_dir / name
        if path.is_file() and path.stat().st_size == 0:
            path.unlink()
        elif path.exists():
            found.append(path)
    if not found:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest, n = out_dir / ASIDE / stamp, 1
    while dest.exists():  # two clean starts within a second
        n += 1
        dest = out_dir / ASIDE / f"{stamp}-{n}"
    dest.mkdir(parents=True)
    for path in found:
        os.rename(path, dest / path.name)
    return dest


def _row_step(line: bytes) -> tuple[int | None, str]:
    """(the step of a whole metrics row, "") or (None, why the line is not one)."""
    try:
        row = json.loads(line)
    except ValueError as exc:  # torn JSON, bytes that are not UTF-8
        return None, type(exc).__name__
    step = row.get("step") if isinstance(row, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        return None, "no integer step"
    return step, ""
