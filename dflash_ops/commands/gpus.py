"""The GPUs of a place as `dflash status` shows them: `nvidia-smi` readings joined with the
trainer's per-rank metrics (which rank, which role, how much memory torch holds there).

`nvidia-smi` runs at the place with the `PATH` and `LD_LIBRARY_PATH` of `[job] env` when it sets
them (they decide which nvidia-smi runs and which driver library it loads, as for the trainer);
the rest of that env (tokens, maybe) stays off the command line. A place without it, or one
whose driver does not answer, has no GPU table: `read` returns a short note instead and never
raises, because a status must show even then.

A rank's `gpu` is its local rank, i.e. its CUDA device index among the visible devices; with
`CUDA_VISIBLE_DEVICES` in `[job] env` (a list of indices) it names the physical GPU through that
list. A colocated run (one process, no `ranks` in its metrics) trains on the first visible GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dflash_ops.connect.place import Place
from dflash_ops.errors import CommandTimedOut, DflashError
from dflash_ops.settings.job_config import JobConfig
from dflash_ops.untrusted import clip, last_line

QUERY = "index,utilization.gpu,memory.used,memory.total"
SMI_ARGV = ("nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits")
TIMEOUT_S = 15.0  # a hung driver must not hang the status
NO_ROLE = "—"
LOOKUP_ENV = ("PATH", "LD_LIBRARY_PATH")  # the part of [job] env nvidia-smi is run with


@dataclass(frozen=True, kw_only=True)
class GpuReading:
    """One line of `nvidia-smi --query-gpu=index,utilization.gpu,memory.used,memory.total`."""

    index: int
    util_pct: float | None  # None: "[N/A]" / "[Not Supported]"
    mem_used_mib: float | None
    mem_total_mib: float | None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def parse(text: str) -> list[GpuReading]:
    """The CSV lines (`0, 87, 40312, 143771`); raises ValueError on anything else."""
    readings = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4 or not fields[0].isdigit():
            raise ValueError(f"not {QUERY}: {clip(line)}")
        readings.append(
            GpuReading(
                index=int(fields[0]),
                util_pct=_number(fields[1]),
                mem_used_mib=_number(fields[2]),
                mem_total_mib=_number(fields[3]),
            )
        )
    return readings


def read(place: Place, env: Mapping[str, str]) -> tuple[list[GpuReading] | None, str | None]:
    """(readings, None), or (None, a short note saying why there are none)."""
    argv = ["env", *(f"{k}={env[k]}" for k in LOOKUP_ENV if k in env), *SMI_ARGV]
    try:
        result = place.run(argv, timeout=TIMEOUT_S, check=False)
    except CommandTimedOut:
        return None, f"nvidia-smi did not answer within {TIMEOUT_S:.0f} s"
    if result.exit_code == 127:
        return None, "no nvidia-smi at the place"
    if result.exit_code != 0:
        said = last_line(result.stderr_text.strip() or result.stdout_text)
        return None, f"nvidia-smi failed (exit {result.exit_code}): {said}"
    try:
        readings = parse(result.stdout_text)
    except ValueError as exc:
        return None, f"nvidia-smi printed something else: {exc}"
    return readings, None


def count(place: Place, env: Mapping[str, str]) -> int:
    """How many GPUs `nvidia-smi` lists at the place (0 without one, or when it fails)."""
    try:
        readings, _ = read(place, env)
    except DflashError:  # the place went away: said by the next command, not by a count
        return 0
    return len(readings or [])


def unused(job: JobConfig, *, seen: int) -> int:
    """How many of the `seen` GPUs of the place a `[job] gpus = 0` job leaves idle: all, unless
    the job uses GPUs or its `[job] env` hides them on purpose (an empty CUDA_VISIBLE_DEVICES)."""
    if job.gpus > 0 or job.env.get("CUDA_VISIBLE_DEVICES", None) == "":
        return 0
    return seen


def unused_words(count: int, where: str, config: str) -> tuple[str, str]:
    """The warning about `count` idle GPUs at `where`, and its fix naming the file `config`."""
    return (
        f"{where} has {count} GPU{'s' if count != 1 else ''}, but [job] gpus = 0: the job "
        "trains on the CPU.",
        f"Set gpus = {count} under [job] in {config} and deploy again; to train on "
        'the CPU on purpose, set CUDA_VISIBLE_DEVICES = "" in [job] env.',
    )


def visible_devices(env: Mapping[str, str]) -> list[int] | None:
    """`CUDA_VISIBLE_DEVICES` as physical indices, when it is a plain list of them."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    try:
        return [int(part) for part in raw.split(",") if part.strip()]
    except ValueError:
        return None  # UUIDs or MIG names: the local index is then taken as it is


def ranks_by_gpu(
    metrics: Mapping[str, Any] | None, *, visible: Sequence[int] | None, host: str | None
) -> dict[int, list[dict[str, Any]]]:
    """Physical GPU index → the ranks of the last metrics row on it (`host`: only that node's)."""
    if not metrics:
        return {}
    ranks = metrics.get("ranks")
    if not isinstance(ranks, list):  # colocated: one process on the first visible GPU
        first = visible[0] if visible else 0
        return {first: [{"rank": 0, "role": "colocated", "mem_gib": None}]}
    out: dict[int, list[dict[str, Any]]] = {}
    for rank in ranks:
        local = rank.get("gpu") if isinstance(rank, dict) else None
        if not isinstance(local, int) or (host is not None and rank.get("host") != host):
            continue
        physical = visible[local] if visible and 0 <= local < len(visible) else local
        out.setdefault(physical, []).append(rank)
    return out


def _role(ranks: Sequence[Mapping[str, Any]]) -> str:
    roles = {r.get("role") for r in ranks}
    if not roles:
        return NO_ROLE
    return str(roles.pop()) if len(roles) == 1 else "colocated"


def table(
    readings: Sequence[GpuReading],
    metrics: Mapping[str, Any] | None,
    *,
    env: Mapping[str, str],
    host: str | None = None,
) -> list[dict[str, Any]]:
    """One row per GPU: its reading, the role on it and the trainer's memory of its ranks."""
    on_gpu = ranks_by_gpu(metrics, visible=visible_devices(env), host=host)
    rows = []
    for reading in readings:
        ranks = on_gpu.get(reading.index, [])
        mems = [r["mem_gib"] for r in ranks if isinstance(r.get("mem_gib"), (int, float))]
        rows.append(
            {
                **asdict(reading),
                "role": _role(ranks),
                "ranks": [r["rank"] for r in ranks],
                "mem_gib": sum(mems) if mems else None,
            }
        )
    return rows


def hosts_of(metrics: Mapping[str, Any] | None) -> set[str]:
    """The nodes the last metrics row has ranks on."""
    ranks = metrics.get("ranks") if metrics else None
    if not isinstance(ranks, list):
        return set()
    return {r["host"] for r in ranks if isinstance(r, dict) and isinstance(r.get("host"), str)}


def split_summary(metrics: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Per-role tokens/s and wait share, batches in flight and counted: a split run's view."""
    if not metrics or not isinstance(metrics.get("roles"), dict):
        return None
    return {
        "roles": metrics["roles"],
        "in_flight": metrics.get("in_flight"),
        "batches": metrics.get("batches"),
    }
