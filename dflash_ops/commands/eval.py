"""`dflash eval`: run `python -m trainer.evaluate` at the place, in the current release.

The evaluator runs in the foreground (not in the job's tmux session), from `<root>/current` with
the target's python and the `[job] env`, on the release's own `train.toml`, so it judges the
drafter with exactly the code and settings that trained it. Its stdout streams back as it comes;
its stderr is read at the end (its last line is the one-line error of a failed run).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dflash_ops.commands.workspace import Workspace
from dflash_ops.connect import shell
from dflash_ops.connect.transport import StreamResult
from dflash_ops.errors import EvaluationError
from dflash_ops.remote.launch import TRAIN_CONFIG, in_release
from dflash_ops.untrusted import last_line

# A bare checkpoint name (`step-00000300`, or a run folder's name) resolves inside the
# checkpoints folder; anything with a slash must be an absolute path at the place.
_BARE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True, kw_only=True)
class EvalRequest:
    prompts: str  # a JSONL path at the place
    checkpoint: str | None = None  # None: the checkpoints folder (its newest verified one)
    max_new_tokens: int | None = None
    limit: int | None = None
    as_json: bool = False
    baseline: str | None = None  # "prompt-lookup" | "none"; None: the evaluator's default
    batch_tokens: int | None = None  # prompts decoded together; None: the evaluator's default


def checkpoint_path(ws: Workspace, checkpoint: str | None) -> str:
    """The checkpoint folder at the place that `checkpoint` names."""
    folder = ws.target.checkpoints
    if checkpoint is None:
        return folder
    if _BARE_NAME.fullmatch(checkpoint) and checkpoint not in (".", ".."):
        return f"{folder}/{checkpoint}"
    return shell.remote_path(checkpoint)


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
    """`bash -c 'cd current; exec …' env K=V… python -m trainer.evaluate …` as one argv."""
    args = [
        ws.target.python, "-m", "trainer.evaluate", "--config", TRAIN_CONFIG,
        "--checkpoint", checkpoint, "--prompts", request.prompts,
    ]  # fmt: skip
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
    ws.releases().require_current()  # ReleaseError: "Deploy first"
    prompts = prompts_path(ws, request.prompts)
    checkpoint = checkpoint_path(ws, request.checkpoint)
    _require(
        ws, "-f", prompts, "The prompts file",
        "Pass --prompts with a JSONL file at the place (the training formats).",
    )  # fmt: skip
    _require(
        ws, "-d", checkpoint, "The checkpoint",
        "List them with: dflash checkpoints (a step-XXXXXXXX name, or an absolute path).",
    )  # fmt: skip
    request = EvalRequest(
        prompts=prompts,
        checkpoint=checkpoint,
        max_new_tokens=request.max_new_tokens,
        limit=request.limit,
        as_json=request.as_json,
        baseline=request.baseline,
        batch_tokens=request.batch_tokens,
    )
    return ws.place.stream(evaluator_argv(ws, request, checkpoint=checkpoint))


def failure(ws: Workspace, stream: StreamResult) -> EvaluationError:
    """The error of a finished evaluator run that exited non-zero: its last stderr line."""
    detail = last_line(stream.stderr.decode("utf-8", "backslashreplace"))
    return EvaluationError(
        f"The evaluator failed on {ws.target.describe()} (exit {stream.exit_code}): {detail}",
        hint="Fix what it names, then run again (python -m trainer.evaluate --help at the place).",
    )
