"""The training run with the processes split into target ranks and drafter ranks.

    DFLASH_TARGET_GPUS=1 torchrun --nproc-per-node 3 -m trainer.train --config FILE --out DIR

Order of events (`trainer.distributed` for roles and failure handling, `trainer.exchange` for the
queue and the p2p transfer):
1. demo assets (if any) are built by rank 0, then every rank resolves the config the same way;
2. drafters find the checkpoint to resume (each loads it: the run folder is shared); drafter
   rank 0 publishes the start step and data position; target rank 0 turns it into a global batch
   index (it knows the data) and publishes it with the batches per epoch;
3. target rank 0 sends the frozen embedding and lm_head (and the target's config) to every
   drafter: drafters never load the target;
4. segment by segment (the steps between two checkpoints), targets produce the segment's
   `steps × D` batches and drafters train. DDP over the drafter-only group keeps drafters in
   lock-step: every optimizer step, every drafter trains exactly one batch (the segment holds
   exactly that many), so all drafters enter every gradient all-reduce and no zero-weighted
   filler step or `join` is ever needed; the gradient is the mean over the D batches of the
   step, as in single-process training with a D× larger batch. Drafter rank 0 writes the
   checkpoint at each segment's end, when every batch of the segment has been trained;
5. a store barrier, then each rank writes `ranks/rank-N.json` (its role and the global batch
   indices it produced or trained) and drafter rank 0 checks produced == trained == expected.

Noise is drawn from (seed, global batch index), so the same batch gets the same noise whichever
drafter trains it, and a 1 + 1 split repeats the colocated run's losses.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from trainer import checkpoint as ckpt
from trainer.config import TrainConfig
from trainer.data import BatchStream, DataPosition, load_data, repeat_note
from trainer.distributed import (
    DRAFTER,
    TARGET,
    PeerFailed,
    Roles,
    Session,
    TerminationWatch,
    Timeouts,
)
from trainer.evaluate import split_holdout
from trainer.exchange import DrafterEndpoint, TargetEndpoint, share_frozen
from trainer.metrics import RankStats, RoleMetrics
from trainer.model import shape_from_target
from trainer.pipeline import COMPILE_NOTE, DrafterWorker, TargetWorker
from trainer.stopping import StopRequest, write_record
from trainer.target import Target, load_target
from trainer.trainer import (
    apply_schedule,
    find_checkpoint,
    resolve_demo,
    resolved_values,
    trim_metrics,
)

log = logging.getLogger("trainer")
TargetLoader = Callable[[TrainConfig, torch.device], Target]


def default_target_loader(config: TrainConfig, device: torch.device) -> Target:
    m = config.model
    return load_target(
        m.target, device=device, layers=m.target_layers, num_layers=m.num_target_layers
    )


@dataclass(frozen=True)
class Segment:
    """Steps [start, end) between two checkpoints; its batches are offsets 0 … steps·D−1."""

    start: int
    end: int

    @property
    def key(self) -> int:
        return self.end

    @property
    def steps(self) -> int:
        return self.end - self.start


class StopWatch:
    """A rank's view of a graceful stop. Any rank whose own `StopRequest` fired says so in the
    store (`stop_requested`); the drafters agree on it in their per-step all-reduce and publish
    the step they stop after (`stop_at`); targets then produce only the batches up to it."""

    def __init__(self, session: Session, stop: StopRequest) -> None:
        self.session = session
        self.stop = stop
        self.at: int | None = None
        self._told = False

    def requested(self) -> bool:
        """This rank's signal, or any other rank's (drafters ask once per step)."""
        store = self.session.store
        if self.stop.requested and not self._told:
            store.set("stop_requested", self.stop.signal_name or "stop")
            self._told = True
        return self._told or store.check(["stop_requested"])

    def decide(self, step: int) -> None:
        """Drafters: the agreed last step."""
        self.at = step
        self.session.store.set("stop_at", str(step))

    def __call__(self) -> bool:
        """Whether the drafters have agreed on a stop (targets poll this)."""
        self.requested()
        store = self.session.store
        if self.at is None and store.check(["stop_at"]):
            self.at = int(store.get("stop_at"))
        return self.at is not None

    def bound(self, seg: Segment, drafters: int) -> int:
        """How many batches of `seg` are trained before the stop (all without one)."""
        if not self() or self.at is None:
            return seg.steps * drafters
        return max(0, min(seg.steps, self.at - seg.start)) * drafters

    def past(self, seg: Segment) -> bool:
        return self() and self.at is not None and self.at <= seg.end


def segments(start: int, total: int, checkpoint_every: int) -> list[Segment]:
    out, step = [], start
    while step < total:
        end = total
        if checkpoint_every:
            end = min(total, (step // checkpoint_every + 1) * checkpoint_every)
        out.append(Segment(step, end))
        step = end
    return out


def batch_index(position: DataPosition, *, per_epoch: int, batch_size: int) -> int:
    """Global index of the batch a stream at `position` draws next."""
    return position.epoch * per_epoch + position.index // batch_size


def position_of(index: int, *, per_epoch: int, batch_size: int) -> DataPosition:
    """Inverse of `batch_index`: where batch `index` starts (epochs drop the ragged tail)."""
    return DataPosition(index // per_epoch, (index % per_epoch) * batch_size)


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
            summary = _run_target(session, config, out_dir, emit, target_loader, stop)
        else:
            summary = _run_drafter(
                session,
                config,
                out_dir,
                emit,
                force_resume,
                stop,
                save_checkpoints=save_checkpoints,
            )
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


# ---- target ranks ----------------------------------------------------------------------------


def _run_target(
    session: Session,
    config: TrainConfig,
    out_dir: Path,
    emit: Callable[[str], None],
    loader: TargetLoader,
    stop: StopRequest,
) -> dict:
    roles, store = session.roles, session.store
    torch.manual_seed(config.run.seed)
    target = loader(config, session.device)
    samples, _ = split_holdout(load_data(config, out_dir, emit=emit), config.data.holdout)
    stream = BatchStream(
        samples,
        config.data,
        block_size=config.model.block_size,
        seed=config.run.seed,
    )
    per_epoch = len(stream.samples) // config.data.batch_size
    if roles.rank == 0:
        meta = {"config": target.config.to_dict(), "layers": target.layers}
        store.set("target_meta", json.dumps(meta))
        share_frozen(
            session,
            {"embed": target.embed_weight, "lm_head": target.lm_head_weight},
            device=session.device,
        )
        start = json.loads(session.wait_get("start", what="drafter rank 0 to resume or start"))
        first = batch_index(
            DataPosition(**start["position"]),
            per_epoch=per_epoch,
            batch_size=config.data.batch_size,
        )
        store.set("data", json.dumps({"first": first, "per_epoch": per_epoch}))
    start = json.loads(session.wait_get("start", what="drafter rank 0 to resume or start"))
    first = json.loads(session.wait_get("data", what="target rank 0"))["first"]
    worker = TargetWorker(target)
    endpoint = TargetEndpoint(
        session, max_in_flight=config.split.max_in_flight, has_last=config.loss.kl_weight > 0
    )
    stats = RankStats(session)
    produced: list[int] = []
    d = roles.num_drafters
    stopping = StopWatch(session, stop)
    for seg in segments(start["step"], config.run.steps, config.run.checkpoint_every):
        seg_first = first + (seg.start - start["step"]) * d
        while True:
            stats.wait_s += endpoint.wait_capacity(stopping)
            k = endpoint.next_index(seg.key, seg.steps * d)
            if k is None or k >= stopping.bound(seg, d):
                break
            index = seg_first + k
            stream.position = position_of(
                index, per_epoch=per_epoch, batch_size=config.data.batch_size
            )
            features = worker.produce(stream.next_batch())
            if index and index % per_epoch == 0:  # one target rank draws each epoch's first batch
                emit(repeat_note(index // per_epoch, len(stream.samples)))
            store.add("produced", 1)  # counted before any drafter can see (and train) it
            endpoint.publish(seg.key, index, features, slot=k)
            produced.append(index)
            stats.batches += 1
            stats.tokens += features.num_tokens
            stats.in_flight = endpoint.in_flight
            stats.publish()
        endpoint.end_segment(seg.key)
        if stopping.past(seg):
            break
    stats.wait_s += endpoint.drain(stopping)
    if stopping():
        dropped = endpoint.settle(lambda: store.add("stop_settled", 0) >= d)
        emit(f"{roles.describe()} stopping: {dropped} produced batch(es) beyond the stop dropped")
    stats.in_flight = 0
    stats.publish(force=True)
    emit(f"{roles.describe()} done: produced {len(produced)} batches")
    return {"rank": roles.rank, "role": TARGET, "batches": len(produced), "indices": produced}


# ---- drafter ranks ---------------------------------------------------------------------------


def _run_drafter(
    session: Session,
    config: TrainConfig,
    out_dir: Path,
    emit: Callable[[str], None],
    force_resume: bool,
    stop: StopRequest,
    *,
    save_checkpoints: bool,
) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    roles, store, device = session.roles, session.store, session.device
    lead = roles.rank == roles.num_targets  # drafter rank 0: logs, checkpoints
    say = emit if lead else (lambda _: None)
    found, changes = _find_checkpoint(config, out_dir, say, force_resume)
    state = ckpt.load_state(found.path, map_location=device) if found.path else None
    step = int(state["step"]) if state else 0
    position = DataPosition(**state["data_position"]) if state else DataPosition()
    if lead:
        store.set("start", json.dumps({"step": step, "position": vars(position)}))
    meta = json.loads(session.wait_get("target_meta", what="target rank 0 to load the target"))
    # the drafter reads plain attributes of the target's config: no `transformers` import here
    target_config = SimpleNamespace(**meta["config"])
    frozen = share_frozen(session, None, device=device)
    torch.manual_seed(config.run.seed)
    shape = shape_from_target(target_config, config.model, num_features=len(meta["layers"]))
    worker = DrafterWorker.for_config(
        shape, config, device, embed_weight=frozen["embed"], lm_head_weight=frozen["lm_head"]
    )
    drafter = worker.drafter
    if lead and worker.compiled:
        emit(COMPILE_NOTE)
    if state:
        worker.load_state_dict(state["worker"])
        torch.set_rng_state(state["rng"]["cpu"].cpu())
        if lead and found.path is not None:  # a state was loaded from it
            emit(f"resumed from {found.path.name} (step {step})")
        if changes:
            apply_schedule(worker, config, step, changes, say)
    resolved = resolved_values(config, target_layers=meta["layers"], worker=worker, device=device)
    if roles.num_drafters > 1:  # one drafter has nothing to average: DDP would only copy grads
        worker.module = DDP(
            drafter,
            process_group=session.drafter_group,
            device_ids=[device] if device.type == "cuda" else None,
        )
    data = json.loads(session.wait_get("data", what="target rank 0"))
    first, per_epoch = data["first"], data["per_epoch"]
    endpoint = DrafterEndpoint(session, device=device)
    stats = RankStats(session)
    metrics = RoleMetrics(session, out_dir, config, emit) if lead else None
    if metrics and state:
        trim_metrics(out_dir, step, emit)
    trained: list[int] = []
    d, start_step = roles.num_drafters, step
    stopping = StopWatch(session, stop)
    for seg in segments(step, config.run.steps, config.run.checkpoint_every):
        claim = endpoint.claim(seg.key)
        for i in range(seg.steps):
            features, header, waited = endpoint.complete(claim)
            last = stopping.at is not None or i + 1 == seg.steps
            if not last:  # claim the next batch now: its transfer overlaps this step
                claim = endpoint.claim(seg.key)
                endpoint.try_start(claim)
            result = worker.train_step(features, header.index)
            step += 1
            trained.append(header.index)
            store.add("trained", 1)
            stats.wait_s += waited
            stats.batches += 1
            stats.tokens += header.num_tokens
            stats.publish()
            summary = _reduce(session, result, waited, device, stop=stopping.requested())
            if metrics:
                metrics.count(summary["tokens"])
            if metrics and (step % config.run.log_every == 0 or step == config.run.steps):
                metrics.log(step, summary)
            if stopping.at is None and summary["stop"]:
                # every drafter holds one claimed batch (unless the segment ends here): the
                # next step trains them, so the batches trained are a prefix of the segment
                stopping.decide(step if last else step + 1)
            if stopping.at is not None and step >= stopping.at:
                break
        saved = None
        if (
            save_checkpoints
            and lead
            and (
                (config.run.checkpoint_every and step % config.run.checkpoint_every == 0)
                or step == config.run.steps
                or stopping.at is not None
            )
        ):
            began = time.perf_counter()
            next_batch = first + (step - start_step) * d
            saved = _save(worker, config, out_dir, step, next_batch, per_epoch, resolved)
            emit(f"checkpoint {saved.name}")
            if metrics:
                metrics.exclude(time.perf_counter() - began)
        if stopping.at is not None:
            store.add("stop_settled", 1)
            if lead:
                line = f"stopped at step {step}, checkpoint saved to {saved}"
                emit(line if saved else f"stopped at step {step} (checkpoints are off)")
                write_record(line)
            break
    stats.publish(force=True)
    if lead:
        _check_counts(session, expected=(step - start_step) * d, emit=emit, stopped=stopping.at)
    return {
        "rank": roles.rank,
        "role": DRAFTER,
        "batches": len(trained),
        "indices": trained,
        "params_sha256": params_digest(drafter),
    }


def _save(
    worker: DrafterWorker,
    config: TrainConfig,
    out_dir: Path,
    step: int,
    next_batch: int,
    per_epoch: int,
    resolved: dict,
) -> Path:
    """Drafter rank 0: the checkpoint of `step`; `next_batch` is the global index trained next."""
    pos = position_of(next_batch, per_epoch=per_epoch, batch_size=config.data.batch_size)
    return ckpt.save_checkpoint(
        out_dir,
        step,
        {
            "step": step,
            "worker": worker.state_dict(),
            "rng": {"cpu": torch.get_rng_state()},
            "data_position": {"epoch": pos.epoch, "index": pos.index},
        },
        config,
        keep_last=config.run.keep_last,
        resolved=resolved,
    )


def params_digest(module: torch.nn.Module) -> str:
    """A digest of all parameters: equal on every drafter rank when DDP kept them in sync."""
    h = hashlib.sha256()
    for name, p in module.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def _find_checkpoint(
    config: TrainConfig, out_dir: Path, emit: Callable[[str], None], force: bool
) -> tuple[ckpt.Found, list[str]]:
    """`trainer.find_checkpoint`; a finished run is said and trains no step (every rank then
    ends normally: the segments are empty)."""
    try:
        return find_checkpoint(config, out_dir, emit, force)
    except ckpt.RunFinished as exc:
        emit(str(exc))
        return ckpt.find_resumable(out_dir), []


def _reduce(
    session: Session, result, waited: float, device: torch.device, *, stop: bool = False
) -> dict:
    """Mean of the step's loss terms and slot accuracies over the drafters; summed tokens;
    `stop`: whether any drafter saw a stop request (so all of them stop at the same step)."""
    import torch.distributed as dist

    acc = torch.tensor(result.slot_accuracy, dtype=torch.float64)
    have = (~acc.isnan()).double()
    vals = torch.cat(
        [
            torch.tensor(
                [
                    result.loss,
                    result.ce,
                    result.kl,
                    result.cap,
                    result.grad_norm,
                    result.tokens,
                    waited,
                    1.0,
                ],
                dtype=torch.float64,
            ),
            acc.nan_to_num(0.0),
            have,
            torch.tensor([1.0 if stop else 0.0], dtype=torch.float64),
        ]
    ).to(device)
    dist.all_reduce(vals, group=session.drafter_group)
    v = vals.cpu().tolist()
    n, k = v[7], len(result.slot_accuracy)
    sums, counts = v[8 : 8 + k], v[8 + k : 8 + 2 * k]
    return {
        "loss": v[0] / n,
        "ce": v[1] / n,
        "kl": v[2] / n,
        "cap": v[3] / n,
        "grad_norm": v[4] / n,
        "tokens": int(v[5]),
        "lr": result.lr,
        "slot_accuracy": [s / c if c else None for s, c in zip(sums, counts, strict=True)],
        "stop": v[-1] > 0,
    }


def _check_counts(
    session: Session, *, expected: int, emit: Callable[[str], None], stopped: int | None = None
) -> None:
    """Every batch produced was trained exactly once (counts; `ranks/` has the indices). After a
    stop, targets may have produced batches beyond it (dropped, produced again on resume)."""
    store = session.store
    session.wait_for(
        lambda: store.add("trained", 0) >= expected, what="the other drafters to finish"
    )
    produced, trained = store.add("produced", 0), store.add("trained", 0)
    emit(f"batches: produced {produced}, trained {trained}, expected {expected}")
    if stopped is not None and trained == expected <= produced:
        return
    if not produced == trained == expected:
        raise PeerFailed(
            f"batch accounting failed: produced {produced}, trained {trained}, expected {expected}"
        )
