"""How features travel from target ranks to drafter ranks: a queue in the store, tensors p2p.

Control plane (torchrun's TCPStore, atomic `add` counters; keys under a per-run prefix): the run
is cut into *segments* (the steps between two checkpoints). For segment k:
1. a target takes the next global batch index of the segment (`s{k}/next`, atomic), only while
   it has fewer than `max_in_flight` batches produced but not yet delivered (backpressure),
   builds that batch from the data and runs the frozen target;
2. it puts an entry into the segment's global queue at the slot of its offset within the
   segment (`set(s{k}/q/{offset}, header)`, then `add(s{k}/tail)`): slot j always holds the
   segment's j-th batch, so the batches trained after any number of steps, once the claims
   handed out are trained, are a prefix of the segment (what a stop between checkpoints
   saves; see `trainer.split.session`). The header is the small fixed set of shape/meta fields (owning
   target rank, per-target sequence number, global batch index, shapes, dtype, real tokens) as
   JSON: the store already carries it, so no header tensor and no CPU sync is needed before the
   payload;
3. a drafter claims the next slot of the queue (`add(s{k}/head)`): whichever target filled it,
   so any drafter takes the next ready batch from any target (dynamic balancing, no i % D);
   it tells the owner `set(claim/{t}/{seq}, drafter rank)` and posts `irecv`s for the payload;
4. the owner sees the claim and `isend`s the payload to that drafter: the selected hidden states
   (Bsz, S, n·H), the last hidden state (Bsz, S, H) when the KL term is on, and one int64 tensor
   packing input_ids, anchors, valid and labels. Never logits. A drafter claims its next slot
   while it trains on the current batch (at most two claims); it posts the receives of a claim
   before making the next claim, slots of one target carry increasing sequence numbers and the
   target sends claimed batches in sequence order, so the p2p ops of a (target, drafter) pair
   are matched in order.
Each segment holds exactly `steps × D` batches and each drafter trains exactly one batch per step,
so every slot is filled and claimed exactly once: no batch is lost or trained twice, and at a
segment's end (a checkpoint) the trained batches are exactly the segment's global indices, which
makes resume exact. A target that finds no index left marks `s{k}/done`; a drafter waiting on a
slot that no target can fill any more (all done, slot ≥ tail) raises instead of waiting forever.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from trainer.run.target_worker import Features
from trainer.split.distributed import PeerFailed, Session

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class Header:
    """What a drafter needs to allocate and interpret the payload of one batch."""

    target: int  # owning target rank
    seq: int  # the owner's sequence number (names the claim key)
    index: int  # global batch index (what "exactly once" is counted on)
    bsz: int
    seq_len: int  # S
    feat_dim: int  # n·H
    hidden: int  # H
    anchors: int  # N
    block: int  # B
    dtype: str
    has_last: bool
    num_tokens: int

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: str | bytes) -> Header:
        return cls(**json.loads(raw))

    @property
    def ints_numel(self) -> int:
        b, s, n = self.bsz, self.seq_len, self.anchors
        return b * s + 2 * b * n + b * n * self.block


def header_for(f: Features, *, target: int, seq: int, index: int, has_last: bool) -> Header:
    bsz, seq_len, feat = f.hidden.shape
    return Header(
        target=target,
        seq=seq,
        index=index,
        bsz=bsz,
        seq_len=seq_len,
        feat_dim=feat,
        hidden=f.last_hidden.shape[-1],
        anchors=f.anchors.shape[1],
        block=f.labels.shape[-1],
        dtype=str(f.hidden.dtype).removeprefix("torch."),
        has_last=has_last,
        num_tokens=f.num_tokens,
    )


def pack_ints(f: Features) -> Tensor:
    """input_ids (Bsz,S), anchors (Bsz,N), valid (Bsz,N), labels (Bsz,N,B) → one int64 vector."""
    parts = [f.input_ids, f.anchors, f.valid.long(), f.labels]
    return torch.cat([p.reshape(-1).long() for p in parts])


def unpack(h: Header, hidden: Tensor, last: Tensor | None, ints: Tensor) -> Features:
    b, s, n, k = h.bsz, h.seq_len, h.anchors, h.block
    ids, anchors, valid, labels = ints.split([b * s, b * n, b * n, b * n * k])
    if last is None:  # the KL term is off: nothing travelled; the loss never reads it
        last = hidden.new_zeros(b, s, 0)
    return Features(
        hidden=hidden,
        last_hidden=last,
        input_ids=ids.view(b, s),
        anchors=anchors.view(b, n),
        valid=valid.view(b, n).bool(),
        labels=labels.view(b, n, k),
        num_tokens=h.num_tokens,
    )


def payload(f: Features, *, has_last: bool) -> list[Tensor]:
    tensors = [f.hidden.contiguous()]
    if has_last:
        tensors.append(f.last_hidden.contiguous())
    tensors.append(pack_ints(f))
    return tensors


@dataclass
class _Outgoing:
    header: Header
    tensors: list[Tensor]
    works: list[dist.Work] | None = None  # None until claimed
    drafter: int = -1
    ready: torch.cuda.Event | None = None  # CUDA: recorded after the forward that made it


class TargetEndpoint:
    """The target side: publish produced batches, send them to whoever claims them."""

    def __init__(self, session: Session, *, max_in_flight: int = 2, has_last: bool) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be ≥ 1")
        self.s = session
        self.max_in_flight = max_in_flight
        self.has_last = has_last
        self.rank = session.roles.rank
        self.seq = 0
        self.outgoing: list[_Outgoing] = []
        self.sent_batches = 0
        # sends are issued from a side stream that waits only for their batch's forward: issued
        # from the compute stream they would also wait for the next forward queued behind it
        cuda = session.device.type == "cuda"
        self.side = torch.cuda.Stream(session.device) if cuda else None

    @property
    def in_flight(self) -> int:
        """Produced here and not yet delivered (published, claimed or on the wire)."""
        return len(self.outgoing)

    def next_index(self, segment: int, size: int) -> int | None:
        """The next global batch of `segment` (offset within it) for this target, or None."""
        k = self.s.store.add(f"s{segment}/next", 1) - 1
        return k if k < size else None

    def publish(self, segment: int, index: int, features: Features, *, slot: int) -> None:
        h = header_for(
            features, target=self.rank, seq=self.seq, index=index, has_last=self.has_last
        )
        self.seq += 1
        out = _Outgoing(h, payload(features, has_last=self.has_last))
        if self.side is not None:
            out.ready = torch.cuda.Event()
            out.ready.record()
        self.outgoing.append(out)
        self.s.store.set(f"s{segment}/q/{slot}", h.encode())
        self.s.store.add(f"s{segment}/tail", 1)

    def service(self) -> None:
        """Send claimed batches, forget delivered ones (never blocks)."""
        for out in self.outgoing:
            if out.works is not None:
                continue
            key = f"claim/{self.rank}/{out.header.seq}"
            if not self.s.store.check([key]):
                continue
            out.drafter = int(self.s.store.get(key))
            if self.side is not None:
                assert (
                    out.ready is not None
                )  # recorded with every batch while there is a side stream
                with torch.cuda.stream(self.side):
                    self.side.wait_event(out.ready)
                    out.works = [_p2p(dist.isend(t, dst=out.drafter)) for t in out.tensors]
            else:
                out.works = [_p2p(dist.isend(t, dst=out.drafter)) for t in out.tensors]
            if self.s.backend != "nccl":  # gloo completes only in wait(); the drafter is receiving
                for w in out.works:
                    self.s.wait_work(
                        w, what=f"rank {out.drafter} to receive batch {out.header.index}"
                    )
        done = [
            o
            for o in self.outgoing
            if o.works is not None
            and (self.s.backend != "nccl" or all(w.is_completed() for w in o.works))
        ]
        for o in done:
            self.outgoing.remove(o)
            self.sent_batches += 1

    def wait_capacity(self, stopping: Callable[[], bool] = lambda: False) -> float:
        """Block (servicing claims) while `max_in_flight` batches are undelivered: seconds waited
        — time this target spent waiting on the drafters. Returns early once `stopping()`: the
        drafters claim nothing beyond the stop, so that capacity may never come back."""
        if self.in_flight < self.max_in_flight:
            self.service()
        if self.in_flight < self.max_in_flight:
            return 0.0

        def ready() -> bool:
            self.service()
            return self.in_flight < self.max_in_flight or stopping()

        return self.s.wait_for(
            ready, what="a drafter to take a batch (backpressure)", max_poll_s=0.002
        )

    def end_segment(self, segment: int) -> None:
        self.s.store.add(f"s{segment}/done", 1)

    def drain(self, stopping: Callable[[], bool] = lambda: False) -> float:
        def ready() -> bool:
            self.service()
            return not self.outgoing or stopping()

        return self.s.wait_for(ready, what="the drafters to take the last batches")

    def settle(self, drafters_done: Callable[[], bool]) -> int:
        """After a stop: keep sending what is claimed until `drafters_done()` (every drafter has
        trained its last step, so nothing more will be claimed), wait for those sends, then
        forget the batches nobody claimed; returns how many were dropped."""

        def ready() -> bool:
            self.service()
            return drafters_done()

        self.s.wait_for(ready, what="the drafters to finish their last step before the stop")
        self.service()
        claimed = [o for o in self.outgoing if o.works is not None]
        for o in claimed:
            for w in o.works or []:
                self.s.wait_work(w, what=f"rank {o.drafter} to receive batch {o.header.index}")
        dropped = len(self.outgoing) - len(claimed)
        self.outgoing.clear()
        return dropped


@dataclass
class Claim:
    """A drafter's claim on one queue slot; `works` once its payload receives are posted."""

    segment: int
    slot: int
    started: float
    header: Header | None = None
    buffers: list[Tensor] | None = None
    works: list[dist.Work] | None = None


class DrafterEndpoint:
    """The drafter side: claim the next queue slot, receive its payload.

    `claim` + `try_start` let a drafter claim its next batch and post the receives before it
    trains on the current one, so the transfer overlaps the step (when the entry is already
    there; otherwise `complete` waits for it after the step)."""

    def __init__(self, session: Session, *, device: torch.device) -> None:
        self.s = session
        self.device = device
        self.rank = session.roles.rank
        self.received = 0

    def receive(self, segment: int) -> tuple[Features, Header, float]:
        """→ (features, header, seconds waited on the targets)."""
        return self.complete(self.claim(segment))

    def claim(self, segment: int) -> Claim:
        slot = self.s.store.add(f"s{segment}/head", 1) - 1
        return Claim(segment, slot, time.perf_counter())

    def try_start(self, c: Claim) -> bool:
        """Post the receives if the slot's entry is there (never blocks)."""
        if c.works is not None:
            return True
        store = self.s.store
        key = f"s{c.segment}/q/{c.slot}"
        if not store.check([key]):
            return False
        h = Header.decode(store.get(key))
        store.set(f"claim/{h.target}/{h.seq}", str(self.rank))
        dtype = DTYPES[h.dtype]
        bufs = [torch.empty(h.bsz, h.seq_len, h.feat_dim, dtype=dtype, device=self.device)]
        if h.has_last:
            bufs.append(torch.empty(h.bsz, h.seq_len, h.hidden, dtype=dtype, device=self.device))
        bufs.append(torch.empty(h.ints_numel, dtype=torch.long, device=self.device))
        c.header, c.buffers = h, bufs
        c.works = [_p2p(dist.irecv(t, src=h.target)) for t in bufs]
        return True

    def complete(self, c: Claim) -> tuple[Features, Header, float]:
        start = time.perf_counter()
        polls = 0

        def ready() -> bool:
            nonlocal polls
            polls += 1
            if self.try_start(c):
                return True
            if polls % 500 == 0:
                self._check_not_lost(c.segment, c.slot)
            return False

        self.s.wait_for(
            ready,
            what=f"a batch from a target (segment {c.segment}, slot {c.slot})",
            max_poll_s=0.002,
        )
        h, bufs = c.header, c.buffers
        assert h is not None and bufs is not None and c.works is not None
        for w in c.works:
            self.s.wait_work(w, what=f"the payload of batch {h.index} from rank {h.target}")
        self.received += 1
        last = bufs[1] if h.has_last else None
        return unpack(h, bufs[0], last, bufs[-1]), h, time.perf_counter() - start

    def _check_not_lost(self, segment: int, slot: int) -> None:
        store = self.s.store
        targets = self.s.roles.num_targets
        if store.add(f"s{segment}/done", 0) >= targets:
            tail = store.add(f"s{segment}/tail", 0)
            if not store.check([f"s{segment}/q/{slot}"]):
                raise PeerFailed(
                    f"{self.s.roles.describe()}: every target finished segment {segment} after "
                    f"{tail} batches, but this drafter claimed slot {slot} (steps × drafters "
                    "and the segment's batch count disagree)"
                )


STARTING = "start."  # among the frozen tensors: the target weights a drafter starts from


def share_frozen(
    session: Session, tensors: dict[str, Tensor] | None, *, device: torch.device
) -> dict[str, Tensor]:
    """Target rank 0 sends the frozen tensors the drafters need (embedding, lm_head) to every
    drafter once at start, so drafters never load the target. `tensors` on target rank 0,
    None elsewhere; returns the received tensors on drafters, `{}` on targets."""
    roles = session.roles
    if roles.rank == 0:
        assert tensors is not None
        meta = {k: [list(t.shape), str(t.dtype).removeprefix("torch.")] for k, t in tensors.items()}
        session.store.set("frozen", json.dumps(meta))
        works = [
            _p2p(dist.isend(t.contiguous(), dst=d))
            for d in roles.drafter_ranks
            for t in tensors.values()
        ]
        for w in works:
            session.wait_work(w, what="the drafters to receive the frozen embedding/lm_head")
        return {}
    if roles.role != "drafter":
        return {}
    meta = json.loads(session.wait_get("frozen", what="target rank 0 to load the target"))
    out = {
        k: torch.empty(shape, dtype=DTYPES[dtype], device=device)
        for k, (shape, dtype) in meta.items()
    }
    for t in out.values():
        session.wait_work(
            _p2p(dist.irecv(t, src=0)), what="the frozen embedding/lm_head from rank 0"
        )
    return out


def _p2p(work: dist.Work | None) -> dist.Work:
    """`isend`/`irecv`'s handle: None only for a rank outside the default group, never here."""
    assert work is not None
    return work
