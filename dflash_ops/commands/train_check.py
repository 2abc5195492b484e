"""The trainer's own check of `[train]` (`python -m trainer check`), run at the place.

`dflash deploy` runs it inside its one command on the release it has just unpacked, before
`current` moves or the running job stops (`remote/site.sh`, step `check`); `dflash doctor` runs
it on the bundle about to be pushed, in a scratch folder. Both run the job's python with the
job's environment in the release's folder, so relative paths, the interpreter and its packages
are the job's own. The check's `error:`/`hint:` lines become one `TrainConfigInvalid`.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from pathlib import Path

from dflash_ops.commands.checks import Check, Findings, Setup, failed, job_argv, passed
from dflash_ops.commands.smoke_check import run_in_scratch, trainer_tar
from dflash_ops.connect import shell
from dflash_ops.connect.place import Place
from dflash_ops.errors import TrainConfigInvalid
from dflash_ops.remote.launch import TRAIN_CONFIG, verb
from dflash_ops.settings import toml_writer

NAME = "train config"
CHECK_TIMEOUT = 300.0  # a chat file loads the target's tokenizer (transformers, torch)


def applies(setup: Setup) -> bool:
    """Whether `[train]` is the trainer's config: always, except an empty `[train]` beside a
    `[job] command` (that command may give the trainer its settings some other way)."""
    return bool(setup.train) or setup.job.command is None


def check_argv(setup: Setup) -> list[str]:
    """The job's python running the check of the release's `train.toml`."""
    return job_argv(setup, [setup.target.python, *verb("check")])


def invalid(
    where: str, code: int, lines: Sequence[str], *, config: Path | str = "deploy.toml"
) -> TrainConfigInvalid:
    """The error of a failed check from its output: each problem (key, file) and each fix, in
    the words of `config`, the file whose `[train]` table it checked (the trainer's own hints
    speak of its command line: `--set KEY=VALUE` is not an option of dflash)."""
    problems = [_unprefix(line, "error: ") for line in lines if line.startswith("error: ")]
    hints = [_fix(_unprefix(line, "hint: "), config) for line in lines if line.startswith("hint: ")]
    if not problems:  # it crashed: the last lines say why
        problems = [line for line in lines if line.strip()][-3:] or [f"exit {code}"]
    message = f"[train] fails the trainer's check at {where}; nothing there changed:\n  " + (
        "\n  ".join(problems)
    )
    last = f"Fix [train] in {config}, then run dflash doctor (it runs the same check)."
    return TrainConfigInvalid(message, hint=" ".join([*dict.fromkeys(hints), last]))


def _fix(hint: str, config: Path | str) -> str:
    """A trainer hint as dflash's user acts on it: the key is changed in `[train]` of `config`
    (the trainer's `--set KEY=VALUE` is its own command line's)."""
    if "--set" in hint:
        return f"Change that key under [train] in {config}."
    return hint


def _unprefix(line: str, prefix: str) -> str:
    """`error: train.toml: KEY: …` → `[train] KEY: …` (train.toml is the [train] table)."""
    text = line.removeprefix(prefix)
    return (
        "[train] " + text.removeprefix(f"{TRAIN_CONFIG}: ")
        if text.startswith(TRAIN_CONFIG)
        else text
    )


def check_train_config(setup: Setup, place: Place, _: Findings) -> Check:
    """Ship trainer/ and the `[train]` table as train.toml to a scratch folder next to the
    releases, and run the check there with the job's python."""
    trainer = (setup.project_dir or Path.cwd()) / "trainer"
    if not applies(setup):
        return passed(NAME, "[train] is empty and [job] command runs: nothing to check")
    if not (trainer / "commands" / "check.py").is_file() and setup.job.command is not None:
        return passed(NAME, "no trainer/ in the project: [job] command runs instead")
    if not (trainer / "commands" / "check.py").is_file():
        return failed(
            NAME,
            f"no trainer to check with: {trainer / 'commands' / 'check.py'} does not exist",
            "Run dflash doctor in the project folder (next to deploy.toml and trainer/).",
        )
    scratch = shell.remote_path(f"{setup.target.root}/doctor/{secrets.token_hex(4)}")
    files = {TRAIN_CONFIG: toml_writer.dumps(setup.train).encode()}
    result = run_in_scratch(
        place,
        scratch,
        trainer_tar(trainer, files),
        check_argv(setup),
        timeout=max(CHECK_TIMEOUT, place.timeout),
    )
    lines = (result.stdout_text + result.stderr_text).splitlines()
    if result.exit_code != 0:
        error = invalid(place.description, result.exit_code, lines, config=setup.config_file)
        return failed(
            NAME, str(error.args[0]).split(":\n  ", 1)[-1].replace("\n  ", "; "), error.hint
        )
    done = [line.removeprefix("ok: ") for line in lines if line.startswith("ok: ")]
    return passed(NAME, "; ".join(done) or "ok")
