"""The key and type checks of a TOML table against its schema, shared by `deploy.toml`'s tables:
an unknown key or a wrong type names the key and the file (a typo silently ignored is a run
started with the wrong settings)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dflash_ops.errors import ConfigError

Schema = Mapping[str, tuple[tuple[type, ...], str]]

# key → (accepted types, description used in messages)
INT = ((int,), "an integer")
STR = ((str,), "a string")
NUM = ((int, float), "a number")
TABLE = ((dict,), "a table")
BOOL = ((bool,), "true or false")
LIST = ((list,), "an array")


def check_keys(
    table: Mapping[str, Any],
    schema: Schema,
    *,
    prefix: str,
    path: Path,
) -> None:
    for key, value in table.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in schema:
            known = ", ".join(schema)
            raise ConfigError(
                f"Unknown key {dotted!r} in {path}.",
                hint=f"Known keys{' in [' + prefix + ']' if prefix else ''}: {known}.",
            )
        types, words = schema[key]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise type_error(dotted, value, words, path)


def type_error(key: str, value: Any, words: str, path: Path) -> ConfigError:
    return ConfigError(
        f"Key {key!r} in {path} must be {words}, not {value!r} ({toml_type(value)}).",
    )


def toml_type(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "float", str: "string", dict: "table"}
    return names.get(type(value), "array" if isinstance(value, list) else type(value).__name__)
