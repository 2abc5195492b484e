"""SpecForge's side of `bench/compare_peer.py`: its own training entry on the same data.

SpecForge 0.2.0 trains online only against an SGLang server (its Hugging Face target backend
was removed); without a server its training entry, `specforge train`, trains from offline
features: one `.ckpt` per sample holding `input_ids`, `loss_mask` and `hidden_states` (the
selected target layers' hidden states, concatenated), as its own capture script writes them.
So the stages are:
1. `capture` (no SpecForge import): the same target, loaded as ours loads it, computes the
   features of the same training samples; they are written in that format;
2. `train` (SpecForge's packages on the path): `specforge.cli.main(["train", "-c", run.yaml])`
   in this process, so that its peak memory is read here; its own logging windows
   (`perf/optimizer_step_time_s`) give the step time; then its exporter
   (`specforge.export.to_hf.export_to_hf`) writes the Hugging Face folder that the evaluation
   loads into ours. When the entry fails, the error is recorded and the stage says so (the
   caller then drives its modules from ours' data loop: `bench/peer_modules.py`).
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from bench.common import log
from bench.peer_common import (
    Settings,
    ours_folder,
    peak_gib,
    specforge_folder,
    steady,
    write_stage,
)
from bench.peer_recipe import draft_config, dtype, specforge_run, target_layers, usable_samples

CAPTURE_BATCH = 64  # samples per target forward while capturing


def importable() -> str | None:
    """None when SpecForge's DFlash model imports here, else why not (one line)."""
    try:
        import specforge.modeling.draft.dflash  # noqa: F401
    except Exception as exc:  # any import failure means: absent here
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def failure(exc: BaseException) -> str:
    """One line: the exception and the innermost place it came from."""
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    place = f" ({where[0].filename}:{where[0].lineno}, in {where[0].name})" if where else ""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}{place}"


def folder(settings: Settings) -> Path:
    return settings.root / "specforge"


# ---- 1. features -------------------------------------------------------------------------------


def capture(settings: Settings) -> dict[str, Any]:
    """The training samples' features from the target, one SpecForge feature file a sample."""
    from trainer.model.target import load_target

    device = torch.device(settings.device)
    out = folder(settings) / "features"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    target = load_target(settings.root / "target", device=device, layers=target_layers(settings))
    samples = usable_samples(settings)
    t0, written = time.perf_counter(), 0
    for start in range(0, len(samples), CAPTURE_BATCH):
        chunk = samples[start : start + CAPTURE_BATCH]
        width = max(len(s.input_ids) for s in chunk)
        ids = torch.tensor([[*s.input_ids, *[0] * (width - len(s.input_ids))] for s in chunk])
        feats = target(ids.to(device)).features.to(dtype(settings)).cpu()  # (n, S, k·H)
        for j, s in enumerate(chunk):
            n = len(s.input_ids)
            record = {
                "input_ids": ids[j, :n].clone(),
                "loss_mask": torch.tensor(s.loss_mask, dtype=torch.long),
                "hidden_states": feats[j, :n].clone(),
            }
            path = out / f"data_{start + j:08d}.ckpt"
            torch.save(record, path)
            written += path.stat().st_size
    seconds = time.perf_counter() - t0
    log(
        f"captured {len(samples):,} samples' features ({written / 2**30:.2f} GiB) in {seconds:.1f} s"
    )
    return {
        "ok": True, "samples": len(samples), "bytes": written, "seconds": seconds,
        "folder": str(out),
    }  # fmt: skip


# ---- 2. its training entry ---------------------------------------------------------------------


class Tee(io.TextIOBase):
    """stdout as it is, and a copy kept (SpecForge logs its steps by printing them)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.kept = io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def step_rows(text: str) -> list[dict[str, Any]]:
    """Its `step N: {...}` log lines (`specforge.training.assembly._logger`) as dicts."""
    rows = []
    for line in text.splitlines():
        head, sep, body = line.partition(": ")
        if sep and head.startswith("step ") and head[5:].isdigit() and body.startswith("{"):
            try:
                rows.append({"step": int(head[5:]), **ast.literal_eval(body)})
            except (ValueError, SyntaxError):
                continue
    return rows


def windows(rows: list[dict[str, Any]]) -> list[tuple[int, int, float]]:
    """(first step, last step, seconds) of each logging window: its own step time × steps."""
    out, previous = [], 0
    for row in sorted(rows, key=lambda r: r["step"]):
        seconds = row.get("perf/optimizer_step_time_s")
        if seconds is not None:
            out.append((previous, row["step"], seconds * (row["step"] - previous)))
        previous = row["step"]
    return out


def run_entry(config: Path) -> tuple[str | None, str]:
    """`specforge train -c config` in this process → (error or None, what it printed)."""
    from specforge.cli import main

    tee = Tee(sys.stdout)
    error = None
    with contextlib.redirect_stdout(tee):
        try:
            code = main(["train", "-c", str(config)])
            if code:
                error = f"specforge train exited with {code}"
        except BaseException as exc:  # its failure is a result here, not the end of the run
            traceback.print_exc()
            error = failure(exc)
    return error, tee.kept.getvalue()


def train(settings: Settings) -> dict[str, Any]:
    """Its entry at `settings.specforge_sharding`, then once more with NO_SHARD (plain DDP)
    if that run fails or its checkpoint does not export; the figures of the run whose export
    the evaluation reads (`trained`: the first run that trained, when none exported)."""
    root = folder(settings)
    shutil.rmtree(specforge_folder(settings), ignore_errors=True)  # a previous run's export
    draft = root / "draft_config.json"
    draft.write_text(json.dumps(draft_config(settings), indent=2) + "\n")
    attempts: list[dict[str, Any]] = []
    for sharding in dict.fromkeys([settings.specforge_sharding, "NO_SHARD"]):
        attempt = attempt_run(settings, sharding, draft)
        attempts.append(attempt)
        if attempt["error"] is None and exported(attempt, draft, specforge_folder(settings)):
            break
    trained = [a for a in attempts if a["error"] is None]
    chosen = next((a for a in trained if "export" in a), trained[0] if trained else None)
    return {
        "ok": chosen is not None,
        "trained": chosen,
        "attempts": attempts,
        "draft_config": str(draft),
        "interop": interop(settings) if chosen and "export" in chosen else None,
        "version": _version(),
    }


def attempt_run(settings: Settings, sharding: str, draft: Path) -> dict[str, Any]:
    """One `specforge train` at `sharding`: its error (None: it finished), wall time, peak
    memory, logged steps and their steady state."""
    import yaml  # SpecForge's own config format

    device = torch.device(settings.device)
    root = folder(settings)
    out = root / f"out-{sharding.lower()}"
    shutil.rmtree(out, ignore_errors=True)
    samples = len(list((root / "features").glob("*.ckpt")))
    cfg = specforge_run(
        settings, features=root / "features", draft=draft, out=out, sharding=sharding,
        samples=samples,
    )  # fmt: skip
    path = root / f"run-{sharding.lower()}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    error, printed = run_entry(path)
    rows = step_rows(printed)
    log(f"specforge train ({sharding}): {'done' if error is None else error}")
    return {
        "sharding": sharding, "config": str(path), "out": str(out), "error": error,
        "wall_s": time.perf_counter() - t0, "peak_gib": peak_gib(device), "rows": rows,
        "steady": steady(windows(rows), settings.warm_steps),
    }  # fmt: skip


def exported(attempt: dict[str, Any], draft: Path, to: Path) -> bool:
    """Its exporter (`specforge export --to hf`) on the run's last checkpoint; a failure is
    recorded in `attempt`."""
    from specforge.export.to_hf import export_to_hf

    checkpoint = (Path(attempt["out"]) / "peer-latest").resolve()
    shutil.rmtree(to, ignore_errors=True)
    try:
        export_to_hf(str(checkpoint), str(draft), str(to))
    except Exception as exc:  # its exporter failing is a finding, recorded
        traceback.print_exc()
        attempt["export_error"] = failure(exc)
        log(f"specforge export failed: {attempt['export_error']}")
        return False
    attempt["export"] = {"checkpoint": str(checkpoint), "folder": str(to)}
    return True


def interop(settings: Settings) -> dict[str, Any]:
    """`bench.peer_interop.check` of both exported folders on a training sample (its failure
    is recorded, not raised: the training figures stand without it)."""
    from bench.peer_interop import on_training_data

    found = {"ours": ours_folder(settings), "specforge": specforge_folder(settings)}
    found = {k: v for k, v in found.items() if (v / "config.json").is_file()}
    try:
        return on_training_data(found, settings)
    except Exception as exc:  # recorded beside the figures
        traceback.print_exc()
        return {"error": failure(exc)}


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specforge")
    except PackageNotFoundError:
        return None


def stage(settings: Settings, name: str) -> None:
    """The child process of stage `name` (`capture` or `train`)."""
    result = capture(settings) if name == "specforge-capture" else train(settings)
    write_stage(settings, name, result)
