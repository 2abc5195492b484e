"""The README's key tables of `deploy.toml`, made from the fields of the models that check the
file (`schema.TargetTable`, `job_config.JobConfig`, `venv_config.VenvTable`): one source for what
a key means, its default and what the loader accepts. `scripts/readme-keys.py` writes them
between the README's markers; tests/ops/test_config_reference.py checks the README agrees."""

from __future__ import annotations

import re

from pydantic import BaseModel

from dflash_ops.settings.job_config import JobConfig
from dflash_ops.settings.schema import TargetTable
from dflash_ops.settings.venv_config import VenvTable

TABLES: dict[str, type[BaseModel]] = {"target": TargetTable, "job": JobConfig, "venv": VenvTable}
_BLOCK = re.compile(r"(<!-- keys: (\w+) -->\n)(.*?)(<!-- end of keys -->)", re.S)


def key_table(model: type[BaseModel]) -> str:
    """| key | default | meaning | rows, in the model's field order."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra
        shown = extra.get("shown", "—") if isinstance(extra, dict) else "—"
        rows.append(f"| `{name}` | {shown} | {field.description} |")
    return "\n".join(rows) + "\n"


def with_key_tables(text: str) -> str:
    """`text` (the README) with each `<!-- keys: NAME -->` block replaced by NAME's table."""

    def block(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in TABLES:
            raise KeyError(f"no key table named {name!r} (known: {', '.join(TABLES)})")
        return f"{match.group(1)}{key_table(TABLES[name])}{match.group(4)}"

    return _BLOCK.sub(block, text)


def named_blocks(text: str) -> list[str]:
    """The table names the README marks, in its order."""
    return [m.group(2) for m in _BLOCK.finditer(text)]
