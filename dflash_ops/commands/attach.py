"""`dflash attach`: the job's tmux pane on this terminal, through the tools a person would use.

The command to hand the terminal to (`attach_argv`), built from the resolved target:
- local: `tmux -L <socket> attach-session -t =<session>`;
- ssh: `ssh -t [-F FILE] -p PORT USER@HOST 'tmux -L … attach-session -t …'`, with the config
  file, port and user dflash itself used (`ssh_config.ssh_command`);
- proxmox: the same ssh to the node, running `pct exec <ct> --keep-env 0 -- env TERM=… tmux …`
  (pct clears the environment, and tmux needs to know the terminal).
The job's session must exist first; its output goes to its log, not to the pane.
"""

from __future__ import annotations

import os

from dflash_ops.commands.workspace import Workspace
from dflash_ops.connect.place import ContainerPlace
from dflash_ops.connect.shell import env_value
from dflash_ops.connect.ssh_config import SSHTarget, ssh_command
from dflash_ops.errors import JobNotFound
from dflash_ops.remote.job import JobState

DETACH = "Ctrl-b d"  # tmux's default prefix, then d


def attach_argv(ws: Workspace, *, term: str | None = None) -> list[str]:
    """What to exec here to attach this terminal to the job's pane."""
    tmux = ws.job().attach_argv()
    if ws.target.place == "local":
        return tmux
    place = ws.place
    if isinstance(place, ContainerPlace):
        term = term or os.environ.get("TERM") or "xterm-256color"
        tmux = place.pct_argv(["env", f"TERM={env_value(term)}", *tmux])
    target = getattr(place.transport, "target", None)
    assert isinstance(target, SSHTarget)
    return ssh_command(target, tmux, tty=True)


def session(ws: Workspace) -> JobState:
    """The job's session, which must exist (running, or kept after it exited)."""
    state = ws.job().state()
    if not state.exists:
        raise JobNotFound(
            f"No job session {ws.config.job.session!r} on {ws.target.describe()}: nothing to "
            "attach to."
        )
    return state
