"""A target rank of a split run: it serves features, and nothing else trains here.

Target rank 0 publishes the target's config and feature layers, sends the frozen embedding and
lm_head to every drafter (`trainer.split.exchange.share_frozen`), turns the lead drafter's resume
position into a global batch index and publishes the data bookkeeping. Then every target rank,
segment by segment (`trainer.split.segments`), takes the next batch index of the segment, builds that
batch from the training samples (`data.holdout` kept out, as in the colocated run), runs the
frozen target and publishes the features, within `split.max_in_flight` undelivered batches.
With `eval.every`, target rank 0 also runs the drafters' τ probes (`trainer.split.probe_link`),
between batches and while it waits.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from trainer.base.stopping import StopRequest
from trainer.data.dataset import (
    BatchStream,
    DataPosition,
    Sample,
    repeat_note,
    split_holdout,
)
from trainer.model.drafter import Drafter, shape_from_target
from trainer.model.linear_attention import describe as describe_linear_attention
from trainer.model.target import Target
from trainer.run.features import run_samples, run_tau_probe
from trainer.run.metrics import RankStats
from trainer.run.target_worker import TargetWorker
from trainer.settings.config import TrainConfig
from trainer.split.distributed import Session
from trainer.split.exchange import STARTING, TargetEndpoint, share_frozen
from trainer.split.probe_link import ProbeServer
from trainer.split.roles import TARGET
from trainer.split.segments import StopWatch, batch_index, position_of, segments

TargetLoader = Callable[[TrainConfig, torch.device], Target]


def serve_features(
    session: Session,
    config: TrainConfig,
    out_dir: Path,
    emit: Callable[[str], None],
    loader: TargetLoader,
    stop: StopRequest,
) -> dict:
    """Run this target rank to the end of the run; returns its summary."""
    roles, store = session.roles, session.store
    torch.manual_seed(config.run.seed)
    target = loader(config, session.device)
    line = describe_linear_attention(target.config, device_type=session.device.type)
    if roles.rank == 0 and line:
        emit(f"{roles.describe()} {line}")
    samples, held_out = split_holdout(run_samples(config, out_dir, emit), config.data.holdout)
    stream = BatchStream(
        samples, config.data, block_size=config.model.block_size, seed=config.run.seed
    )
    bsz = config.data.batch_size
    per_epoch = len(stream.samples) // bsz
    if roles.rank == 0:
        _start_drafters(session, config, target, per_epoch, len(stream.samples))
    server = _probe_server(session, config, target, held_out, samples)
    start = json.loads(session.wait_get("start", what="drafter rank 0 to resume or start"))
    first = json.loads(session.wait_get("data", what="target rank 0"))["first"]
    worker = TargetWorker.for_run(target, config)
    endpoint = TargetEndpoint(
        session, max_in_flight=config.split.max_in_flight, has_last=config.loss.kl_weight > 0
    )
    stats = RankStats(session)
    produced: list[int] = []
    d = roles.num_drafters
    stopping = StopWatch(session, stop)

    def idle() -> bool:
        """Polled while waiting: serve a probe, say whether the drafters agreed on a stop."""
        if server is not None:
            server.serve()
        return stopping()

    for seg in segments(start["step"], config.run.steps, config.run.checkpoint_every):
        seg_first = first + (seg.start - start["step"]) * d
        while True:
            stats.wait_s += endpoint.wait_capacity(idle)
            k = endpoint.next_index(seg.key, seg.steps * d)
            if k is None or k >= stopping.bound(seg, d):
                break
            index = seg_first + k
            stream.position = position_of(index, per_epoch=per_epoch, batch_size=bsz)
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
    stats.wait_s += endpoint.drain(idle)
    if stopping():

        def settled() -> bool:
            idle()
            return store.add("stop_settled", 0) >= d

        dropped = endpoint.settle(settled)
        emit(f"{roles.describe()} stopping: {dropped} produced batch(es) beyond the stop dropped")
    if server is not None:
        server.serve_until_end()
    stats.in_flight = 0
    stats.publish(force=True)
    emit(f"{roles.describe()} done: produced {len(produced)} batches")
    return {"rank": roles.rank, "role": TARGET, "batches": len(produced), "indices": produced}


def _start_drafters(
    session: Session, config: TrainConfig, target: Target, per_epoch: int, samples: int
) -> None:
    """Target rank 0: what the drafters need before training (see the module docstring); with
    `model.init_layers`, the target layers that start the drafter too (`start.…`)."""
    store = session.store
    batch_size = config.data.batch_size
    meta = {"config": target.config.to_dict(), "layers": target.layers}
    store.set("target_meta", json.dumps(meta))
    frozen = {"embed": target.embed_weight, "lm_head": target.lm_head_weight}
    if config.model.init_layers:
        weights = target.starting_weights(config.model.init_layers)
        frozen.update({f"{STARTING}{name}": t for name, t in weights.items()})
    share_frozen(session, frozen, device=session.device)
    start = json.loads(session.wait_get("start", what="drafter rank 0 to resume or start"))
    first = batch_index(
        DataPosition(**start["position"]), per_epoch=per_epoch, batch_size=batch_size
    )
    data = {"first": first, "per_epoch": per_epoch, "samples": samples}
    store.set("data", json.dumps(data))


def _probe_server(
    session: Session,
    config: TrainConfig,
    target: Target,
    held_out: Sequence[Sample],
    samples: Sequence[Sample],
) -> ProbeServer | None:
    """Target rank 0 with `eval.every`: the probe and a drafter replica to load weights into."""
    if session.roles.rank != 0:
        return None
    probe = run_tau_probe(config, target, held_out, samples)
    if probe is None:
        return None
    shape = shape_from_target(target.config, config.model, num_features=len(target.layers))
    replica = Drafter(shape, attention_kernels=config.run.attention_kernels).to(target.device)
    return ProbeServer(session, probe, replica)
