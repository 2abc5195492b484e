"""Settings checked against the type hints of a dataclass: the machinery under `trainer.settings.config`.

A TOML value or a `--set key=value` override is coerced to the field's declared type (`int`,
`float`, `bool`, `str`, `list[...]`, `X | None`) or refused with `TrainConfigError` naming the
dotted key; flat dotted keys are how settings are compared (a checkpoint's against the run's).
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Mapping
from typing import Any

from trainer.base.errors import TrainerError


class TrainConfigError(TrainerError, ValueError):
    """A setting is missing, unknown, or has a bad value; the message names the dotted key."""

    hint = "Change that key in the config file, or override it with --set KEY=VALUE."

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


def parse_override(item: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise TrainConfigError(item, "overrides are written key=value, e.g. optim.lr=3e-4")
    text = text.strip()
    try:  # TOML literal: numbers, booleans, quoted strings, arrays
        return key, tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return key, text  # a bare string such as a path


def coerce(section: str, cls: type, key: str, value: Any) -> Any:
    dotted = f"{section}.{key}"
    hints = typing.get_type_hints(cls)
    if key not in hints:
        known = ", ".join(f.name for f in dataclasses.fields(cls))
        raise TrainConfigError(dotted, f"unknown key; known keys of [{section}]: {known}")
    return check_type(dotted, hints[key], value)


def check_type(key: str, hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if is_none and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return check_type(key, arg, value)
            except TrainConfigError:
                continue
        raise TrainConfigError(key, f"expected {hint}, got {value!r}")
    if origin is list:
        (inner,) = typing.get_args(hint)
        if not isinstance(value, list | tuple):
            raise TrainConfigError(key, f"expected a list, got {value!r}")
        return [check_type(key, inner, v) for v in value]
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise TrainConfigError(key, f"expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TrainConfigError(key, f"expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise TrainConfigError(key, f"expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise TrainConfigError(key, f"expected a string, got {value!r}")
    raise TrainConfigError(key, f"unsupported type {hint}")


def positive(key: str, value: int) -> None:
    if value <= 0:
        raise TrainConfigError(key, f"must be > 0, got {value}")


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def diff_settings(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Dotted keys whose values differ (or exist on one side only)."""
    return sorted(
        k for k in set(old) | set(new) if old.get(k, "<absent>") != new.get(k, "<absent>")
    )
