"""One command's view of the world: the config, the chosen target, and the place it lives at.

The CLI builds a `Workspace` from its flags; the operations (`commands/operations.py`) get the job, the
releases and the checkpoints of the target from it. The place is opened on first use and checked
(`ensure_ready`: e.g. `pct` present, container exists and runs) before anything acts on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_ops.remote.checkpoints import Checkpoints
from dflash_ops.remote.job import Job, socket_for
from dflash_ops.remote.lock import DeployLock
from dflash_ops.remote.release import Releases
from dflash_ops.settings import project as projects
from dflash_ops.settings import state
from dflash_ops.settings.deploy_config import (
    Config,
    Target,
    TargetFlags,
    find_config,
    load_config,
    resolve_target,
)

if TYPE_CHECKING:
    from dflash_ops.connect.place import Place


def open_place(target: Target, *, accept_new_host_key: bool = False) -> Place:
    """The place of `target`: this machine, an SSH host, or a container on a Proxmox node."""
    from dflash_ops.connect.place import ContainerPlace, HostPlace
    from dflash_ops.connect.transport import LocalTransport, SSHTransport

    if target.place == "local":
        return HostPlace(LocalTransport(), timeout=target.timeout)
    assert target.host is not None
    transport = SSHTransport(
        target.host,
        user=target.user,
        port=target.port,
        accept_new_host_key=accept_new_host_key,
    )
    if target.place == "proxmox":
        assert target.ct is not None
        return ContainerPlace(transport, target.ct, timeout=target.timeout)
    return HostPlace(transport, timeout=target.timeout)


@dataclass(kw_only=True)
class Workspace:
    config: Config
    target: Target
    flags: TargetFlags
    accept_new_host_key: bool = False
    _place: Place | None = field(default=None, repr=False)

    @classmethod
    def load(
        cls,
        *,
        config_file: str | Path | None,
        flags: TargetFlags,
        accept_new_host_key: bool = False,
    ) -> Workspace:
        config = load_config(find_config(config_file))
        # This folder's project is drawn before any deploy records a state.json: a folder with
        # a state.json and no project.json is one an earlier dflash deployed from.
        projects.load(config.project_dir)
        record = state.load(config.project_dir)
        remembered = record.flags if record is not None else None
        target = resolve_target(config, flags, remembered=remembered)
        effective = flags if flags.selects or remembered is None else remembered
        return cls(
            config=config,
            target=target,
            flags=effective,
            accept_new_host_key=accept_new_host_key,
        )

    @property
    def place(self) -> Place:
        return self.open()

    def open(self, *, check: bool = True) -> Place:
        """The place, opened now (once; later calls return it). `check=False` opens only the
        connection, without the container check of `ensure_ready` (`pct status`, one more
        command): for a caller whose own first command stands in for it — `ContainerPlace.run`
        raises the same errors from pct's messages for a missing or stopped container, or a
        host without pct — as `dflash deploy`'s one command does."""
        if self._place is None:
            place = open_place(self.target, accept_new_host_key=self.accept_new_host_key)
            try:
                place.ensure_ready() if check else place.transport.connect()
            except BaseException:
                place.close()
                raise
            self._place = place
        return self._place

    def reopen(self) -> Place:
        """A fresh connection to the same place (after the old one dropped)."""
        self.close()
        return self.place

    def close(self) -> None:
        if self._place is not None:
            self._place.close()
            self._place = None

    @property
    def log_path(self) -> str:
        log = self.config.job.log
        return log if log.startswith("/") else f"{self.target.checkpoints}/{log}"

    @property
    def metrics_path(self) -> str:
        return f"{self.target.checkpoints}/metrics.jsonl"

    def job(self) -> Job:
        job = self.config.job
        return Job(
            self.place,
            session=job.session,
            log=self.log_path,
            socket=job.socket or socket_for(self.target.root),
            stop_timeout=job.stop_timeout,
        )

    @property
    def deployed_here(self) -> bool:
        """Whether a deploy from this project folder went to this target (`.dflash/state.json`)."""
        record = state.load(self.config.project_dir)
        return record is not None and record.target == self.target.describe()

    @property
    def project(self) -> projects.Project:
        """This folder's own defaults at remote places (`.dflash/project.json`)."""
        return projects.load(self.config.project_dir)

    @property
    def in_shared_root(self) -> bool:
        """The job lives in the root every project shared before each got its own (a folder
        that deployed with an earlier dflash keeps it), and deploy.toml does not name it."""
        tables = [self.config.default_target, *self.config.targets.values()]
        named = any(table.get("root") == self.target.root for table in tables)
        return (
            self.target.remote
            and self.target.root == projects.LEGACY_ROOT
            and self.project.legacy
            and not named
        )

    def shared_root_job(self) -> bool:
        """Whether a job runs in the shared root of an earlier dflash, on its default socket,
        while this folder looks for its own elsewhere (asked only when it found none)."""
        if not self.target.remote or self.config.job.socket is not None:
            return False
        if self.target.root != self.project.remote_root or self.project.legacy:
            return False
        job = self.config.job
        shared = Job(
            self.place, session=job.session, log=self.log_path,
            socket=socket_for(projects.LEGACY_ROOT),
        )  # fmt: skip
        return shared.state().exists

    def releases(self) -> Releases:
        return Releases(self.place, self.target.root)

    def lock(self, *, warn: Callable[[str], None] | None = None) -> DeployLock:
        job = self.config.job
        return DeployLock(
            self.place, self.target.root, wait=job.lock_wait, max_age=job.lock_max_age, warn=warn
        )

    def checkpoints(self) -> Checkpoints:
        return Checkpoints(self.place, self.target.checkpoints)
