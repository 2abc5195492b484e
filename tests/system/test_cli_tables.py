"""What `dflash checkpoints` and `dflash releases` print for a person: a header over each table,
sizes in bytes, kB, MB, and counts with their plural only when more than one."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

from tests.cli_helpers import dflash, kill_tmux_server


def test_listings_have_headers_human_sizes_and_plurals(tmp_path: Path) -> None:
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    (tmp_path / "deploy.toml").write_text(
        f'[job]\nsocket = "{socket}"\ncommand = "echo hi"\n[train]\ndemo = true\n'
    )
    checkpoints = tmp_path / ".dflash" / "local" / "checkpoints"
    try:
        assert dflash(tmp_path, "deploy").returncode == 0
        (checkpoints / "step-00000002").mkdir()
        (checkpoints / "step-00000002" / "state.pt").write_bytes(b"w" * 2_300_000)
        assert dflash(tmp_path, "deploy").returncode == 0  # archives the run: 1 run, 2 entries
        (checkpoints / "metrics.jsonl").write_bytes(b"x" * 121)
        listed = dflash(tmp_path, "checkpoints")
        releases = dflash(tmp_path, "releases")
        (checkpoints / "metrics.jsonl").unlink()
        one = dflash(tmp_path, "checkpoints")
    finally:
        kill_tmux_server(socket)
    assert listed.returncode == 0, listed.stderr
    lines = [line.rstrip() for line in listed.stdout.splitlines()]
    assert lines[0] == f"live {checkpoints}: 2 entries"
    assert lines[1].split() == ["modified", "(UTC)", "size", "name"]
    assert re.search(r"121 bytes\s+metrics\.jsonl\s*$", listed.stdout, re.M)
    assert "archived runs: 1" in lines
    header = lines.index("archived runs: 1") + 1
    assert lines[header].split() == ["archived", "run", "size", "entries", "checkpoints"]
    row = lines[header + 1]
    assert "2.3 MB" in row and "2 entries" in row and row.endswith("step-00000002")
    assert one.stdout.splitlines()[0] == f"live {checkpoints}: 1 entry"

    assert releases.returncode == 0, releases.stderr
    head, *rows = [line.rstrip() for line in releases.stdout.splitlines()]
    assert head.split() == ["release", "created", "size", "revision"]
    assert len(rows) == 2 and rows[1].startswith("*") and not rows[0].startswith("*")
    assert all(re.search(r"\d+(\.\d)? kB", row) for row in rows)
    assert "2 releases; * = current" in releases.stderr
