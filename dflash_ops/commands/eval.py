"""`dflash eval`: run `python -m trainer evaluate` at the place, in the current release.

The evaluator runs in the foreground (not in the job's tmux session), from `<root>/current` with
the target's python and the `[job] env`, on the release's own `train.toml`, so it judges the
drafter with exactly the code and settings that trained it. Its stdout streams back as it comes;
its stderr is read at the end (its last line is the one-line error of a failed run).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from dflash_ops.commands.workspace import Workspace
from dflash_ops.connect import shell
from dflash_ops.connect.transport import StreamResult
from dflash_ops.errors import CheckpointPathError, DflashError, EvaluationError
from dflash_ops.remote.checkpoints import ARCHIVE, RUN_PATTERN
from dflash_ops.remote.launch import in_release, verb
from dflash_ops.untrusted import last_line

# A checkpoint named relative to the checkpoints folder: `step-00000300`, an archived run's UTC
# time (`20260102T030405.678Z`, in `archive/`), `<time>/step-…`, `archive/<time>[/step-…]`.
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_RUN = re.compile(RUN_PATTERN)
# Prints how folder $1 holds checkpoints: "missing", "ok" (a checkpoint, or a run folder with
# one), else "empty" and one "run <name>" line per run in $2 (archive/) that holds one, oldest
# first (the names sort by time).
_FIND = r"""c=$1 archive=$2
[ -d "$c" ] || { echo missing; exit 0; }
[ -f "$c/manifest.json" ] && { echo ok; exit 0; }
for m in "$c"/step-*/manifest.json; do [ -f "$m" ] && { echo ok; exit 0; }; done
echo empty
for m in "$archive"/*/step-*/manifest.json; do
  [ -f "$m" ] || continue
  r=${m%/step-*/manifest.json}; echo "run ${r##*/}"
done
"""


@dataclass(frozen=True, kw_only=True)
class EvalRequest:
    prompts: str | None = None  # a JSONL path at the place; None: the evaluator's default
    checkpoint: str | None = None  # None: the checkpoints folder (its newest verified one)
    max_new_tokens: int | None = None
    limit: int | None = None
    as_json: bool = False
    baseline: str | None = None  # "prompt-lookup" | "none"; None: the evaluator's default
    batch_tokens: int | None = None  # prompts decoded together; None: the evaluator's default


def checkpoint_path(ws: Workspace, checkpoint: str | None) -> str:
    """The checkpoint folder at the place that `checkpoint` names: the checkpoints folder by
    default (its newest verified checkpoint), a name inside it (an archived run by its UTC time:
    `archive/` is implied), or an absolute path at the place."""
    folder = ws.target.checkpoints
    if checkpoint is None:
        return folder
    if checkpoint.startswith("/"):
        return shell.remote_path(checkpoint)
    parts = checkpoint.split("/")
    if not all(_NAME.fullmatch(part) and part not in (".", "..") for part in parts):
        raise CheckpointPathError(
            f"--checkpoint {checkpoint!r} is neither a name in {folder} nor an absolute path.",
            hint="Pass step-XXXXXXXX, an archived run's UTC time (dflash checkpoints lists them), "
            "or an absolute path at the place.",
        )
    if _RUN.fullmatch(parts[0]):
        parts = [ARCHIVE, *parts]
    return "/".join([folder, *parts])


def require_checkpoint(
    ws: Workspace, checkpoint: str | None, error: type[DflashError] = EvaluationError
) -> str:
    """The path `checkpoint` names, once the place shows it holds a checkpoint; else `error`
    saying so, and — for a folder without any, such as the live one after a fresh deploy
    archived the run that trained — which archived run holds one."""
    path = checkpoint_path(ws, checkpoint)
    archive = f"{ws.target.checkpoints}/{ARCHIVE}"
    found = ws.place.run(["bash", "-c", _FIND, "dflash-find", path, archive], check=False)
    said = found.stdout_text.split()
    where = ws.target.describe()
    if said[:1] == ["ok"]:
        return path
    if said[:1] == ["missing"] or found.exit_code != 0:
        raise error(
            f"The checkpoint {path} does not exist on {where}.",
            hint="List them with: dflash checkpoints (a step-XXXXXXXX name, an archived run's "
            "UTC time, or an absolute path).",
        )
    runs = [name for kind, name in zip(said[1::2], said[2::2], strict=False) if kind == "run"]
    runs = [name for name in runs if _RUN.fullmatch(name)]
    moved = " (a fresh deploy or restart --clean archives the run that trained)"
    hint = (
        f"Take the newest archived run's: --checkpoint {runs[-1]} (dflash checkpoints lists them)."
        if runs
        else "Train until a checkpoint is saved (dflash logs --follow), or pass --checkpoint."
    )
    raise error(
        f"No checkpoint in {path} on {where}{moved if path == ws.target.checkpoints else ''}.",
        hint=hint,
    )


def prompts_path(ws: Workspace, given: str) -> str:
    """The prompts file at the place: a relative path is taken from the current folder when the
    place is this machine; elsewhere the evaluator has no current folder of ours to start from."""
    if not given.startswith("/"):
        if ws.target.place != "local":
            raise EvaluationError(
                f"--prompts {given} is a relative path, and the evaluator runs on "
                f"{ws.target.describe()}.",
                hint="Pass the file's absolute path there, e.g. --prompts /data/heldout.jsonl",
            )
        given = str(Path.cwd() / given)
    return shell.remote_path(given)


def evaluator_argv(ws: Workspace, request: EvalRequest, *, checkpoint: str) -> list[str]:
    """`bash -c 'cd current; exec …' env K=V… python -m trainer evaluate …` as one argv."""
    args = [
        ws.target.python, *verb("evaluate", "--checkpoint", checkpoint),
    ]  # fmt: skip
    if request.prompts is not None:
        args += ["--prompts", request.prompts]
    if request.max_new_tokens is not None:
        args += ["--max-new-tokens", str(request.max_new_tokens)]
    if request.limit is not None:
        args += ["--limit", str(request.limit)]
    if request.baseline is not None:
        args += ["--baseline", request.baseline]
    if request.batch_tokens is not None:
        args += ["--batch-tokens", str(request.batch_tokens)]
    if request.as_json:
        args.append("--json")
    current = f"{ws.target.root}/current"
    return in_release(current, ws.config.job.env, args, name="dflash-eval")


def _require(ws: Workspace, test: str, path: str, what: str, hint: str) -> None:
    found = ws.place.run(["test", test, path], check=False)
    if found.exit_code != 0:
        raise EvaluationError(f"{what} {path} does not exist on {ws.target.describe()}.", hint=hint)


def start(ws: Workspace, request: EvalRequest) -> StreamResult:
    """Check what the evaluator needs, then start it; the caller drains the stream."""
    ws.releases().require_trainer("dflash eval")  # ReleaseError: "Deploy first", no entry
    prompts = None
    if request.prompts is not None:
        prompts = prompts_path(ws, request.prompts)
        _require(
            ws, "-f", prompts, "The prompts file",
            "Pass --prompts with a JSONL file at the place (the training formats).",
        )  # fmt: skip
    checkpoint = require_checkpoint(ws, request.checkpoint, EvaluationError)
    request = dataclasses.replace(request, prompts=prompts, checkpoint=checkpoint)
    return ws.place.stream(evaluator_argv(ws, request, checkpoint=checkpoint))


FIX_HINT = (
    "Fix what it names, then run again; dflash checkpoints lists the checkpoints and the "
    "archived runs (--checkpoint step-XXXXXXXX, or an archived run's UTC time)."
)


def failure(ws: Workspace, stream: StreamResult) -> EvaluationError:
    """The error of a finished evaluator run that exited non-zero: its last stderr line."""
    detail = last_line(stream.stderr.decode("utf-8", "backslashreplace"))
    return EvaluationError(
        f"The evaluator failed on {ws.target.describe()} (exit {stream.exit_code}): {detail}",
        hint=FIX_HINT,
    )
