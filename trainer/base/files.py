"""Durable writes: a file or folder's entry is on disk once `fsync_path` returns, so a rename
that follows survives a power cut (checkpoints, token shards, exported folders)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's fsync makes the names created in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
