"""Every failure a user can meet, named for its condition and carrying the next step.

Library code raises these; only the CLI turns them into a message, a hint and an exit code.
"""

from __future__ import annotations

from collections.abc import Sequence

from dflash_ops.untrusted import last_line


class DflashError(Exception):
    """Base of all expected failures. `hint` says what the user should do next."""

    hint: str = ""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        if hint is not None:
            self.hint = hint


class ConfigError(DflashError):
    """deploy.toml (or a flag) is missing, malformed, or names something that does not exist."""

    hint = "Fix the named key in the file (see README.md, 'deploy.toml reference')."


class SSHClientMissing(ConfigError):
    """An SSH or Proxmox target needs OpenSSH's `ssh` client here: it reads the configuration."""

    hint = "Install OpenSSH's client (apt-get install openssh-client)."


class UnsafeValue(DflashError):
    """A value that would reach a remote command cannot be passed literally."""

    hint = "Use a value made of letters, digits, '.', '_', '-' (and '/' for paths)."


class ConnectionFailed(DflashError):
    """The SSH connection could not be opened or was lost."""

    hint = "Check that the host is up and reachable: ssh <host> true"


class AuthenticationFailed(ConnectionFailed):
    """The SSH server refused every key we could offer."""

    hint = (
        "Check the user and key: ssh -v <user>@<host> true (agent, IdentityFile in ~/.ssh/config)."
    )


class HostKeyUnknown(ConnectionFailed):
    """The host's key is not in known_hosts; it is never added silently."""


class HostKeyChanged(ConnectionFailed):
    """The host presents a key different from the one in known_hosts."""


class RemoteCommandFailed(DflashError):
    """A command at a place exited non-zero."""

    def __init__(
        self,
        place: str,
        argv: Sequence[str],
        exit_code: int,
        stderr: str,
        *,
        hint: str | None = None,
    ) -> None:
        self.place = place
        self.argv = tuple(argv)
        self.exit_code = exit_code
        self.stderr = stderr
        super().__init__(
            f"{' '.join(self.argv[:3])}… failed on {place} (exit {exit_code}): {last_line(stderr)}",
            hint=hint,
        )


class PctMissing(DflashError):
    """The host has no `pct`: it is not a Proxmox VE node."""

    hint = 'Point --host at the Proxmox node itself, or use place = "ssh" for a plain host.'


class ContainerNotFound(DflashError):
    """No container with that id exists on the Proxmox host."""

    hint = "List containers on the host with: pct list"


class ContainerStopped(DflashError):
    """The container exists but is not running."""

    hint = "Start it on the host with: pct start <ct>"


class JobNotFound(DflashError):
    """There is no job session at the place."""

    hint = "Start one with: dflash deploy"


class ReleaseError(DflashError):
    """A release could not be built, pushed, switched or found."""


class CheckpointPathError(DflashError):
    """A checkpoint operation would touch a path outside the checkpoints folder."""

    hint = "Check `checkpoints` in deploy.toml: it must be an absolute folder that is not /."


class CheckpointsUnverified(DflashError):
    """The trainer at the place could not say which runs hold a verified checkpoint."""

    hint = "Check the job's python there with: dflash doctor. Nothing was deleted."


class NotConfirmed(DflashError):
    """A deletion was not confirmed: declined, or asked for where nobody can answer."""

    hint = "Pass --yes to go ahead without asking, or --dry-run to see what would go."


class LockHeld(DflashError):
    """Another dflash command holds the place's deploy lock."""

    hint = "Wait for it to finish, or pass --force if its holder is gone."


class CommandTimedOut(DflashError):
    """A command did not finish within its time limit; it was abandoned (and ended if possible)."""

    hint = "Check that the place is not overloaded or waiting for input, then run again."


class JobRunning(DflashError):
    """A job session is already running where a new one would start."""

    hint = "Stop it first with: dflash stop (or use dflash restart)."


class EvaluationError(DflashError):
    """`dflash eval` could not start, or the evaluator at the place failed."""

    hint = "Check the path at the place, then run again (dflash checkpoints lists the runs)."


class GenerationError(DflashError):
    """`dflash generate` could not start: a path at the place is missing or unsafe."""

    hint = "Pass absolute paths at the place: --prompts an existing JSONL file, --out a folder."


class InvalidHostName(ConfigError):
    """A host or user name that OpenSSH itself would refuse (it could run as a shell command)."""

    hint = (
        "Give a host name, an address or a ~/.ssh/config alias: no whitespace, quotes, '$', "
        "'`', ';', '|', '&', '<', '>', brackets of a shell, or a leading '-'."
    )


class HostKeyRevoked(ConnectionFailed):
    """The host presents a key that known_hosts marks `@revoked`."""

    hint = (
        "Do not connect: this key was revoked on purpose. Ask the host's owner for its "
        "current key (and check the @revoked line in known_hosts)."
    )


class ConnectionDropped(ConnectionFailed):
    """The connection went away: the server closed it during the handshake or authentication,
    or an open connection stopped answering its keepalive probes (`reason` says which)."""

    hint = (
        "The SSH server went away mid-handshake (restarted, overloaded: MaxStartups, or a "
        "firewall). Check that sshd runs on the host (ssh -v <host> true), then run again."
    )

    def __init__(self, message: str, *, hint: str | None = None, reason: str = "") -> None:
        super().__init__(message, hint=hint)
        self.reason = reason or message


class NotAnSSHServer(ConnectionFailed):
    """Something answered on the port, but not an SSH server."""

    hint = "Check the port: is it the SSH server's (Port in ~/.ssh/config, --port)?"


class TrainConfigInvalid(DflashError):
    """The trainer's own check (`python -m trainer check`) refused the `[train]` settings at
    the place; nothing there was changed."""

    hint = "Fix [train] in deploy.toml, then run dflash doctor (it runs the same check)."


class ExportError(DflashError):
    """`dflash export` could not start, the exporter at the place failed, or the stream broke."""

    hint = "Check the checkpoint at the place (dflash checkpoints), then run again."


class SetupFailed(DflashError):
    """`dflash setup` could not build the job's venv at the place."""

    hint = "Read pip's lines above, fix what they say, then run dflash setup again."


class Interrupted(DflashError):
    """Ctrl-C (or SIGTERM) stopped a command; the message says what was left at the place."""


class JobEndedAtStartUp(DflashError):
    """The job just started ended with a failure before it was past start-up (its readiness
    line); the message carries the last lines of its log."""

    hint = "Fix what its log says, then start it again (dflash logs --tail 200 shows more)."
