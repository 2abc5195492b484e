"""Train a DFlash drafter against a frozen target.

    python -m trainer.train --config trainer/configs/demo.toml --out runs/demo
    python -m trainer.train --config deploy.toml --out /workspace/checkpoints --set optim.lr=3e-4
    DFLASH_TARGET_GPUS=5 torchrun --nproc-per-node 8 -m trainer.train --config … --out …

Under torchrun (WORLD_SIZE > 1) the ranks split into target and drafter workers
(`trainer.split`); one process trains colocated (`trainer.trainer`).

`--config` is a standalone TOML or a deploy.toml (its `[train]` table); `--set key=value`
overrides any setting (dotted keys, TOML values). The run folder `--out` receives checkpoints
(`step-XXXXXXXX/`) and `metrics.jsonl`; starting again resumes from the newest verified
checkpoint there, and refuses one written with other model/data settings unless
`--force-resume`. Settings reference: docs/training.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from trainer.config import load_config
from trainer.errors import TrainerError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.train", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--config", required=True, help="TOML file (standalone or deploy.toml)")
    parser.add_argument("--out", required=True, help="run folder: checkpoints and metrics.jsonl")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a setting, e.g. --set optim.lr=3e-4 (repeatable)",
    )
    parser.add_argument(
        "--force-resume",
        action="store_true",
        help="resume even if the checkpoint's model/data settings differ",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout, force=True)
    split = int(os.environ.get("WORLD_SIZE", "1")) > 1  # under torchrun: trainer.split
    if split:  # taken by a watchdog thread (trainer.distributed); block before torch starts threads
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        config = load_config(args.config, args.overrides)  # fails fast, before torch loads
        if split:
            from trainer.distributed import roles_from_env
            from trainer.split import run_split

            run_split(config, args.out, roles_from_env(), force_resume=args.force_resume)
        else:
            from trainer.trainer import Trainer

            Trainer(config, args.out, force_resume=args.force_resume).run()
    except TrainerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted; resume by starting again with the same --out", file=sys.stderr)
        return 130
    except OSError as exc:  # e.g. a full disk under --out: the complete checkpoints stay valid
        print(
            f"error: {exc.strerror or exc} ({exc.filename or args.out}); free space or fix the "
            f"folder, then start again with the same --out: it resumes from the newest complete "
            f"checkpoint",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
