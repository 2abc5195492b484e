"""The training run with the processes split into target ranks and drafter ranks.

    DFLASH_TARGET_GPUS=1 torchrun --nproc-per-node 3 -m trainer train --config FILE --out DIR

Order of events (`trainer.split.distributed` for roles and failure handling, `trainer.split.exchange` for the
queue and the p2p transfer):
1. demo assets (if any) are built by rank 0, then every rank resolves the config the same way;
2. drafter ranks run the one training loop (`trainer.run.trainer.Trainer`) with the target ranks as
   their feature source (`trainer.split.split_drafter.TargetRanks`): they find the checkpoint to
   resume (each loads it: the run folder is shared); drafter rank 0 publishes the start step
   and data position; target rank 0 turns it into a global batch index (it knows the data);
3. target rank 0 sends the frozen embedding and lm_head (and the target's config) to every
   drafter: drafters never load the target;
4. segment by segment (the steps between two checkpoints, `trainer.split.segments`), target ranks
   produce the segment's `steps × D` batches (`trainer.split.split_target`) and drafters train. DDP
   over the drafter-only group keeps drafters in lock-step: every optimizer step, every drafter
   trains exactly one batch (the segment holds exactly that many), so all drafters enter every
   gradient all-reduce and no zero-weighted filler step or `join` is ever needed; the gradient
   is the mean over the D batches of the step, as in single-process training with a D× larger
   batch. Drafter rank 0 writes the checkpoints, the metrics rows and the log; with
   `eval.every`, target rank 0 runs its τ probes (`trainer.split.probe_link`);
5. a store barrier, then each rank writes `ranks/rank-N.json` (its role and the global batch
   indices it produced or trained) and drafter rank 0 checks produced == trained == expected.

Noise is drawn from (seed, global batch index), so the same batch gets the same noise whichever
drafter trains it, and a 1 + 1 split repeats the colocated run's losses.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from trainer.base.stopping import StopRequest
from trainer.model.target import Target
from trainer.run.trainer import Trainer
from trainer.settings.config import TrainConfig
from trainer.setup.runtime import load_configured_target, resolve_demo
from trainer.split.distributed import PeerFailed, Session, TerminationWatch, Timeouts
from trainer.split.roles import TARGET, Roles
from trainer.split.split_drafter import TargetRanks
from trainer.split.split_target import TargetLoader, serve_features

log = logging.getLogger("trainer")


def default_target_loader(config: TrainConfig, device: torch.device) -> Target:
    return load_configured_target(config, device)


def run_split(
    config: TrainConfig,
    out_dir: str | Path,
    roles: Roles,
    *,
    force_resume: bool = False,
    emit: Callable[[str], None] | None = None,
    target_loader: TargetLoader = default_target_loader,
    session: Session | None = None,
    save_checkpoints: bool = True,
    stop: StopRequest | None = None,
) -> dict:
    """Run this rank's role to the end; returns its summary (also in `ranks/rank-N.json`).
    `save_checkpoints=False` is for benchmarks only (a run that cannot be resumed)."""
    emit = emit or (lambda line: print(line, flush=True))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stop = stop or StopRequest()
    stop.begin()  # the ranks agree on a stop at a step: a signal during start-up waits for it
    watch = TerminationWatch(roles, stop)
    session = session or Session(
        roles, timeouts=Timeouts.of(config.split), device=config.run.device
    )
    watch.session = session
    session.start_watchdog()
    emit(f"{roles.describe()} on {session.device} ({session.backend})")
    try:
        config = _resolve_config(session, config, out_dir)
        if config.run.threads:
            torch.set_num_threads(config.run.threads)
        if roles.role == TARGET:
            summary = serve_features(session, config, out_dir, emit, target_loader, stop)
        else:
            source = TargetRanks(session, config, stop, emit)
            trainer = Trainer(
                config,
                out_dir,
                force_resume=force_resume,
                emit=emit,
                stop=stop,
                source=source,
                save_checkpoints=save_checkpoints,
            )
            trainer.run()
            summary = trainer.summary
    except BaseException as exc:
        culprit = session.explain_failure()
        if culprit:  # a peer died and this rank's communication broke because of it
            session.abort(culprit)
            raise PeerFailed(f"{culprit} ({roles.describe()} saw: {_first_line(exc)})") from exc
        session.abort(f"{type(exc).__name__}: {_first_line(exc)}")
        raise
    session.finish()
    (out_dir / "ranks").mkdir(exist_ok=True)
    (out_dir / "ranks" / f"rank-{roles.rank}.json").write_text(json.dumps(summary))
    return summary


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def _resolve_config(session: Session, config: TrainConfig, out_dir: Path) -> TrainConfig:
    """Rank 0 builds the demo assets; the others reuse them (never two writers)."""
    if not config.demo.enabled:
        return config
    if session.roles.rank == 0:
        config = resolve_demo(config, out_dir)
        session.store.set("demo_ready", "1")
        return config
    session.wait_get("demo_ready", what="rank 0 to build the demo assets")
    return resolve_demo(config, out_dir)
