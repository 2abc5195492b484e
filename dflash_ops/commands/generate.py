"""`dflash generate`: the target answers prompts at the place, as the job in tmux.

Generation is long (hours for hundreds of thousands of prompts), so it runs like a training run:
a release whose `launch.sh` runs `python -m trainer generate` (torchrun over `[job] gpus`, one
shard of the prompts per rank) instead of `trainer.commands.train`, started in the job's tmux session by
the same one-command deploy (`operations.deploy` with `tool`). It survives a dropped connection,
shows in `dflash logs`/`status`, stops with `dflash stop`, and `dflash restart` resumes it
(finished shards are skipped). The checkpoints are never archived by it; the output folder must
lie outside the checkpoints folder, which the next `dflash deploy` archives.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from dflash_ops.commands import operations
from dflash_ops.commands.workspace import Workspace
from dflash_ops.connect import shell
from dflash_ops.errors import GenerationError
from dflash_ops.remote.launch import verb

# request field → trainer.generation.generate flag, for the optional values passed through as given
_FLAGS = {
    "max_new_tokens": "--max-new-tokens",
    "batch_size": "--batch-size",
    "engine": "--engine",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "sampled_prefix": "--sampled-prefix",
    "seed": "--seed",
    "shard_size": "--shard-size",
    "limit": "--limit",
}


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    prompts: tuple[str, ...]  # JSONL paths at the place
    out: str  # the shard folder at the place
    max_new_tokens: int | None = None
    batch_size: int | None = None
    engine: str | None = None  # trainer.generation.decode's engine: auto, static or dynamic
    temperature: float | None = None
    top_p: float | None = None
    sampled_prefix: int | None = None  # first N answer tokens sampled, then greedy
    seed: int | None = None
    shard_size: int | None = None
    limit: int | None = None
    enable_thinking: bool | None = None
    strict: bool = False

    def tool(self) -> tuple[str, ...]:
        """The job's `-m trainer generate …` arguments (after the interpreter or torchrun)."""
        args = verb("generate", "--out", self.out)
        for path in self.prompts:
            args += ["--prompts", path]
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _FLAGS and value is not None:
                args += [_FLAGS[f.name], str(value)]
        if self.enable_thinking is not None:
            args.append("--enable-thinking" if self.enable_thinking else "--disable-thinking")
        if self.strict:
            args.append("--strict")
        return tuple(args)


def checked(ws: Workspace, request: GenerateRequest) -> GenerateRequest:
    """The request with normalised paths, each prompt file present at the place, `out` not in
    the checkpoints folder."""
    if not request.prompts:
        raise GenerationError("No prompt file given.", hint="Pass --prompts PATH (repeatable).")
    prompts = tuple(shell.remote_path(p) for p in request.prompts)
    out = shell.remote_path(request.out)
    checkpoints = shell.remote_path(ws.target.checkpoints)
    if out == checkpoints or out.startswith(checkpoints + "/"):
        raise GenerationError(
            f"--out {out} is inside the checkpoints folder {checkpoints}, which the next "
            f"`dflash deploy` archives.",
            hint="Pass an --out outside it, e.g. /workspace/data/gen.",
        )
    for path in prompts:
        if ws.place.run(["test", "-f", path], check=False).exit_code != 0:
            raise GenerationError(
                f"The prompts file {path} does not exist on {ws.target.describe()}."
            )
    return GenerateRequest(**{**vars(request), "prompts": prompts, "out": out})


def start(
    ws: Workspace,
    request: GenerateRequest,
    *,
    force: bool = False,
    say: operations.Say = operations._quiet,
    warn: operations.Say | None = None,
) -> operations.DeployReport:
    """Deploy a release whose job is the generation and start it (checkpoints kept as they are)."""
    request = checked(ws, request)
    return operations.deploy(ws, resume=True, force=force, say=say, warn=warn, tool=request.tool())
