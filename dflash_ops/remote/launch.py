"""The generated `launch.sh` of a release: how the job starts, written down in the release.

The script is the one thing the tmux session runs (`bash <root>/current/launch.sh`). It moves to
its own release folder, exports what the job needs to know about itself (and, with `[job] gpus = 0`,
an empty `CUDA_VISIBLE_DEVICES`: a CPU job sees no GPU), and `exec`s the trainer
— `python -m trainer train --config train.toml --out <checkpoints>`, under torchrun
(`trainer.commands.launcher`: torchrun that exits 0 when the workers stopped gracefully on a signal, and
waits `[job] stop_timeout` + 10 s for them) when the job has more than one GPU: `--standalone` on one
node, a c10d rendezvous at `[job] rendezvous` shared by every node when `[job] nodes` > 1 (each
node runs the same script) — or, when `[job] command`
is set, the user's own command, which is kept verbatim in `command.sh` and run by `bash -c`. The
user's text is never pasted into our script; the few values we do write (paths, the interpreter)
go through `shell.quote`.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflash_ops.connect.shell import env_key, env_value, quote, quote_argv

if TYPE_CHECKING:
    from dflash_ops.settings.job_config import JobConfig

COMMAND_FILE = "command.sh"
HIDE_GPUS = "CUDA_VISIBLE_DEVICES"  # set empty for `[job] gpus = 0`: CUDA then lists no device
TRAIN_CONFIG = "train.toml"


def verb(name: str, *args: str, config: bool = True) -> list[str]:
    """A trainer verb's argv after the interpreter (or torchrun): `-m trainer NAME`, then the
    release's `--config train.toml` (every verb that reads the config), then `args` — the one
    shape every command that runs the trainer builds."""
    return ["-m", "trainer", name, *(["--config", TRAIN_CONFIG] if config else []), *args]


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """Everything the launch script depends on."""

    release_id: str
    python: str
    checkpoints: str
    gpus: int = 0  # per node
    target_gpus: int = 0  # of all nodes together
    nodes: int = 1
    rendezvous: str | None = None  # "host:port", when nodes > 1
    rdzv_id: str = "dflash"  # the same on every node: the job's session name
    command: str | None = None
    tool: tuple[str, ...] = ()  # replaces `-m trainer train …` (e.g. `-m trainer generate …`)
    stop_timeout: float = 30.0  # how long `dflash stop` waits after SIGINT

    @classmethod
    def for_job(
        cls,
        job: JobConfig,
        *,
        release_id: str,
        python: str,
        checkpoints: str,
        tool: tuple[str, ...] = (),
    ) -> LaunchPlan:
        """The plan of `[job]` (GPUs, split, nodes, rendezvous, command) for one release."""
        return cls(
            release_id=release_id,
            python=python,
            checkpoints=checkpoints,
            gpus=job.gpus,
            target_gpus=job.target_gpus,
            nodes=job.nodes,
            rendezvous=job.rendezvous,
            rdzv_id=job.session,
            command=job.command,
            tool=tool,
            stop_timeout=job.stop_timeout,
        )

    @property
    def world_size(self) -> int:
        return max(self.gpus, 1) * self.nodes


def trainer_argv(plan: LaunchPlan) -> list[str]:
    """The trainer's argv: `python -m trainer train …`, or torchrun over `gpus` processes per
    node — standalone on one node, meeting the other nodes at the rendezvous otherwise."""
    args = list(plan.tool) or verb("train", "--out", plan.checkpoints)
    torchrun = [plan.python, *verb("launch", config=False)]
    per_node = ["--nproc-per-node", str(max(plan.gpus, 1))]
    if plan.nodes > 1:
        if plan.rendezvous is None:
            raise ValueError("a launch over several nodes needs a rendezvous endpoint")
        return [
            *torchrun, "--nnodes", str(plan.nodes), *per_node, "--rdzv-backend", "c10d",
            "--rdzv-endpoint", plan.rendezvous, "--rdzv-id", plan.rdzv_id, *args,
        ]  # fmt: skip
    if plan.gpus > 1:
        return [*torchrun, "--standalone", *per_node, *args]
    return [plan.python, *args]


# Enter a folder, then run argv as given: every value stays a literal argv element.
_IN_FOLDER = 'cd -P -- "$1" && shift && exec "$@"'


def in_release(
    release: str, env: Mapping[str, str], argv: Sequence[str], *, name: str
) -> list[str]:
    """`bash -c 'cd <release>; exec env K=V… argv…'` as one argv: how a foreground tool of the
    trainer (`trainer.evaluation.evaluate`, `trainer.commands.plan`) runs with a release's code, config and the
    job's environment. `name` is the script's `$0` (shown by `ps`)."""
    pairs = [f"{env_key(k)}={env_value(v)}" for k, v in env.items()]
    return ["bash", "-c", _IN_FOLDER, name, release, "env", *pairs, *argv]


# Run argv as the job runs: the K=V words before `--` exported, the job's python's folder ($2,
# when it names one) first on PATH, inside the release ($1). Every value stays a literal word.
_IN_JOB = (
    "release=$1 first=$2; shift 2\n"
    'while [ "$#" -gt 0 ] && [ "$1" != -- ]; do export "${1?}"; shift; done\n'
    "shift\n"
    '[ -z "$first" ] || PATH=$first${PATH:+:$PATH}\n'
    "export PATH\n"
    'cd -P -- "$release" || exit 126\n'
    'exec "$@"\n'
)


def in_job(
    plan: LaunchPlan, release: str, env: Mapping[str, str], argv: Sequence[str]
) -> list[str]:
    """argv run at the place as inside the job of `plan`: in `release`, with `[job] env` (`env`)
    and what `launch.sh` exports (`exports`), the job's python's folder first on PATH."""
    merged = {**env, **exports(plan)}
    pairs = [f"{env_key(k)}={env_value(v)}" for k, v in merged.items()]
    first = posixpath.dirname(plan.python) if "/" in plan.python else ""
    return ["bash", "-c", _IN_JOB, "dflash-exec", release, first, *pairs, "--", *argv]


def exports(plan: LaunchPlan) -> dict[str, str]:
    """What `launch.sh` exports for the job (after `[job] env`, so these win)."""
    exported = {
        "DFLASH_RELEASE": plan.release_id,
        "DFLASH_CHECKPOINTS": plan.checkpoints,
        "DFLASH_PYTHON": plan.python,
        "DFLASH_STOP_TIMEOUT": f"{plan.stop_timeout:g}",
    }
    if plan.gpus == 0:  # a CPU job: with no GPU visible, the trainer's run.device "auto" is the CPU
        exported[HIDE_GPUS] = ""
    if plan.nodes > 1:
        exported["DFLASH_NODES"] = str(plan.nodes)
    if plan.world_size > 1 and plan.target_gpus > 0:
        exported["DFLASH_TARGET_GPUS"] = str(plan.target_gpus)
    return exported


def render(plan: LaunchPlan) -> str:
    """The text of `launch.sh`."""
    lines = [
        "#!/usr/bin/env bash",
        f"# Generated by `dflash deploy` for release {plan.release_id}. Runs from its own folder.",
        "set -euo pipefail",
        'cd -P -- "$(dirname -- "${BASH_SOURCE[0]}")"',
        *(f"export {k}={quote(v)}" for k, v in exports(plan).items()),
    ]
    if plan.command is not None and not plan.tool:
        lines.append(f'exec bash -c "$(<{COMMAND_FILE})" dflash-command')
    else:
        lines.append("exec " + quote_argv(trainer_argv(plan)))
    return "\n".join(lines) + "\n"
