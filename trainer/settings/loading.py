"""Reading a training config: a TOML file (standalone, or deploy.toml with a `[train]` table)
and `--set KEY=VALUE` overrides → a checked `TrainConfig`; the demo's defaults; the options
every verb that reads a config shares."""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from trainer.settings.config import SECTIONS, TrainConfig
from trainer.settings.typed_settings import TrainConfigError
from trainer.settings.typed_settings import coerce as _coerce
from trainer.settings.typed_settings import (
    diff_settings as diff_settings,  # where callers look for it
)
from trainer.settings.typed_settings import parse_override as _parse_override

# With the demo enabled, keys left unset take these values: a tiny drafter on the CPU that
# trains in about a minute (so `[train] demo = true` in deploy.toml is the whole demo).
DEMO_DEFAULTS: dict[str, dict[str, Any]] = {
    "model": {"num_layers": 2, "block_size": 8, "num_target_layers": 3},
    "data": {"batch_size": 8, "max_len": 64, "num_anchors": 16, "bucket": 64, "noise": 0.02},
    "optim": {"lr": 3e-3, "warmup_steps": 20, "weight_decay": 0.0},
    "loss": {"kl_weight": 0.15},
    "run": {"steps": 300, "device": "cpu", "threads": 2, "checkpoint_every": 100, "keep_last": 2},
}


def config_options() -> argparse.ArgumentParser:
    """The options every verb that reads a config shares (`parents=[config_options()]`):
    `--config FILE` and the repeatable `--set KEY=VALUE`, passed to `load_config` as
    `args.config` and `args.overrides`."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--config", required=True, help="the training TOML: standalone, or deploy.toml's [train]"
    )
    add_overrides_option(common, "override a setting, e.g. --set optim.lr=3e-4 (repeatable)")
    return common


def add_overrides_option(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """`--set KEY=VALUE` (repeatable) as `args.overrides`: the verbs' (through `config_options`)
    and the benchmarks' that build their own configs."""
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help
    )


def load_config(path: str | Path | None, overrides: Iterable[str] = ()) -> TrainConfig:
    """Read `path` (standalone or deploy.toml with a `[train]` table), apply `key=value`
    overrides, validate. `path=None` starts from the defaults."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise TrainConfigError("--config", f"{path} does not exist") from exc
        except tomllib.TOMLDecodeError as exc:
            raise TrainConfigError("--config", f"{path} is not valid TOML: {exc}") from exc
        if isinstance(raw.get("train"), dict):
            raw = raw["train"]
    return config_from_dict(raw, overrides)


def config_from_dict(raw: Mapping[str, Any], overrides: Iterable[str] = ()) -> TrainConfig:
    tables: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for name, value in raw.items():
        if name == "demo" and isinstance(value, bool):  # shorthand: demo = true
            tables["demo"]["enabled"] = value
            continue
        if name not in SECTIONS:
            raise TrainConfigError(name, f"unknown table; expected one of {sorted(SECTIONS)}")
        if not isinstance(value, dict):
            raise TrainConfigError(name, "must be a table")
        for key, item in value.items():
            tables[name][key] = _coerce(name, SECTIONS[name], key, item)
    for item in overrides:
        key, value = _parse_override(item)
        section, _, name = key.partition(".")
        if key == "demo":
            section, name = "demo", "enabled"
        if section not in SECTIONS or not name:
            raise TrainConfigError(
                key, f"unknown key; expected <table>.<key>, tables {sorted(SECTIONS)}"
            )
        tables[section][name] = _coerce(section, SECTIONS[section], name, value)
    if tables["demo"].get("enabled"):
        for name, defaults in DEMO_DEFAULTS.items():
            tables[name] = {**defaults, **tables[name]}
    parts = {name: SECTIONS[name](**values) for name, values in tables.items()}
    return TrainConfig(**parts)


def with_overrides(config: TrainConfig, **sections: dict[str, Any]) -> TrainConfig:
    """A copy with some keys replaced, e.g. `with_overrides(cfg, run={"steps": 10})`."""
    parts = {}
    for name in SECTIONS:
        part = getattr(config, name)
        changes = {
            k: _coerce(name, SECTIONS[name], k, v) for k, v in sections.get(name, {}).items()
        }
        parts[name] = dataclasses.replace(part, **changes) if changes else part
    return TrainConfig(**parts)
