"""A tiny TOML writer: the resolved `[train]` table goes to the trainer as `train.toml`.

The standard library reads TOML (`tomllib`) but does not write it. The trainer's settings are
plain data — strings, numbers, booleans, dates, arrays and nested tables — so a writer of a few
dozen lines is enough, and `tests/ops/test_config.py` proves that what it writes reads back equal.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Mapping
from typing import Any

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def dumps(table: Mapping[str, Any]) -> str:
    """Render `table` as a TOML document: scalars first, then one `[section]` per sub-table."""
    lines: list[str] = []
    _write_table(table, prefix=(), lines=lines)
    return "\n".join(lines) + ("\n" if lines else "")


def _write_table(table: Mapping[str, Any], *, prefix: tuple[str, ...], lines: list[str]) -> None:
    scalars = {k: v for k, v in table.items() if not isinstance(v, Mapping)}
    tables = {k: v for k, v in table.items() if isinstance(v, Mapping)}
    if prefix and (scalars or not tables):
        # A header is needed when the table has values of its own, or is empty (so it exists).
        lines.append(f"[{'.'.join(_key(p) for p in prefix)}]")
    for key, value in scalars.items():
        lines.append(f"{_key(key)} = {_value(value)}")
    for key, value in tables.items():
        if lines:
            lines.append("")
        _write_table(value, prefix=(*prefix, key), lines=lines)


def _key(key: str) -> str:
    if not isinstance(key, str):
        raise TypeError(f"TOML keys must be strings, got {key!r}")
    return key if _BARE_KEY.fullmatch(key) else _string(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(item) for item in value) + "]"
    if isinstance(value, Mapping):
        # Tables inside arrays are written inline.
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML: {value!r}")


def _string(text: str) -> str:
    out = []
    for char in text:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'
