"""A drafter rank's `FeatureSource` (`trainer.run.features`): the features of a split run come from
the target ranks (`trainer.split.exchange`), one batch per step for each drafter.

The training loop is the colocated one (`trainer.run.trainer.Trainer`); what differs is here:
- start: drafter rank 0 (the lead) publishes the step and data position it resumes from; target
  rank 0 sends the target's config, its feature layers and the frozen embedding/lm_head (the
  drafter is shaped after them: drafters never load the target) and the batch bookkeeping;
- `next`: the step's batch of its segment (`trainer.split.segments`); the next batch of the same
  segment is claimed while this one trains, so its transfer overlaps the step, except after a
  segment's last step, a probe step and once a stop is agreed (then nothing is in flight);
- `summarize`: one all-reduce over the drafters: the means of the loss terms and slot
  accuracies, the summed tokens, and whether any rank was asked to stop; `stop_now` turns that
  into the same step on every drafter (the step after the one just trained when each drafter
  holds a claimed batch: the batches trained stay a prefix of the segment);
- DDP over the drafter-only group keeps the drafters in lock-step (one drafter: no DDP);
- the τ probe runs on target rank 0 (`trainer.split.probe_link`);
- at the end, the batch accounting: produced == trained == expected.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from trainer.base.stopping import StopRequest
from trainer.data.dataset import DataPosition
from trainer.model.drafter import Drafter, shape_from_target
from trainer.model.linear_attention import has_linear_attention
from trainer.run.features import StepSummary
from trainer.run.metrics import RankStats, RoleMetrics
from trainer.run.pipeline import DrafterWorker, StepResult
from trainer.run.probe import ProbeReport
from trainer.run.target_worker import Features
from trainer.settings.config import TrainConfig
from trainer.split.distributed import PeerFailed, Session
from trainer.split.exchange import STARTING, Claim, DrafterEndpoint, share_frozen
from trainer.split.probe_link import ProbeClient
from trainer.split.roles import DRAFTER
from trainer.split.segments import Segment, StopWatch, position_of, segments


class TargetRanks:
    """The drafter side of a split run, as the training loop sees it."""

    collective = True

    def __init__(
        self, session: Session, config: TrainConfig, stop: StopRequest, emit: Callable[[str], None]
    ) -> None:
        self.session = session
        self.config = config
        self.device = session.device
        roles = session.roles
        self.lead = roles.rank == roles.drafter_ranks[0]
        self.emit = emit
        self.drafters = roles.num_drafters
        self.stopping = StopWatch(session, stop)
        self.endpoint = DrafterEndpoint(session, device=self.device)
        self.stats = RankStats(session)
        self.role_metrics = RoleMetrics(session) if self.lead else None
        self.probe_client = ProbeClient(session) if self.lead and config.eval.every else None
        self.trained: list[int] = []
        self.pending: Claim | None = None
        self.segs: list[Segment] = []
        self.meta: dict[str, Any] = {}
        self.first = self.per_epoch = self.samples = 0
        self.start_step = 0

    # ---- start ----------------------------------------------------------------------------

    def start(self, step: int, position: DataPosition) -> None:
        store = self.session.store
        if self.lead:
            store.set("start", json.dumps({"step": step, "position": vars(position)}))
        self.start_step = step
        self.segs = segments(step, self.config.run.steps, self.config.run.checkpoint_every)
        self.meta = json.loads(
            self.session.wait_get("target_meta", what="target rank 0 to load the target")
        )

    def drafter_worker(self, config: TrainConfig) -> DrafterWorker:
        frozen = share_frozen(self.session, None, device=self.device)
        # the drafter reads plain attributes of the target's config: no `transformers` import
        target_config = SimpleNamespace(**self.meta["config"])
        shape = shape_from_target(
            target_config, config.model, num_features=len(self.meta["layers"])
        )
        starting = {
            k.removeprefix(STARTING): t for k, t in frozen.items() if k.startswith(STARTING)
        }
        return DrafterWorker.for_config(
            shape,
            config,
            self.device,
            embed_weight=frozen["embed"],
            lm_head_weight=frozen["lm_head"],
            starting_weights=starting or None,
        )

    def target_layers(self) -> list[int]:
        return list(self.meta["layers"])

    def target_compiled(self) -> bool:
        linear = has_linear_attention(self.meta["config"])
        return self.config.run.compiles_target_on(self.device, linear_attention=linear)

    def prepare(self, worker: DrafterWorker) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        if self.drafters > 1:  # one drafter has nothing to average: DDP would only copy grads
            worker.module = DDP(
                worker.drafter,
                process_group=self.session.drafter_group,
                device_ids=[self.device] if self.device.type == "cuda" else None,
            )
        data = json.loads(self.session.wait_get("data", what="target rank 0"))
        self.first, self.per_epoch, self.samples = data["first"], data["per_epoch"], data["samples"]

    # ---- every step -----------------------------------------------------------------------

    def _segment(self, step: int) -> Segment:
        while self.segs[0].end <= step:
            self.segs.pop(0)
        return self.segs[0]

    def _ends_transfers(self, step: int, seg: Segment) -> bool:
        """Whether nothing is claimed ahead after training step `step + 1`."""
        every = self.config.eval.every
        done = step + 1
        return done == seg.end or self.stopping.at is not None or bool(every and done % every == 0)

    def next(self, step: int) -> tuple[Features, int]:
        seg = self._segment(step)
        claim = self.pending or self.endpoint.claim(seg.key)
        features, header, waited = self.endpoint.complete(claim)
        self.pending = None
        if not self._ends_transfers(step, seg):  # claim the next batch now: it overlaps the step
            self.pending = self.endpoint.claim(seg.key)
            self.endpoint.try_start(self.pending)
        self.stats.wait_s += waited
        self.trained.append(header.index)
        return features, header.index

    def prefetch(self) -> None:
        pass  # `next` already claimed the next batch, so its transfer overlaps the step

    def summarize(self, result: StepResult, *, asked: bool) -> StepSummary:
        """After the step: it counts as trained (the batch accounting), then the all-reduce."""
        self.session.store.add("trained", 1)
        self.stats.batches += 1
        self.stats.tokens += result.tokens
        self.stats.publish()
        return reduce_step(self.session, result, stop=self.stopping.requested() or asked)

    def stop_now(self, step: int, summary: StepSummary) -> bool:
        if self.stopping.at is None and summary.stop:
            # each drafter holds a claimed batch unless nothing was claimed ahead: the next step
            # trains those, so the batches trained are a prefix of the segment
            self.stopping.decide(step if self.pending is None else step + 1)
        return self.stopping.at is not None and step >= self.stopping.at

    def _next_batch(self, step: int) -> int:
        return self.first + (step - self.start_step) * self.drafters

    def position(self, step: int) -> DataPosition:
        return position_of(
            self._next_batch(step),
            per_epoch=self.per_epoch,
            batch_size=self.config.data.batch_size,
        )

    def epochs(self, step: int) -> float:
        pos = self.position(step)
        return pos.epoch + pos.index / self.samples

    def probe(self, drafter: Drafter, step: int) -> ProbeReport | None:
        return None if self.probe_client is None else self.probe_client(drafter, step=step)

    def extra(self) -> tuple[dict[str, Any], str]:
        return self.role_metrics.fields() if self.role_metrics else ({}, "")

    def stopped(self, step: int) -> None:
        self.session.store.add("stop_settled", 1)

    # ---- end ------------------------------------------------------------------------------

    def finish(self, step: int, drafter: Drafter) -> dict[str, Any]:
        self.stats.publish(force=True)
        if self.probe_client is not None:
            self.probe_client.end()
        if self.lead:
            expected = (step - self.start_step) * self.drafters
            check_counts(self.session, expected=expected, emit=self.emit, stopped=self.stopping.at)
        return {
            "rank": self.session.roles.rank,
            "role": DRAFTER,
            "batches": len(self.trained),
            "indices": self.trained,
            "params_sha256": params_digest(drafter),
        }


def params_digest(module: torch.nn.Module) -> str:
    """A digest of all parameters: equal on every drafter rank when DDP kept them in sync."""
    h = hashlib.sha256()
    for name, p in module.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def reduce_step(session: Session, result: StepResult, *, stop: bool = False) -> StepSummary:
    """Mean of the step's loss terms and slot accuracies over the drafters; summed tokens;
    `stop`: whether any drafter saw a stop request (so all of them stop at the same step)."""
    acc = torch.tensor(result.slot_accuracy, dtype=torch.float64)
    have = (~acc.isnan()).double()
    r = result
    scalars = [r.loss, r.ce, r.kl, r.cap, r.grad_norm, r.tokens, 1.0, 1.0 if stop else 0.0]
    vals = torch.cat([torch.tensor(scalars, dtype=torch.float64), acc.nan_to_num(0.0), have])
    vals = vals.to(session.device)
    dist.all_reduce(vals, group=session.drafter_group)
    v = vals.cpu().tolist()
    n, k = v[6], len(result.slot_accuracy)
    sums, counts = v[8 : 8 + k], v[8 + k : 8 + 2 * k]
    return StepSummary(
        loss=v[0] / n,
        ce=v[1] / n,
        kl=v[2] / n,
        cap=v[3] / n,
        grad_norm=v[4] / n,
        tokens=int(v[5]),
        lr=result.lr,
        slot_accuracy=[s / c if c else None for s, c in zip(sums, counts, strict=True)],
        stop=v[7] > 0,
    )


def check_counts(
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
