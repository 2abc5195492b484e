"""`[job]` of `deploy.toml`: the tmux session, its log and environment, the GPU split, the
nodes, an optional command, and the stop and lock timings; each value checked where it is read."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_ops.connect import shell
from dflash_ops.errors import ConfigError, UnsafeValue
from dflash_ops.settings.toml_keys import INT, NUM, STR, TABLE, Schema, check_keys, type_error

DEFAULT_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
_JOB_KEYS: Schema = {
    "session": STR,
    "log": STR,
    "env": TABLE,
    "gpus": INT,
    "target_gpus": INT,
    "nodes": INT,
    "rendezvous": STR,
    "command": STR,
    "socket": STR,
    "stop_timeout": NUM,
    "start_wait": NUM,
    "ready": STR,
    "lock_wait": NUM,
    "lock_max_age": NUM,
}


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """The `[job]` table: one tmux session running one command with its log and environment."""

    session: str = "dflash"
    log: str = "train_stdout.log"
    env: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_ENV))
    gpus: int = 0
    target_gpus: int = 0  # of all nodes together: target ranks are the first global ranks
    nodes: int = 1
    rendezvous: str | None = None  # "host:port" of torchrun's c10d store, when nodes > 1
    command: str | None = None
    socket: str | None = None  # None: keyed to the target's root (`job.socket_for`)
    stop_timeout: float = 30.0
    start_wait: float = 20.0  # seconds deploy/restart wait for the job to be past start-up
    ready: str | None = None  # the log line that says so (None: the trainer's, or any line)
    lock_wait: float = 10.0  # seconds a command waits for the place's deploy lock
    lock_max_age: float = 6 * 3600.0  # a lock older than this is stale wherever its holder is


def job_config(table: Mapping[str, Any], *, path: Path) -> JobConfig:
    """The `[job]` table of `path`, every key checked and every combination refused by key."""
    check_keys(table, _JOB_KEYS, prefix="job", path=path)
    env = dict(DEFAULT_ENV)
    for key, value in table.get("env", {}).items():
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise type_error(f"job.env.{key}", value, "a string (or a number)", path)
        try:
            env[shell.env_key(key)] = shell.env_value(str(value))
        except UnsafeValue as exc:
            raise ConfigError(f"Key 'job.env.{key}' in {path}: {exc}") from None
    values: dict[str, Any] = {k: v for k, v in table.items() if k != "env"}
    for key in ("session", "socket"):
        if key in values:
            _check_name(f"job.{key}", values[key], path)
    for key in ("gpus", "target_gpus"):
        if key in values and values[key] < 0:
            raise ConfigError(f"Key 'job.{key}' in {path} must be 0 or more, not {values[key]}.")
    job = JobConfig(env=env, **values)
    _check_nodes(job, path)
    total = job.gpus * job.nodes
    if job.gpus > 0 and job.target_gpus >= total:
        nodes = f" × job.nodes = {job.nodes}" if job.nodes > 1 else ""
        raise ConfigError(
            f"Key 'job.target_gpus' in {path} is {job.target_gpus} but job.gpus is "
            f"{job.gpus}{nodes}: at least one GPU must train the drafter.",
            hint="Set job.target_gpus below the number of GPUs of all nodes together.",
        )
    if job.gpus == 0 and job.target_gpus:
        raise ConfigError(
            f"Key 'job.target_gpus' in {path} is {job.target_gpus} but job.gpus is 0 (CPU).",
            hint="Set job.gpus to the number of GPUs, or job.target_gpus = 0.",
        )
    if job.stop_timeout <= 0:
        raise ConfigError(f"Key 'job.stop_timeout' in {path} must be more than 0 seconds.")
    if job.start_wait < 0:
        raise ConfigError(
            f"Key 'job.start_wait' in {path} must be 0 or more seconds (0: do not wait).",
        )
    if job.lock_wait < 0 or job.lock_max_age <= 0:
        raise ConfigError(
            f"Keys 'job.lock_wait' (0 or more) and 'job.lock_max_age' (more than 0) in {path} "
            "are seconds.",
        )
    if job.ready is not None and (not job.ready.strip() or "\n" in job.ready):
        raise ConfigError(
            f"Key 'job.ready' in {path} must be some text of one log line, not {job.ready!r}.",
            hint="Set it to words the job logs once it is past start-up, or remove it.",
        )
    if job.command is not None and not job.command.strip():
        raise ConfigError(f"Key 'job.command' in {path} is empty.", hint="Remove it or set it.")
    _check_log(job.log, path)
    return job


# One DNS label (RFC 1123): letters, digits and inner hyphens.
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def _check_nodes(job: JobConfig, path: Path) -> None:
    """`nodes` and `rendezvous` come together: several nodes meet at one endpoint, one node
    needs none (torchrun's `--standalone`), so a stray endpoint is refused, not ignored."""
    if job.nodes < 1:
        raise ConfigError(f"Key 'job.nodes' in {path} must be 1 or more, not {job.nodes}.")
    if job.nodes == 1:
        if job.rendezvous is not None:
            raise ConfigError(
                f"Key 'job.rendezvous' in {path} is set but job.nodes is 1.",
                hint="Remove job.rendezvous, or set job.nodes to the number of nodes.",
            )
        return
    if job.gpus < 1:
        raise ConfigError(
            f"Key 'job.gpus' in {path} is 0 but job.nodes is {job.nodes}: set the processes "
            "(GPUs) each node runs.",
            hint="Set job.gpus to the GPUs of one node.",
        )
    if job.rendezvous is None:
        raise ConfigError(
            f"Key 'job.rendezvous' in {path} is missing: job.nodes = {job.nodes} needs the "
            "host:port where the nodes meet.",
            hint='Set job.rendezvous = "node0.example:29400" (reachable from every node).',
        )
    _check_endpoint(job.rendezvous, path)


def _check_endpoint(endpoint: str, path: Path) -> None:
    """`host:port` with a host name, an IPv4 address or a bracketed IPv6 address."""
    bad = ConfigError(
        f"Key 'job.rendezvous' in {path} must be host:port (a host name, an IPv4 address or "
        f"[an IPv6 address], and a port 1-65535), not {endpoint!r}.",
        hint='For example: rendezvous = "10.0.0.1:29400" or "[fd00::1]:29400".',
    )
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise bad
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise bad from None
        return
    labels = host.split(".")
    if all(label.isdigit() for label in labels):  # digits and dots: it must be an IPv4 address
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise bad from None
        return
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise bad


def _check_name(key: str, value: str, path: Path) -> None:
    """tmux names: the shared validator, minus '.', which tmux rewrites to '_' in names."""
    try:
        shell.session_name(value)
    except UnsafeValue as exc:
        raise ConfigError(f"Key {key!r} in {path}: {exc}") from None
    if "." in value:
        raise ConfigError(
            f"Key {key!r} in {path}: {value!r} contains '.', which tmux rewrites in names.",
            hint="Use letters, digits, '_' or '-'.",
        )


def _check_log(log: str, path: Path) -> None:
    parts = log.split("/")
    if not log or "\x00" in log or "\n" in log or ".." in parts or log.endswith("/"):
        raise ConfigError(
            f"Key 'job.log' in {path} must be a file name (relative to checkpoints) or an "
            f"absolute path without '..', not {log!r}.",
        )
