"""What every table of `deploy.toml` is made of: a pydantic model that refuses unknown keys and
coerces nothing (`gpus = "8"` or `gpus = true` is an error, not a number), fields that carry their
README row (`key`), and a check's own refusal (`fail`) with the message and hint a user reads."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError


class Table(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def key(default: Any, meaning: str, *, shown: str | None = None, **bounds: Any) -> Any:
    """A field with its README row: `meaning`, and `shown`, the default as the README says it
    (`—` for none; the TOML value of `default` when not given)."""
    if shown is None:
        shown = "—" if default is None else f"`{as_toml(default)}`"
    return Field(default, description=meaning, json_schema_extra={"shown": shown}, **bounds)


def as_toml(value: Any) -> str:
    """`value` as TOML writes it (a whole float without its `.0`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def fail(message: str, hint: str | None = None) -> PydanticCustomError:
    """A check's own refusal: its message as written (`{path}` or `{where}` filled in by
    `config_error` or `place_error`) and its hint, carried as they are in the error's context."""
    return PydanticCustomError("dflash", "{message}", {"message": message, "hint": hint or ""})


def toml_type(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "float", str: "string", dict: "table"}
    return names.get(type(value), "array" if isinstance(value, list) else type(value).__name__)
