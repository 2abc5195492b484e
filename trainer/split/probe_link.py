"""The τ probe of a split run, run where the target is.

Drafter ranks never load the target, and the probe needs it for every verify forward. So at a
probe step (`eval.every`) drafter rank 0 (the lead) hands the drafter's weights to target rank 0,
which holds a replica of the drafter, runs the same `TauProbe` the colocated run runs, and hands
the report back:

1. the lead sets `probe/ask/<n>` = step in the control store and broadcasts every drafter
   parameter over `Session.probe_group` (a group of just these two ranks, so the transfer is
   never ordered among the features' p2p ops);
2. target rank 0 looks for the request between the batches it produces and inside its waits,
   receives the parameters into its replica, probes, and sets `probe/report/<n>` (JSON);
3. the lead waits for the report (the other drafters wait in the next step's all-reduce, as a
   colocated run waits for its probe) and logs it in the row of that step;
4. after its last step the lead sets `probe/end`; target rank 0 serves until it sees it.

The replica costs target rank 0 one drafter's weights (no optimizer state); the probe is greedy
and draws no random numbers, so the run's losses are those of a run without it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.model.drafter import Drafter
from trainer.run.probe import ProbeReport, TauProbe
from trainer.split.distributed import Session

END = "probe/end"


def _exchange(session: Session, drafter: Drafter) -> None:
    """Broadcast the drafter's parameters from the lead (in place on target rank 0)."""
    src = session.roles.drafter_ranks[0]
    with torch.no_grad():
        for p in drafter.parameters():
            dist.broadcast(p.data, src=src, group=session.probe_group)


class ProbeServer:
    """Target rank 0: runs the probes the lead asks for."""

    def __init__(self, session: Session, probe: TauProbe, replica: Drafter) -> None:
        self.session = session
        self.probe = probe
        self.replica = replica.eval()
        self.served = 0

    def serve(self) -> bool:
        """Run the pending probe, if any (never waits for one); True once the lead is done."""
        store = self.session.store
        key = f"probe/ask/{self.served}"
        if store.check([key]):
            step = int(store.get(key))
            _exchange(self.session, self.replica)
            report = self.probe(self.replica, step=step)
            store.set(f"probe/report/{self.served}", report.to_json())
            self.served += 1
            return False
        return store.check([END])

    def serve_until_end(self) -> None:
        self.session.wait_for(self.serve, what="drafter rank 0 to finish its τ probes")


class ProbeClient:
    """The lead: asks target rank 0 for the probe of its drafter at a step."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.asked = 0

    def __call__(self, drafter: Drafter, *, step: int) -> ProbeReport:
        n, store = self.asked, self.session.store
        self.asked += 1
        store.set(f"probe/ask/{n}", str(step))
        _exchange(self.session, drafter)
        raw = self.session.wait_get(
            f"probe/report/{n}", what=f"target rank 0 to run the τ probe of step {step}"
        )
        return ProbeReport.from_json(raw)

    def end(self) -> None:
        self.session.store.set(END, "1")
