"""Train a DFlash drafter against a frozen target.

    python -m trainer train --config trainer/configs/demo.toml --out runs/demo
    python -m trainer train --config deploy.toml --out /workspace/checkpoints --set optim.lr=3e-4
    DFLASH_TARGET_GPUS=5 torchrun --nproc-per-node 8 -m trainer train --config … --out …

Under torchrun (WORLD_SIZE > 1) the ranks split into target and drafter workers
(`trainer.split.session`); one process trains colocated. Both train through the same loop
(`trainer.run.trainer.Trainer`).

`--config` is a standalone TOML or a deploy.toml (its `[train]` table); `--set key=value`
overrides any setting (dotted keys, TOML values). The run folder `--out` receives checkpoints
(`step-XXXXXXXX/`) and `metrics.jsonl`; starting again resumes from the newest verified
checkpoint there, and refuses one written with other model/data settings unless
`--force-resume` (or `DFLASH_FORCE_RESUME=1`, how `dflash deploy --resume --force-resume` passes
it), and one with another lr schedule (e.g. a raised `run.steps`) unless `--set run.extend=true`.
A run whose checkpoint is already at `run.steps` says there is nothing left to do and exits 0.

SIGINT or SIGTERM: the current step finishes, a checkpoint is saved, exit 0
("stopped at step N, checkpoint saved to …"); a second signal ends it at once (exit 130), as
does the first one before the first step (nothing to save; `trainer.base.stopping`).
Settings reference: docs/training.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from trainer.base.errors import TrainerError
from trainer.base.stopping import StopRequest
from trainer.settings.config import TrainConfig
from trainer.settings.loading import config_options, load_config

FORCE_RESUME_ENV = "DFLASH_FORCE_RESUME"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer train",
        description=__doc__.split("\n")[0],
        parents=[config_options()],
    )
    parser.add_argument("--out", required=True, help="run folder: checkpoints and metrics.jsonl")
    parser.add_argument(
        "--force-resume",
        action="store_true",
        help="resume even if the checkpoint's model/data settings differ",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout, force=True)
    split = int(os.environ.get("WORLD_SIZE", "1")) > 1  # under torchrun: trainer.split.session
    force = args.force_resume or os.environ.get(FORCE_RESUME_ENV, "") == "1"
    if (
        split
    ):  # taken by a watchdog thread (trainer.split.distributed); block before torch starts threads
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    signals = (signal.SIGINT,) if split else (signal.SIGINT, signal.SIGTERM)
    with StopRequest().handling(signals) as stop:
        return _train(args, split=split, force=force, stop=stop)


def _train(args: argparse.Namespace, *, split: bool, force: bool, stop: StopRequest) -> int:
    """Check, then train colocated or as this rank of a split run; the exit code."""
    try:
        config = load_config(args.config, args.overrides)  # fails fast, before torch loads
        if not preflight(config):  # the target folder and the data, before the target loads
            return 2
        if split:
            from trainer.split.roles import roles_from_env
            from trainer.split.session import run_split

            roles = roles_from_env(config=config)  # the same WORLD_SIZE as `split`: not None
            assert roles is not None
            run_split(config, args.out, roles, force_resume=force, stop=stop)
        else:
            from trainer.run.trainer import Trainer

            Trainer(config, args.out, force_resume=force, stop=stop).run()
    except TrainerError as exc:  # its `exit_code`: 0 nothing left to do, 1 a full disk, else 2
        code = getattr(exc, "exit_code", 2)
        if code == 0:
            print(f"{exc}", flush=True)
        else:
            print(f"error: {exc}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print("interrupted; resume by starting again with the same --out", file=sys.stderr)
        return 130
    except OSError as exc:
        print(f"error: {exc.strerror or exc} ({exc.filename or args.out})", file=sys.stderr)
        print(f"hint: {_os_error_hint(exc, args.out)}", file=sys.stderr)
        return 1
    return 0


def preflight(config: TrainConfig) -> bool:
    """`trainer.commands.check`'s verdict on what the config points at; prints each problem."""
    from trainer.commands.check import run_checks

    _, problems = run_checks(config)
    for p in problems:
        print(f"error: {p.key}: {p.message}", file=sys.stderr)
        print(f"hint: {p.hint}", file=sys.stderr)
    return not problems


def _os_error_hint(exc: OSError, out: str) -> str:
    """Under --out (e.g. a full disk) the complete checkpoints stay valid and a new start
    resumes; anywhere else it is a path of the config to fix."""
    name = Path(str(exc.filename)).resolve() if exc.filename else None
    if name is None or Path(out).resolve() in (name, *name.parents):
        return (
            "free space or fix the folder, then start again with the same --out: it resumes "
            "from the newest complete checkpoint"
        )
    return "check that path in the config (model.target, data.path, eval.prompts) and start again"
