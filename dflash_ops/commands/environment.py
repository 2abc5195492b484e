"""`dflash setup`: build the job's environment at the place, the `[venv]` of deploy.toml.

One command at the place (`remote/site.sh venv`), its output streamed here as it comes: create
`<root>/venvs/<key>` from the target's python (`python -m venv`), install the trainer's
requirements into it with pip (torch first from `torch_index`; or everything from the `wheels`
folder, offline), check with ONE `python -c` that every module the trainer imports is there,
then mark it complete. A complete venv is reused: nothing is installed again until the
requirements change (and with them the key). `dflash deploy` runs this when the venv its job
needs is not built yet; a deploy never installs anything else.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from dflash_ops.commands.checks import Setup, python_probe_argv
from dflash_ops.commands.workspace import Workspace
from dflash_ops.errors import ConfigError, RemoteCommandFailed, SetupFailed
from dflash_ops.remote.client import site_argv
from dflash_ops.settings.deploy_config import Target

Say = Callable[[str], None]
NO_VENV, NO_INSTALL, MISSING = 20, 21, 22  # site.sh venv: the step that failed


@dataclass(frozen=True, kw_only=True)
class Built:
    folder: str
    fresh: bool  # built now (False: it was complete already)


def build(ws: Workspace, *, say: Say) -> Built:
    """The target's venv, built at the place unless it is complete; pip's lines go to `say`."""
    target = ws.target
    if target.venv is None:
        raise ConfigError(
            f"No [venv] in {ws.config.path}: there is no environment for dflash setup to build.",
            hint="Add a [venv] table (README.md, deploy.toml reference), or set python in the "
            "target's table to an interpreter that has the trainer's requirements.",
        )
    last, tail = "", b""
    with ws.place.stream(venv_argv(target, Setup.of(ws))) as stream:  # Ctrl-C ends it there
        for chunk in stream:
            lines = (tail + chunk).split(b"\n")
            tail = lines.pop()
            for line in lines:
                last = line.decode("utf-8", "replace")
                say(last)
    if tail:
        last = tail.decode("utf-8", "replace")
        say(last)
    code = stream.exit_code or 0
    if code != 0:
        raise failed(target, code, stream.stderr.decode("utf-8", "replace"), last)
    return Built(folder=target.venv.folder, fresh="is built already" not in last)


def venv_argv(target: Target, setup: Setup) -> list[str]:
    """`site.sh venv` with what the venv is built from, and the trainer's modules checked."""
    venv = target.venv
    assert venv is not None
    options = [
        ("venv", venv.folder),
        ("python", venv.base),
        ("requirements", venv.config.requirements),
    ]
    if venv.config.torch_index is not None and venv.config.torch is not None:
        options += [("torch-index", venv.config.torch_index), ("torch", venv.config.torch)]
    if venv.config.wheels is not None:
        options.append(("wheels", venv.config.wheels))
    if venv.config.system_site_packages:
        options.append(("system-site", "1"))
    options += [("probe", word) for word in python_probe_argv(setup)]
    return site_argv("venv", options)


def failed(target: Target, code: int, stderr: str, last: str) -> SetupFailed | RemoteCommandFailed:
    """The error of a failed build, by the step that failed (site.sh's exit code)."""
    assert target.venv is not None
    where, folder, base = target.describe(), target.venv.folder, target.venv.base
    why = next((x for x in reversed(stderr.splitlines()) if x.strip()), "no error output")
    if code == NO_VENV:
        return SetupFailed(
            f"{base} could not create the venv {folder} on {where}: {why}",
            hint="The base python needs its venv module there: apt-get install python3-venv "
            "(Debian, Ubuntu), or set python in the target's table to another interpreter.",
        )
    if code == NO_INSTALL:
        return SetupFailed(
            f"pip could not install the requirements into {folder} on {where}: {why}",
            hint="For a node without network, copy the wheels (a CUDA torch among them) to a "
            "folder there and set [venv] wheels to it; else check [venv] torch_index and the "
            "node's network (pip's lines above).",
        )
    if code == MISSING:
        try:
            missing = ", ".join(json.loads(last).get("missing", []))
        except (ValueError, AttributeError):
            missing = last
        return SetupFailed(
            f"The venv {folder} on {where} lacks {missing} after the install, which the "
            "trainer imports.",
            hint="Add the distributions that provide them to [venv] packages (or to "
            "trainer/requirements.txt), then dflash setup again.",
        )
    return RemoteCommandFailed(where, ("dflash-venv", folder), code, stderr)
