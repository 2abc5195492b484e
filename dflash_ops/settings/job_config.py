"""`[job]` of `deploy.toml`: the tmux session, its log and environment, the GPU split, the
nodes, an optional command, and the stop and lock timings; each key's type, bound and meaning,
and the keys that constrain each other (`JobConfig._together`)."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationInfo, field_validator, model_validator

from dflash_ops.connect import shell
from dflash_ops.errors import UnsafeValue
from dflash_ops.settings.table import Table, fail, key, toml_type

DEFAULT_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}

# One DNS label (RFC 1123): letters, digits and inner hyphens.
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


class JobConfig(Table):
    """The `[job]` table: one tmux session running one command with its log and environment."""

    session: str = key("dflash", "tmux session name (letters, digits, `_`, `-`)")
    socket: str | None = key(
        None,
        "tmux socket name (`tmux -L <socket>`): the job's private tmux server. The default is "
        "one per root, and the default root is one per project folder, so two projects on one "
        "machine or one container never stop or show each other's job; `dflash status` prints "
        "it",
        shown='`"dflash-<8 hex>"`, keyed to the target\'s root',
    )
    log: str = key(
        "train_stdout.log",
        "the job's stdout+stderr, relative to `checkpoints` (or absolute)",
    )
    env: Mapping[str, str] = key(
        DEFAULT_ENV,
        "the job's environment; the default entry is always set unless you set that key yourself",
        shown='`{ PYTORCH_CUDA_ALLOC_CONF = "expandable_segments:True" }`',
    )
    gpus: int = key(
        0,
        "GPUs of the job (of each node); `0` = CPU (`launch.sh` sets `CUDA_VISIBLE_DEVICES` "
        'empty, so the trainer\'s `run.device = "auto"` is the CPU), `> 1` = one process per '
        "GPU through torchrun",
        ge=0,
    )
    target_gpus: int = key(
        0,
        "how many of them (of all nodes together) run the frozen target; the rest train the "
        "drafter (`DFLASH_TARGET_GPUS`; `0`: the default split, which the trainer picks from "
        "the model shapes, each role's model FLOPs per token, logs at start and `dflash plan` "
        "marks, docs/training.md; what `dflash init` writes); `dflash plan` measures the best "
        "value",
        ge=0,
    )
    nodes: int = key(
        1,
        "machines running the job together; each runs the same `launch.sh` (`torchrun "
        "--nnodes N --nproc-per-node <gpus>`, `DFLASH_NODES`); `> 1` needs `gpus ≥ 1` and "
        "`rendezvous`",
        ge=1,
    )
    rendezvous: str | None = key(
        None,
        '`"host:port"` where the nodes meet (torchrun\'s c10d store, `--rdzv-endpoint`; '
        "`--rdzv-id` is `session`): a host name, an IPv4 address or `[IPv6]`, port 1–65535, "
        "reachable from every node; required when `nodes > 1`, refused when `nodes = 1` (one "
        "node uses `--standalone`)",
    )
    command: str | None = key(
        None,
        "replaces the trainer launch: run by `bash -c` inside the release folder",
        min_length=1,
    )
    stop_timeout: float = key(
        30.0,
        "seconds the job gets after SIGINT to finish its step and save (raise it when a step "
        "plus a checkpoint write takes longer); then SIGTERM, and SIGKILL at most 10 s after "
        "that",
        gt=0,
        allow_inf_nan=False,
    )
    start_wait: float = key(
        20.0,
        "seconds deploy, restart and rollback wait (at most) for the job to be past start-up: "
        "its readiness line, or its end (then the command fails with the log's last lines); "
        "`0`: no wait, as `--no-wait`",
        ge=0,
        allow_inf_nan=False,
    )
    ready: str | None = key(
        None,
        "words of the log line that says the job is past start-up; default: the trainer's "
        "`started training at step`, or for a `[job] command` its first line of output",
    )
    lock_wait: float = key(
        10.0,
        "seconds deploy/restart/stop/rollback wait for the target's deploy lock before `LockHeld`",
        ge=0,
        allow_inf_nan=False,
    )
    lock_max_age: float = key(
        6 * 3600.0,
        "a lock without a place identity (from an older dflash) older than this (seconds) is "
        "stale wherever its holder is; a current lock is stale exactly when the remote script "
        "that holds it is gone",
        gt=0,
        allow_inf_nan=False,
    )

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, table: Any) -> Any:
        """The default entry, then the table's: names and values the shell can carry as given
        (numbers are written as text)."""
        if not isinstance(table, dict):
            return table  # the type check says what it must be
        env = dict(DEFAULT_ENV)
        for name, value in table.items():
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise fail(
                    f"Key 'job.env.{name}' in {{path}} must be a string (or a number), not "
                    f"{value!r} ({toml_type(value)})."
                )
            try:
                env[shell.env_key(name)] = shell.env_value(str(value))
            except UnsafeValue as exc:
                raise fail(f"Key 'job.env.{name}' in {{path}}: {exc}") from None
        return env

    @field_validator("session", "socket")
    @classmethod
    def _tmux_name(cls, value: str | None, info: ValidationInfo) -> str | None:
        """tmux names: the shared validator, minus '.', which tmux rewrites to '_' in names."""
        if value is None:
            return None
        name = f"job.{info.field_name}"
        try:
            shell.session_name(value)
        except UnsafeValue as exc:
            raise fail(f"Key {name!r} in {{path}}: {exc}") from None
        if "." in value:
            raise fail(
                f"Key {name!r} in {{path}}: {value!r} contains '.', which tmux rewrites in names.",
                "Use letters, digits, '_' or '-'.",
            )
        return value

    @field_validator("log")
    @classmethod
    def _log(cls, log: str) -> str:
        parts = log.split("/")
        if not log or "\x00" in log or "\n" in log or ".." in parts or log.endswith("/"):
            raise fail(
                "Key 'job.log' in {path} must be a file name (relative to checkpoints) or an "
                f"absolute path without '..', not {log!r}."
            )
        return log

    @field_validator("ready")
    @classmethod
    def _ready(cls, ready: str | None) -> str | None:
        if ready is not None and (not ready.strip() or "\n" in ready):
            raise fail(
                f"Key 'job.ready' in {{path}} must be some text of one log line, not {ready!r}.",
                "Set it to words the job logs once it is past start-up, or remove it.",
            )
        return ready

    @field_validator("command")
    @classmethod
    def _command(cls, command: str | None) -> str | None:
        if command is not None and not command.strip():
            raise fail("Key 'job.command' in {path} is empty.", "Remove it or set it.")
        return command

    @field_validator("rendezvous")
    @classmethod
    def _rendezvous(cls, endpoint: str | None) -> str | None:
        if endpoint is not None and not _endpoint(endpoint):
            raise fail(
                "Key 'job.rendezvous' in {path} must be host:port (a host name, an IPv4 "
                "address or [an IPv6 address], and a port 1-65535), not "
                f"{endpoint!r}.",
                'For example: rendezvous = "10.0.0.1:29400" or "[fd00::1]:29400".',
            )
        return endpoint

    @model_validator(mode="after")
    def _together(self) -> JobConfig:
        """The keys that constrain each other: nodes and rendezvous come together (one node
        needs none: torchrun's `--standalone`); at least one GPU trains the drafter."""
        if self.nodes == 1 and self.rendezvous is not None:
            raise fail(
                "Key 'job.rendezvous' in {path} is set but job.nodes is 1.",
                "Remove job.rendezvous, or set job.nodes to the number of nodes.",
            )
        if self.nodes > 1 and self.gpus < 1:
            raise fail(
                f"Key 'job.gpus' in {{path}} is 0 but job.nodes is {self.nodes}: set the "
                "processes (GPUs) each node runs.",
                "Set job.gpus to the GPUs of one node.",
            )
        if self.nodes > 1 and self.rendezvous is None:
            raise fail(
                f"Key 'job.rendezvous' in {{path}} is missing: job.nodes = {self.nodes} needs "
                "the host:port where the nodes meet.",
                'Set job.rendezvous = "node0.example:29400" (reachable from every node).',
            )
        total = self.gpus * self.nodes
        if self.gpus > 0 and self.target_gpus >= total:
            nodes = f" × job.nodes = {self.nodes}" if self.nodes > 1 else ""
            raise fail(
                f"Key 'job.target_gpus' in {{path}} is {self.target_gpus} but job.gpus is "
                f"{self.gpus}{nodes}: at least one GPU must train the drafter.",
                "Set job.target_gpus below the number of GPUs of all nodes together.",
            )
        if self.gpus == 0 and self.target_gpus:
            raise fail(
                f"Key 'job.target_gpus' in {{path}} is {self.target_gpus} but job.gpus is 0 (CPU).",
                "Set job.gpus to the number of GPUs, or job.target_gpus = 0.",
            )
        return self


def _endpoint(endpoint: str) -> bool:
    """`host:port` with a host name, an IPv4 address or a bracketed IPv6 address."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        return False
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return True
    labels = host.split(".")
    if all(label.isdigit() for label in labels):  # digits and dots: it must be an IPv4 address
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return False
        return True
    return len(host) <= 253 and all(_LABEL.fullmatch(label) for label in labels)
