"""A recipe file (`bench/recipes/*.toml`) read into the `bench_eval.py` runs it stands for.

A file is data, not a script: the preparation (target and training data, made once), then the
recipes (a drafter each, trained and measured on what the preparation made), each a table of
`bench_eval.py` options. Keys:

    about = "what the runs ask"             # one line, printed by `check`
    record = "bench/results/<slug>"         # where the file's run is kept
    extends = "small-target.toml"           # start from that file (beside this one)
    one_at_a_time = true                    # recipes in order, each kept as it lands
    seeds = [0, 1]                          # each recipe once per seed: <name>-s<seed>, run.seed
    [options]                               # every run: the preparation and each recipe
    [[prepare]]                             # a --prepare-only run; more: later ones reuse the target
    [recipe_options]                        # every recipe
    [[recipe]]                              # name = "…", then its own options
    [smoke]                                 # with --smoke: options over all of the above

An option is its flag without the dashes: `samples = 131072` is `--samples 131072`, `true` a
bare flag, a list comma-joined (`feature-layers = [1, 2]`); `{work}` in a value is the shared
work folder. `set = { "model.num_layers" = 6 }` is `--set model.num_layers=6` (a TOML literal).
Later tables win key by key; `[smoke].set` gives new values only to the keys already set (the
smoke drafter is smaller than the recipe's). `extends` merges tables key by key and lets the
file's own `prepare` and `recipe` lists replace the base's.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KEYS = (
    "about", "record", "extends", "one_at_a_time", "seeds", "options", "prepare",
    "recipe_options", "recipe", "smoke",
)  # fmt: skip
TABLES = ("options", "recipe_options", "smoke")


class RecipeError(Exception):
    """A recipe file that cannot be run as written; the message names the file and the key."""


@dataclass(frozen=True)
class Run:
    """One `bench_eval.py` process: its name (its JSON and log in the out folder) and options."""

    name: str
    options: list[str]


@dataclass(frozen=True)
class Plan:
    """What a recipe file runs, in order."""

    source: Path
    about: str
    record: str | None
    prepare: list[Run]
    recipes: list[Run]
    one_at_a_time: bool


def load_plan(
    path: Path, *, work: str = "{work}", smoke: bool = False, only: list[str] | None = None
) -> Plan:
    """The runs of the file at `path` (`only`: these recipes, by name, in the file's order)."""
    raw = read(path)
    names = [recipe_name(path, r) for r in raw.get("recipe", [])]
    if not names:
        raise RecipeError(f"{path}: no [[recipe]]: name the drafters to train and compare")
    if len(set(names)) != len(names):
        raise RecipeError(f"{path}: [[recipe]] names must differ: {', '.join(names)}")
    unknown = [n for n in only or [] if n not in names]
    if unknown:
        raise RecipeError(f"{path} has no recipe {unknown[0]!r}; its recipes: {', '.join(names)}")
    common = raw.get("options", {})
    smoke_options = raw.get("smoke", {}) if smoke else None

    def run(name: str, *tables: dict[str, Any]) -> Run:
        return Run(name, argv([common, *tables], smoke_options, work))

    prepares = [
        run(
            step.get("name", f"prepare-{i + 1}" if i else "prepare"),
            without_name(step),
            {"reuse-target": i > 0 or None},
        )  # the first trains the target
        for i, step in enumerate(raw.get("prepare", []))
    ]
    recipes = [
        run(
            name if seed is None else f"{name}-s{seed}",
            {"set": {} if seed is None else {"run.seed": seed}},
            raw.get("recipe_options", {}),
            without_name(recipe),
        )
        for seed in raw.get("seeds") or [None]
        for name, recipe in zip(names, raw["recipe"], strict=True)
        if not only or name in only
    ]
    return Plan(
        source=path,
        about=str(raw.get("about", "")),
        record=raw.get("record"),
        prepare=prepares,
        recipes=recipes,
        one_at_a_time=bool(raw.get("one_at_a_time", False)),
    )


def read(path: Path) -> dict[str, Any]:
    """The file's tables, over those of the file it `extends`."""
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise RecipeError(f"{path}: no such recipe file (see bench/recipes/)") from exc
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path} is not valid TOML: {exc}") from exc
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise RecipeError(f"{path}: unknown key {unknown[0]!r}; known: {', '.join(KEYS)}")
    for key in ("prepare", "recipe"):
        if isinstance(raw.get(key), dict):
            raw[key] = [raw[key]]  # one [prepare] table, or [[prepare]] tables
    if "extends" not in raw:
        return raw
    base = read(path.parent / raw.pop("extends"))
    merged = {**base, **raw}
    for key in TABLES:
        merged[key] = merge(base.get(key, {}), raw.get(key, {}))
    return merged


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on `base` key by key, their `set` tables too."""
    out = {**base, **over}
    if "set" in base or "set" in over:
        out["set"] = {**base.get("set", {}), **over.get("set", {})}
    return out


def recipe_name(path: Path, recipe: dict[str, Any]) -> str:
    name = recipe.get("name")
    if not isinstance(name, str) or not name.replace("-", "").replace("_", "").isalnum():
        raise RecipeError(f'{path}: each [[recipe]] needs name = "…" (letters, digits, - or _)')
    return name


def without_name(table: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in table.items() if k != "name"}


def argv(tables: list[dict[str, Any]], smoke: dict[str, Any] | None, work: str) -> list[str]:
    """`bench_eval.py` options from `tables` merged in order (later wins), then `smoke`."""
    merged: dict[str, Any] = {}
    for table in tables:
        merged = merge(merged, table)
    if smoke is not None:
        settings = merged.get("set", {})
        small = {k: v for k, v in smoke.get("set", {}).items() if k in settings}
        merged = merge({"smoke": True, **merged}, {**smoke, "set": small})
    out: list[str] = []
    for key, value in merged.items():
        if value is True:
            out.append(f"--{key}")
        elif key != "set" and value is not None and value is not False:
            text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
            out += [f"--{key}", text.replace("{work}", work)]
    settings = merged.get("set", {}).items()
    return out + [flag for k, v in settings for flag in ("--set", f"{k}={literal(v)}")]


def literal(value: Any) -> str:
    """`value` as the TOML literal `--set` reads back (`[0,1]`, `true`, `"flash"`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ",".join(literal(v) for v in value) + "]"
    return json.dumps(value) if isinstance(value, str) else str(value)
