"""Atomic checkpoints with a manifest, and choosing the one to resume from.

Layout inside the run folder: `step-00000500/{state.pt, manifest.json}`. Writing goes to a
hidden temp folder (`.tmp-step-…`), every file and the folder are fsynced, then the folder is
renamed into place and the run folder fsynced: a crash leaves either a complete checkpoint or a
temp folder that is ignored. Only real folders with exactly those names are the trainer's: a
link, a file or another `step-…` name in the run folder (`foreign`) is never followed, pruned,
removed or resumed from, only named. The manifest carries the step, the model+data config hash and the
settings behind it (to name what differs), the code version and the sha256 of `state.pt`;
resume takes the newest checkpoint whose manifest parses and whose checksum matches, and says
which ones it skipped and why.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.base.errors import TrainerError
from trainer.base.files import fsync_path
from trainer.model.drafter import DRAFTER_FORMAT
from trainer.settings.config import TrainConfig, diff_settings

STATE = "state.pt"
MANIFEST = "manifest.json"
_NAME = re.compile(r"^step-(\d{8})$")
_TMP = re.compile(r"^\.tmp-step-\d{8}-\d+$")


class CheckpointMismatch(TrainerError):
    """The newest checkpoint was written with other model or data settings."""

    hint = (
        "Use the same settings, train into a new --out folder, or resume anyway: "
        "dflash deploy --resume --force-resume (python -m trainer train: --force-resume)."
    )

    def __init__(self, path: Path, keys: list[str]) -> None:
        super().__init__(f"{path} was written with different settings: {', '.join(keys)}")
        self.path = path
        self.keys = keys


class ScheduleChanged(TrainerError):
    """The learning-rate schedule differs from the checkpoint's (e.g. run.steps raised)."""

    hint = (
        "To train on with the new schedule, set extend = true under [train.run] in deploy.toml "
        "and run dflash deploy --resume (python -m trainer train: --set run.extend=true); "
        "otherwise put the old values back."
    )

    def __init__(self, path: Path, changes: list[str]) -> None:
        super().__init__(
            f"{path.name} was trained with another learning-rate schedule: {'; '.join(changes)} "
            "(resuming would change the lr of every later step)"
        )
        self.path = path
        self.changes = changes


class RunFinished(TrainerError):
    """The newest checkpoint is already at (or past) run.steps: nothing is left to train."""

    exit_code = 0  # a finished run is not a failure

    hint = (
        "To train longer, raise run.steps and set run.extend = true; to start over, "
        "dflash restart --clean (the checkpoints are archived, not deleted)."
    )


class CheckpointInTheWay(TrainerError):
    """Something the trainer did not make sits where the next checkpoint must go."""

    exit_code = 1

    hint = (
        "Move it out of the run folder (it is not touched), then resume: "
        "dflash restart (python -m trainer train resumes from the last good checkpoint)."
    )


class CheckpointWriteFailed(TrainerError):
    """A checkpoint could not be written (disk full, permissions); earlier ones are intact."""

    exit_code = 1  # the machine's failure, as any other full disk (docs/reliability.md)

    hint = (
        "Free space or fix permissions in the run folder; training resumes from the last good one."
    )


@dataclass(frozen=True, kw_only=True)
class Manifest:
    step: int
    config_hash: str
    code_version: str
    sha256: str
    created: float
    settings: dict[str, Any] = field(default_factory=dict)
    schedule: dict[str, Any] = field(default_factory=dict)  # `TrainConfig.schedule_settings`
    resolved: dict[str, Any] = field(default_factory=dict)  # every setting as the run used it
    # the drafter's layer format (`trainer.model.drafter.DRAFTER_FORMAT`); manifests without it are 1
    drafter_format: int = 1


@dataclass(frozen=True)
class Found:
    """The checkpoint to resume from (or None) and the ones skipped, with the reason."""

    path: Path | None
    manifest: Manifest | None
    skipped: list[tuple[Path, str]]


def code_version() -> str:
    """Package version + a digest of the trainer's own sources (works in a bundle without git)."""
    from importlib import metadata

    try:
        version = metadata.version("dflash")
    except metadata.PackageNotFoundError:
        version = "0+unknown"
    digest = hashlib.sha256()
    package = Path(__file__).parents[1]  # trainer/
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + path.read_bytes())
    return f"{version}+{digest.hexdigest()[:12]}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    state: dict[str, Any],
    config: TrainConfig,
    *,
    keep_last: int,
    resolved: dict[str, Any] | None = None,
) -> Path:
    """Write `state` as checkpoint `step` atomically, then keep only the last `keep_last`.
    `resolved`: the values the run chose for automatic settings (target layers, mask token,
    γ, device), stored in the manifest over the config's own."""
    run_dir = Path(run_dir)
    tmp = run_dir / f".tmp-step-{step:08d}-{os.getpid()}"
    try:
        return _save(run_dir, tmp, step, state, config, keep_last=keep_last, resolved=resolved)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if _behind(exc, KeyboardInterrupt) and not isinstance(exc, KeyboardInterrupt):
            # a second signal inside torch.save comes out as its RuntimeError: still a stop
            raise KeyboardInterrupt from exc
        os_error = _os_error(exc)
        if os_error is None:
            raise
        raise CheckpointWriteFailed(
            f"writing checkpoint step {step} in {run_dir} failed: {os_error}"
        ) from exc


def _behind(exc: BaseException | None, kind: type[BaseException]) -> BaseException | None:
    """The exception of `kind` behind `exc` (torch.save re-raises what interrupted its write
    as a RuntimeError)."""
    while exc is not None:
        if isinstance(exc, kind):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _os_error(exc: BaseException | None) -> OSError | None:
    """The OSError behind `exc` (a failed write)."""
    found = _behind(exc, OSError)
    return found if isinstance(found, OSError) else None


def _save(
    run_dir: Path,
    tmp: Path,
    step: int,
    state: dict[str, Any],
    config: TrainConfig,
    *,
    keep_last: int,
    resolved: dict[str, Any] | None,
) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / f"step-{step:08d}"
    for path in (final, tmp):
        why = _not_ours(path) if os.path.lexists(path) else ""
        if why:
            raise CheckpointInTheWay(
                f"cannot write checkpoint step {step}: {path} is {why} the trainer did not make"
            )
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with open(tmp / STATE, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    manifest = Manifest(
        step=step,
        config_hash=config.model_data_hash(),
        code_version=code_version(),
        sha256=_sha256(tmp / STATE),
        created=time.time(),
        settings=config.model_data_settings(),
        schedule=config.schedule_settings(),
        resolved={**config.flat(), **(resolved or {})},
        drafter_format=DRAFTER_FORMAT,
    )
    with open(tmp / MANIFEST, "w") as fh:
        json.dump(asdict(manifest), fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_path(tmp)
    if final.is_dir():  # a re-run of the same step replaces it (a real folder: `_not_ours`)
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(run_dir)
    prune(run_dir, keep_last=keep_last)
    return final


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete-looking checkpoint folders, oldest first (temp folders and `foreign` entries
    never match)."""
    found = [(int(p.name[5:]), p) for p in _entries(run_dir, _NAME)]
    return sorted(found)


def remove_stale_temps(run_dir: str | Path) -> list[Path]:
    """Delete temp folders left by an interrupted write (only real `.tmp-step-*` folders)."""
    stale = _entries(run_dir, _TMP)
    for path in stale:
        shutil.rmtree(path)
    return stale


def foreign(run_dir: str | Path) -> list[tuple[Path, str]]:
    """Entries named like the trainer's (`step-…`, `.tmp-step-…`) that it did not make, by
    name, with what each is: a link, a file, a folder named otherwise. Everything here leaves
    them alone; the trainer's log names them."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    named = [p for p in run_dir.iterdir() if p.name.startswith(("step-", ".tmp-step-"))]
    return [(p, why) for p in sorted(named) if (why := _not_ours(p))]


def _entries(run_dir: str | Path, pattern: re.Pattern[str]) -> list[Path]:
    """The real folders (never a link) of `run_dir` whose names match `pattern`."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return [p for p in run_dir.iterdir() if pattern.match(p.name) and not _not_ours(p)]


def _not_ours(path: Path) -> str:
    """What `path` is when the trainer cannot have made it ("" when it can): its checkpoints and
    temp folders are real folders, never links."""
    if path.is_symlink():
        return f"a symbolic link (to {os.readlink(path)})"
    if not path.is_dir():
        return "not a folder"
    if not (_NAME.match(path.name) or _TMP.match(path.name)):
        return "a folder not named step-NNNNNNNN"
    return ""


def prune(run_dir: Path, *, keep_last: int) -> None:
    for _, path in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(path)


def read_manifest(path: Path) -> Manifest:
    raw = json.loads((path / MANIFEST).read_text())
    return Manifest(**raw)


def verify(path: Path) -> tuple[Manifest | None, str]:
    """(manifest, "") when the checkpoint is whole, else (None, why not)."""
    if not (path / MANIFEST).is_file():
        return None, "no manifest"
    try:
        manifest = read_manifest(path)
    except (ValueError, TypeError) as exc:  # torn or foreign JSON, bytes that are not UTF-8
        return None, f"unreadable manifest ({exc})"
    if not (path / STATE).is_file():
        return None, f"no {STATE}"
    actual = _sha256(path / STATE)
    if actual != manifest.sha256:
        return (
            None,
            f"checksum mismatch ({STATE} sha256 {actual[:12]}…, manifest {manifest.sha256[:12]}…)",
        )
    return manifest, ""


def find_resumable(run_dir: str | Path) -> Found:
    """The newest verified checkpoint in `run_dir`, and every newer one skipped with its reason."""
    skipped: list[tuple[Path, str]] = []
    for step, path in reversed(list_checkpoints(run_dir)):
        manifest, why = verify(path)
        if manifest is None:
            skipped.append((path, why))
            continue
        if manifest.step != step:
            skipped.append((path, f"manifest says step {manifest.step}"))
            continue
        return Found(path, manifest, skipped)
    return Found(None, None, skipped)


def check_compatible(found: Found, config: TrainConfig, *, force: bool = False) -> list[str]:
    """Keys whose values differ; raises `CheckpointMismatch` unless `force`."""
    assert found.path is not None and found.manifest is not None
    changed = format_changes(found.manifest)
    if found.manifest.config_hash == config.model_data_hash() and not changed:
        return []
    keys = diff_settings(found.manifest.settings, config.model_data_settings())
    keys = keys + changed if keys or changed else ["(config hash)"]
    if not force:
        raise CheckpointMismatch(found.path, keys)
    return keys


def check_schedule(found: Found, config: TrainConfig) -> list[str]:
    """`key old → new` for each schedule setting that differs from the checkpoint's (none for a
    manifest written before schedules were recorded); raises `ScheduleChanged` unless
    `run.extend`. A finished run (checkpoint step ≥ run.steps) raises `RunFinished`."""
    assert found.path is not None and found.manifest is not None
    old, new = found.manifest.schedule, config.schedule_settings()
    changes = [f"{k} {old[k]} → {new[k]}" for k in sorted(new) if k in old and old[k] != new[k]]
    if changes and not config.run.extend:
        raise ScheduleChanged(found.path, changes)
    if found.manifest.step >= config.run.steps:
        raise RunFinished(
            f"nothing left to do: {found.path.name} is at step {found.manifest.step} and "
            f"run.steps = {config.run.steps}"
        )
    return changes


def format_changes(manifest: Manifest) -> list[str]:
    """Settings whose meaning changed since the checkpoint's drafter format: format 1 counted a
    sliding window before the anchor, the engines (and format 2) end it at each slot."""
    if manifest.drafter_format >= DRAFTER_FORMAT or not manifest.settings.get(
        "model.sliding_layers"
    ):
        return []
    return ["model.sliding_window (drafter format 1: the window rule changed)"]


def load_state(path: Path, *, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    with open(path / STATE, "rb") as fh:
        return torch.load(fh, map_location=map_location, weights_only=True)
