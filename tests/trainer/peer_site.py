"""SpecForge for the tests that compare with it: its wheel and the packages its DFlash path
imports, as carried for the GPU machine (`.whl/peer/`, or `$DFLASH_PEER_WHEELS`), installed
with `pip --no-deps` into a private folder; and z-lab's reference `dflash/model.py`, carried
beside them. Absent ones make the tests that need them skip, saying what to fetch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.cli_helpers import REPO

WHEELS = Path(os.environ.get("DFLASH_PEER_WHEELS", REPO / ".whl" / "peer"))
FETCH = (
    f"SpecForge's wheels not in {WHEELS}: `pip download --no-deps specforge==0.2.0 pydantic "
    "pydantic-core accelerate annotated-types typing-inspection typing-extensions -d DIR` "
    "(binary wheels for this Python), then set DFLASH_PEER_WHEELS=DIR"
)


def installable() -> list[Path]:
    """The carried wheels this Python can install (a wheel built for another Python is left
    out: this interpreter's own copy of that package serves)."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    tags = set(sys_tags())
    return sorted(w for w in WHEELS.glob("*.whl") if parse_wheel_filename(w.name)[3] & tags)


def install(into: Path, *, leave_out: tuple[str, ...] = ()) -> Path | None:
    """The installable wheels in `into`, but those of the distributions in `leave_out` (None
    without SpecForge's)."""
    wheels = [w for w in installable() if not w.name.startswith(tuple(f"{n}-" for n in leave_out))]
    if not any(w.name.startswith("specforge-") for w in wheels):
        return None
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
         "--no-compile", "--target", str(into), *map(str, wheels)],
        check=True,
    )  # fmt: skip
    return into


def reference_file() -> Path | None:
    """z-lab/dflash's `dflash/model.py` carried beside the wheels, if it is."""
    found = sorted(WHEELS.glob("zlab-dflash-*/dflash/model.py"))
    return found[-1] if found else None
