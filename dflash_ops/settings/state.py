"""Which target was last deployed from this folder, kept in `.dflash/state.json`.

After `dflash deploy --host gpu-box --ct 200`, a plain `dflash logs` must look at that same
container, not at `[target]`. The file records the flags that selected the target (not their
resolved values, so that later edits of deploy.toml still apply) plus what was deployed and when.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_ops.errors import ConfigError
from dflash_ops.settings.deploy_config import TargetFlags

STATE_DIR = ".dflash"
STATE_FILE = "state.json"


@dataclass(frozen=True, kw_only=True)
class DeployRecord:
    """The last deploy from this folder."""

    flags: TargetFlags
    target: str  # the resolved target's description, for messages
    release: str
    deployed_at: str  # ISO 8601, UTC


def state_path(project_dir: Path) -> Path:
    return project_dir / STATE_DIR / STATE_FILE


def load(project_dir: Path) -> DeployRecord | None:
    """The last deploy, or None when nothing was deployed from this folder yet."""
    path = state_path(project_dir)
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
        return DeployRecord(
            flags=TargetFlags.from_json(data["flags"]),
            target=str(data["target"]),
            release=str(data["release"]),
            deployed_at=str(data["deployed_at"]),
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{path} is unreadable ({exc}).",
            hint=f"Delete {path} (it only remembers the last target) or pass --target NAME.",
        ) from None


def save(project_dir: Path, record: DeployRecord) -> None:
    """Write the record atomically (temp file + rename) so a crash never leaves half a file."""
    path = state_path(project_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "flags": record.flags.to_json(),
        "target": record.target,
        "release": record.release,
        "deployed_at": record.deployed_at,
    }
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".state.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
