#!/usr/bin/env python3
"""Write the README's `deploy.toml` key tables from the models that check the file
(`dflash_ops.settings.reference`); `--check` only says whether the README is up to date.

    .venv/bin/python scripts/readme-keys.py [--check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_ops.settings.reference import with_key_tables  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the README differs")
    args = parser.parse_args()
    readme = ROOT / "README.md"
    text = readme.read_text(encoding="utf-8")
    made = with_key_tables(text)
    if made == text:
        print("README.md: the key tables are up to date")
        return 0
    if args.check:
        print("README.md: the key tables differ from the models; run scripts/readme-keys.py")
        return 1
    readme.write_text(made, encoding="utf-8")
    print("README.md: key tables written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
