"""The README's `deploy.toml` key tables are the models' fields: what a key means, its default
and the keys the loader accepts come from one place (`dflash_ops.settings.reference`)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dflash_ops.errors import ConfigError
from dflash_ops.settings.deploy_config import load_config
from dflash_ops.settings.reference import TABLES, key_table, named_blocks, with_key_tables
from tests.cli_helpers import REPO

README = REPO / "README.md"


def test_the_readme_tables_are_the_models() -> None:
    text = README.read_text(encoding="utf-8")
    assert named_blocks(text) == ["target", "job", "venv"]
    assert with_key_tables(text) == text, "run scripts/readme-keys.py"
    stale = text.replace("| `gpus` | `0` |", "| `gpus` | `1` |")
    assert stale != text and with_key_tables(stale) == text


def test_every_key_has_a_meaning_and_a_default_shown() -> None:
    for name, model in TABLES.items():
        for key, field in model.model_fields.items():
            assert field.description, f"{name}.{key}"
            extra = field.json_schema_extra
            assert isinstance(extra, dict) and extra.get("shown"), f"{name}.{key}"


@pytest.mark.parametrize("table", ["target", "job", "venv"])
def test_each_key_of_a_table_is_accepted_and_no_other(tmp_path: Path, table: str) -> None:
    """A key the README lists loads (with a value of its type); one it does not list is refused."""
    rows = [line for line in key_table(TABLES[table]).splitlines()[2:]]
    keys = [row.split("`")[1] for row in rows]
    assert keys == list(TABLES[table].model_fields)
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "requirements.txt").write_text("torch\n")
    path = tmp_path / "deploy.toml"
    path.write_text(f"[{table}]\nnot_a_key = 1\n")
    with pytest.raises(ConfigError, match=f"'{table}.not_a_key'"):
        load_config(path)
    path.write_text(f"[{table}]\n")
    assert tomllib.loads(path.read_text()) == {table: {}}
    load_config(path)  # every key has a default


def test_the_script_says_the_readme_is_up_to_date() -> None:
    check = [sys.executable, str(REPO / "scripts" / "readme-keys.py"), "--check"]
    done = subprocess.run(check, capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "up to date" in done.stdout, done.stdout + done.stderr
