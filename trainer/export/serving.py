"""The command lines that serve an exported drafter as it was trained, for each engine.

The drafter's block attends to itself both ways, so the number of slots an engine fills per step
is part of the drafter's function: B (`block_size` of its `config.json`) for SGLang's
`--speculative-num-draft-tokens`, B − 1 for vLLM's `num_speculative_tokens` (vLLM does not read
`block_size`; another K serves another drafter: docs/serving.md). Torch-free: `dflash export`
prints these lines on the operator's machine.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from trainer.base.errors import TrainerError

# The target's place in the command lines when it is not known where they are printed.
UNKNOWN_TARGET = "TARGET"
AGAIN = "Export the drafter again."


def _config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TrainerError(f"{path}: cannot be read ({exc})", hint=AGAIN) from exc
    if not isinstance(cfg, dict):
        raise TrainerError(f"{path}: not a JSON object", hint=AGAIN)
    return cfg


def block_size(folder: str | Path) -> int:
    """B of an exported folder: the `block_size` of its `config.json`."""
    value = _config(folder).get("block_size")
    if not isinstance(value, int) or isinstance(value, bool) or value < 2:
        raise TrainerError(f"{folder}: block_size {value!r} is not an integer ≥ 2", hint=AGAIN)
    return value


def num_speculative_tokens(folder: str | Path) -> int:
    """vLLM's K for the drafter as trained: B − 1."""
    return block_size(folder) - 1


def serve_commands(drafter: str | Path, target: str, block: int) -> dict[str, str]:
    """Engine name → the shell command line that serves `target` with the drafter at `drafter`
    drafting blocks of `block` (its B), quoted for a POSIX shell."""
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": block - 1}
    sglang = [
        "python", "-m", "sglang.launch_server", "--model-path", target,
        "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(drafter),
        "--speculative-num-draft-tokens", str(block),
    ]  # fmt: skip
    vllm = ["vllm", "serve", target, "--speculative-config", json.dumps(spec)]
    return {"SGLang": shlex.join(sglang), "vLLM": shlex.join(vllm)}


def describe(folder: str | Path, target: str | None) -> str:
    """What `trainer.export.folder` and `dflash export` print after writing `folder`: how to serve it
    against `target` (None: not known here, `TARGET` stands in its place), with the folder's B."""
    block = block_size(folder)
    lines = [f"Serve it (B = {block}, so vLLM's num_speculative_tokens = {block - 1}):"]
    commands = serve_commands(folder, target or UNKNOWN_TARGET, block)
    lines += [f"  {name}: {line}" for name, line in commands.items()]
    if target is None:
        lines.append(f"  ({UNKNOWN_TARGET}: the target model the drafter was trained against)")
    return "\n".join(lines)
