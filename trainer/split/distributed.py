"""Ranks, roles and the safety net of a run split across processes.

Launch (one node, G processes; `dflash deploy` generates this when `[job] gpus > 1`):

    DFLASH_TARGET_GPUS=T torchrun --nproc-per-node G -m trainer train --config FILE --out DIR

Ranks `0 … T−1` are target workers, ranks `T … G−1` drafter workers (`T` from
`DFLASH_TARGET_GPUS`; unset, the split the model shapes predict fastest, `trainer.split.split_shapes`,
which rank 0 logs with the two roles' FLOPs per token). One process (no torchrun environment, or
`WORLD_SIZE=1`) is the colocated mode of `trainer.run.trainer`. The backend is NCCL on CUDA and gloo on
the CPU; every rank uses the GPU `LOCAL_RANK`. Drafters get their own process group for the
gradient all-reduce; targets never join it.

Nothing waits forever:
- every process group has `timeout=` (NCCL's watchdog tears a stuck collective/p2p down);
- every wait of the protocol (`trainer.split.exchange`) is a polling loop with a deadline;
- a watchdog thread beats a per-rank heartbeat counter in the store and stops the process when a
  peer's counter stands still for `split.heartbeat_timeout_s` (default 60 s), or when a peer
  published an abort message (a rank that raised) — naming the rank and its role;
- torchrun itself stops every worker (SIGTERM, then SIGKILL) as soon as one exits non-zero. SIGTERM
  is handled by a thread (`sigwait`, so it runs even while the main thread sits in a C call): it
  looks up which peer on this host is gone (pid missing or a zombie) and prints
  `error: rank R (ROLE) exited …` before exiting with 143.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.base.errors import TrainerError
from trainer.base.stopping import StopRequest
from trainer.settings.config import SplitConfig
from trainer.split.roles import Roles

log = logging.getLogger("trainer")


class PeerFailed(TrainerError):
    """Another rank failed or stopped responding; the message names it and its role."""

    hint = "Read that rank's log lines above; the job stops as a whole and resumes from the last checkpoint."


def block_termination_signal() -> None:
    """Block SIGTERM in this thread (and every thread started after it) so that one dedicated
    thread can take it with `sigwait`; call it before torch starts its own threads."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """`split.timeout_s` bounds any single wait (default 1800 s: a first compile or a slow
    checkpoint may take minutes); the heartbeat bound catches a silent peer much sooner."""

    wait_s: float = 1800.0
    heartbeat_s: float = 60.0
    beat_every_s: float = 1.0

    @classmethod
    def of(cls, split: SplitConfig) -> Timeouts:
        """The bounds of the `[split]` table."""
        return cls(wait_s=split.timeout_s, heartbeat_s=split.heartbeat_timeout_s)


class TerminationWatch:
    """A thread that takes SIGTERM (blocked in every other thread, see `block_termination_signal`)
    with `sigwait`, so it acts even while the main thread sits in a C call. Started before the
    process groups exist; once a `Session` is attached it names the failed peer, before that it
    just says that this rank was stopped during start-up. Started only when SIGTERM is blocked."""

    def __init__(self, roles: Roles, stop: StopRequest | None = None) -> None:
        self.roles = roles
        self.session: Session | None = None
        self.stop = stop  # the first SIGTERM with no failure behind it asks for a graceful stop
        if signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, set()):
            threading.Thread(target=self._wait, name="dflash-sigterm", daemon=True).start()

    def _wait(self) -> None:
        signal.sigwait({signal.SIGTERM})
        while self.session is not None:
            self.session.on_sigterm(graceful=self.stop)  # returns only for a graceful stop
            signal.sigwait({signal.SIGTERM})
        print(
            f"{self.roles.describe()} stopped by the launcher during start-up",
            file=sys.stderr,
            flush=True,
        )
        os._exit(143)


class Session:
    """The process groups, the control store and the watchdog of one rank."""

    def __init__(
        self, roles: Roles, *, timeouts: Timeouts | None = None, device: str = "auto"
    ) -> None:
        self.roles = roles
        self.timeouts = timeouts or Timeouts()
        self.device = self._pick_device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=self.timeouts.wait_s)
        device_id = self.device if self.device.type == "cuda" else None
        if not dist.is_initialized():
            dist.init_process_group(self.backend, timeout=timeout, device_id=device_id)
        # every rank must call new_group, members or not
        self.drafter_group = dist.new_group(roles.drafter_ranks, timeout=timeout)
        # the τ probe's weights (drafter rank 0 → target rank 0) on a group of their own: never
        # ordered behind or ahead of the features' p2p ops on the default group
        self.probe_group = dist.new_group(
            [roles.target_ranks[0], roles.drafter_ranks[0]], timeout=timeout
        )
        self.store = self._store()
        self._peers: dict[int, dict] = {}
        self._stop = threading.Event()
        self._publish_identity()

    def _pick_device(self, name: str) -> torch.device:
        """`run.device`: "cpu" is the CPU, "auto" the GPU `LOCAL_RANK` when CUDA is available;
        any "cuda…" is this rank's GPU `LOCAL_RANK` (each rank has its own)."""
        if name != "cpu" and (name != "auto" or torch.cuda.is_available()):
            device = torch.device("cuda", self.roles.local_rank)
            torch.cuda.set_device(device)
            return device
        return torch.device("cpu")

    def _store(self, *, timeout_s: float = 60) -> dist.Store:
        """A client of torchrun's store (the agent's, or rank 0's), under a per-attempt prefix."""
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ["MASTER_PORT"])
        base = dist.TCPStore(
            host,
            port,
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return dist.PrefixStore(f"dflash/{run}/{attempt}/", base)

    def _publish_identity(self) -> None:
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "role": self.roles.role,
            "describe": self.roles.describe(),
        }
        self.store.set(f"who/{self.roles.rank}", json.dumps(me))
        for r in range(self.roles.world_size):
            self._peers[r] = json.loads(self.wait_get(f"who/{r}", what="all ranks to start"))

    # ---- waits -------------------------------------------------------------------------

    def wait_for(
        self,
        ready: Callable[[], bool],
        *,
        what: str,
        poll_s: float = 0.0005,
        max_poll_s: float = 0.02,
    ) -> float:
        """Poll `ready()` until true (seconds waited), with backoff; raise after the deadline."""
        start = time.perf_counter()
        delay = poll_s
        while not ready():
            waited = time.perf_counter() - start
            if waited > self.timeouts.wait_s:
                raise PeerFailed(
                    f"{self.roles.describe()} waited {waited:.0f} s for {what} "
                    f"(split.timeout_s = {self.timeouts.wait_s:.0f})"
                )
            time.sleep(delay)
            delay = min(max_poll_s, delay * 1.5)
        return time.perf_counter() - start

    def wait_get(self, key: str, *, what: str) -> str:
        self.wait_for(lambda: self.store.check([key]), what=what)
        return self.store.get(key).decode()

    def wait_work(self, work: dist.Work, *, what: str) -> float:
        """Wait for a p2p op. On NCCL `wait()` only orders the current stream after the transfer
        (the process group's timeout and watchdog bound it); gloo's send/recv complete only
        inside `wait`, which blocks in C with the GIL released — the watchdog and SIGTERM
        threads keep running — and raises after the deadline."""
        if self.backend == "nccl":
            work.wait()
            return 0.0
        start = time.perf_counter()
        try:
            work.wait(timedelta(seconds=self.timeouts.wait_s))
        except RuntimeError as exc:
            raise PeerFailed(f"{self.roles.describe()} waiting for {what}: {exc}") from exc
        return time.perf_counter() - start

    # ---- failure handling ----------------------------------------------------------------

    def abort(self, message: str) -> None:
        """Tell every rank why this one stops (read by their watchdogs)."""
        with contextlib.suppress(Exception):  # the store may be gone: the exit code still tells
            self.store.set("abort", f"{self.roles.describe()}: {message}")

    def start_watchdog(self, *, emit: Callable[[str], None] = print) -> None:
        threading.Thread(
            target=self._watch, args=(emit,), name="dflash-watchdog", daemon=True
        ).start()

    def _watch(self, emit: Callable[[str], None]) -> None:
        store = self._store()  # its own client: never queued behind the main thread's calls
        me = self.roles.rank
        seen: dict[int, tuple[int, float]] = {}
        while not self._stop.wait(self.timeouts.beat_every_s):
            try:
                store.add(f"hb/{me}", 1)
                if store.check(["abort"]):
                    msg = store.get("abort").decode()
                    if not msg.startswith(self.roles.describe() + ":"):
                        self._die(f"error: stopping {self.roles.describe()}: {msg}", 1)
                now = time.monotonic()
                for r in range(self.roles.world_size):
                    if r == me or store.check([f"exit/{r}"]):
                        continue
                    beat = store.add(f"hb/{r}", 0)
                    last = seen.get(r)
                    if last is None or last[0] != beat:
                        seen[r] = (beat, now)
                    elif now - last[1] > self.timeouts.heartbeat_s:
                        self._die(
                            f"error: {self.roles.describe(r)} sent no heartbeat for "
                            f"{now - last[1]:.0f} s; stopping {self.roles.describe()}",
                            1,
                        )
            except Exception as exc:  # the store itself is gone: the launcher is tearing down
                if self._stop.is_set():
                    return
                self._die(f"error: {self.roles.describe()} lost the control store ({exc})", 1)

    def on_sigterm(self, *, graceful: StopRequest | None = None) -> None:
        """Name the rank whose end made the launcher stop this one: a peer that published an
        abort message (it raised), else a local peer that is gone without having been
        SIGTERMed itself (killed, crashed). When the launcher itself is being stopped, every
        peer marks `sigterm/<rank>` before exiting and nobody is blamed. With no failure to
        name, the first SIGTERM asks `graceful` for a stop after the current step and returns;
        otherwise it never returns."""
        if self._stop.is_set():
            os._exit(143)
        me = self.roles.describe()
        try:
            store = self._store(timeout_s=5)
            store.set(f"sigterm/{self.roles.rank}", "1")
            if store.check(["abort"]):
                self._die(f"error: stopping {me}: {store.get('abort').decode()}", 143)
            dead = [r for r in self.dead_local_peers() if not store.check([f"sigterm/{r}"])]
        except Exception:  # the store is gone too: say what can be seen locally
            dead = self.dead_local_peers()
        host = socket.gethostname()
        alive = [
            r
            for r, p in self._peers.items()
            if p["host"] == host and r not in dead and r != self.roles.rank
        ]
        if dead and all(self.roles.rank < r for r in alive):  # one survivor per host speaks
            names = ", ".join(f"{self.roles.describe(r)} pid {self._peers[r]['pid']}" for r in dead)
            self._die(
                f"error: {names} exited unexpectedly; the launcher stopped the other ranks", 143
            )
        if graceful is not None and graceful.request("SIGTERM"):
            return
        self._die(f"{me} stopped by the launcher (SIGTERM)", 143)

    def explain_failure(self) -> str | None:
        """`rank R (ROLE) pid P exited unexpectedly` for local peers that are gone without the
        launcher having stopped them, else None (called when this rank's communication broke)."""
        deadline = time.monotonic() + 2.0  # a killed peer's sockets close before it is a zombie
        while True:
            dead = self.dead_local_peers()
            with contextlib.suppress(Exception):  # the store may be gone: keep what /proc says
                dead = [r for r in dead if not self.store.check([f"sigterm/{r}"])]
            if dead or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if not dead:
            return None
        names = ", ".join(f"{self.roles.describe(r)} pid {self._peers[r]['pid']}" for r in dead)
        return f"{names} exited unexpectedly"

    def dead_local_peers(self) -> list[int]:
        """Peers on this host whose process is gone or a zombie."""
        host = socket.gethostname()
        dead = []
        for r, p in self._peers.items():
            if r == self.roles.rank or p["host"] != host:
                continue
            try:
                with open(f"/proc/{p['pid']}/stat") as fh:
                    state = fh.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                dead.append(r)
                continue
            if state in ("Z", "X"):
                dead.append(r)
        return dead

    @staticmethod
    def _die(message: str, code: int) -> None:
        print(message, file=sys.stderr, flush=True)
        os._exit(code)

    # ---- end -----------------------------------------------------------------------------

    def finish(self) -> None:
        """Two-phase store barrier of all ranks, then destroy the process groups: nobody tears
        NCCL down while a peer still receives, and the store's host (rank 0 without the torchrun
        agent) leaves last."""
        self._stop.set()  # from here on a peer that exits is expected
        self.store.set(f"exit/{self.roles.rank}", "1")  # peers stop checking this heartbeat
        world = self.roles.world_size
        self.store.add("finished", 1)
        self.wait_for(
            lambda: self.store.add("finished", 0) >= world,
            what="all ranks to finish",
            max_poll_s=0.05,
        )
        self.store.add("left", 1)
        if self.roles.rank == 0:
            self.wait_for(
                lambda: self.store.add("left", 0) >= world,
                what="all ranks to leave",
                max_poll_s=0.05,
            )
        dist.destroy_process_group()
