"""Write the demo assets into a folder: a tiny random target saved with `save_pretrained` and
training data it generated itself (what `[train] demo = true` runs on)."""

from __future__ import annotations

import argparse

from trainer.settings.config import DemoConfig
from trainer.setup.demo import ensure_demo_assets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer demo", description=__doc__.split("\n")[0]
    )
    parser.add_argument("folder", help="where the target and the data go (made when missing)")
    args = parser.parse_args(argv)
    target, data = ensure_demo_assets(args.folder, DemoConfig(enabled=True))
    print(f"target: {target}\ndata:   {data}")
    return 0
