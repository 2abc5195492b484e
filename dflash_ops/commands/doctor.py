"""`dflash doctor`: a checklist run at the place, each line passed or failed with its fix.

The seed lost runs to things a half-minute check catches. Each check is a small function that
looks at one thing through the place and returns a `Check(name, ok, detail, fix)`; `diagnose`
runs them in order and marks as skipped the ones whose premise failed (no python → no torch
check). Checks never raise for what they find: an error on the way (a dropped connection, a
refused host key) becomes a failed check carrying the error's own message and hint, so
`dflash doctor` and deploy's preflight (the same probes inside its one command, judged by the
same functions: `remote/client.py`) say the same words.

Order and dependencies:

    reachable (ssh/proxmox) → container (proxmox) → tmux, python → imports, torch → cuda → gpu count
                                                  → checkpoints, target model
                                         python → train config (trainer.commands.check on the bundle)
                                                  → smoke (torch; ships trainer/ to a scratch folder)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dflash_ops.commands.checks import (
    DEFAULT_MIN_FREE_GIB,
    Check,
    Findings,
    Setup,
    check_checkpoints,
    check_container,
    check_cuda,
    check_gpu_count,
    check_imports,
    check_model,
    check_python,
    check_reachable,
    check_tmux,
    check_torch,
    from_error,
    judge_imports,
    judge_python,
    judge_tmux,
    python_probe_argv,
)
from dflash_ops.commands.probes import version_probe
from dflash_ops.commands.smoke_check import check_smoke, smoke_check
from dflash_ops.commands.train_check import (
    CHECK_TIMEOUT,
    applies,
    check_argv,
    check_train_config,
    invalid,
)
from dflash_ops.connect.place import Place
from dflash_ops.connect.transport import Result
from dflash_ops.errors import DflashError
from dflash_ops.remote.client import Preflight
from dflash_ops.settings.deploy_config import Target

__all__ = ["DEFAULT_MIN_FREE_GIB", "Check", "Setup", "diagnose", "smoke_check"]
log = logging.getLogger(__name__)

CheckFn = Callable[[Setup, Place, Findings], Check]


@dataclass(frozen=True)
class Step:
    name: str
    run: CheckFn
    needs: tuple[str, ...] = ()


# --- running them ------------------------------------------------------------------------------


def plan(target: Target, *, gpu_smoke: bool = True) -> list[Step]:
    """The checks that apply to this kind of place, in order, with what each needs."""
    steps: list[Step] = []
    base: tuple[str, ...] = ()
    if target.place != "local":
        steps.append(Step("ssh", check_reachable))
        base = ("ssh",)
    if target.place == "proxmox":
        steps.append(Step("container", check_container, base))
        base = (*base, "container")
    steps += [
        Step("tmux", check_tmux, base),
        Step("python", check_python, base),
        Step("imports", check_imports, (*base, "python")),
        Step("torch", check_torch, (*base, "python")),
        Step("cuda", check_cuda, (*base, "python", "torch")),
        Step("gpu count", check_gpu_count, (*base, "python", "torch", "cuda")),
        Step("checkpoints", check_checkpoints, base),
        Step("target model", check_model, base),
        Step("train config", check_train_config, (*base, "python")),
    ]
    if gpu_smoke:
        steps.append(Step("gpu smoke test", check_smoke, (*base, "python", "torch")))
    return steps


def diagnose(
    setup: Setup,
    place: Place,
    *,
    gpu_smoke: bool = True,
    on_check: Callable[[Check], None] | None = None,
    steps: Sequence[Step] | None = None,
) -> list[Check]:
    """Run the checks in order; a check whose premise failed is reported as skipped."""
    found = Findings()
    results: dict[str, Check] = {}
    for step in steps if steps is not None else plan(setup.target, gpu_smoke=gpu_smoke):
        broken = [n for n in step.needs if n in results and not results[n].ok]
        if broken:
            check = Check(
                name=step.name, ok=False, detail=f"skipped: needs {broken[0]}", skipped=True
            )
        else:
            try:
                check = step.run(setup, place, found)
            except DflashError as exc:
                check = from_error(step.name, exc)
        results[step.name] = check
        log.debug("check %s: %s", step.name, check.status, extra={"place": place.description})
        if on_check is not None:
            on_check(check)
    return list(results.values())


class PreflightFailed(DflashError):
    """tmux or python failed deploy's preflight; the message is the check's, the hint its fix."""


class VenvNotBuilt(PreflightFailed):
    """The job's python is a `[venv]` that is not built at the place yet (`dflash setup`)."""


def deploy_preflight(setup: Setup, where: str) -> Preflight:
    """What deploy checks inside its one command before anything changes, in doctor's words:
    `tmux -V` and the job's python answering the version probe (judged by `judge_tmux` and
    `judge_python`), then the trainer's check of `[train]` in the unpacked release."""

    def failed(step: str, result: Result) -> DflashError:
        if step == "tmux":
            return failure(judge_tmux(setup, where, result))
        found = Findings()
        python = judge_python(setup, where, result, found)
        if not python.ok and setup.target.venv is not None and result.exit_code in (126, 127):
            return VenvNotBuilt(f"python: {python.detail}", hint=python.fix)
        return failure(python if not python.ok else judge_imports(setup, found))

    return Preflight(
        probe=python_probe_argv(setup, version_probe(count_gpus=setup.job.gpus == 0)),
        check=check_argv(setup) if applies(setup) else [],
        failed=failed,
        invalid=lambda code, lines: invalid(where, code, lines, config=setup.config_file),
        check_seconds=CHECK_TIMEOUT,
    )


def failure(check: Check) -> PreflightFailed:
    """The error `dflash deploy` stops with when `check` failed: its detail and its fix."""
    return PreflightFailed(f"{check.name}: {check.detail}", hint=check.fix)


def all_ok(checks: Sequence[Check]) -> bool:
    return all(c.ok for c in checks)
