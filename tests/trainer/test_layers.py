"""The trainer in floors, each folder importing only from the ones below it:

    base → settings → loss → model → data → setup → generation → export → evaluation → run
    → split → commands (→ `__main__`, the one entry: `python -m trainer VERB`)

no import cycle between modules (imports inside functions included, so a deferred import cannot
hide one), no module over 400 lines, and nothing of the operator's side (`dflash_ops` reaches
the trainer only through the bundle it ships)."""

from __future__ import annotations

from tests.layers import find_cycle, graph, imports_of, long_modules, modules

ORDER = [
    "base", "settings", "loss", "model", "data", "setup", "generation", "export", "evaluation",
    "run", "split", "commands", "__main__",
]  # fmt: skip


def floor(module: str) -> str:
    """`trainer.data.shards` → `data`; `trainer.__main__` → `__main__`; `trainer` → `__init__`."""
    return module.split(".")[1] if "." in module else "__init__"


def test_every_module_is_on_a_floor() -> None:
    outside = {m for m in modules("trainer") if floor(m) not in {*ORDER, "__init__"}}
    assert not outside, f"modules outside the floors {ORDER}: {sorted(outside)}"


def test_each_floor_imports_only_from_the_floors_below() -> None:
    upward = [
        f"{name} imports {target}"
        for name, targets in graph("trainer").items()
        for target in targets
        if floor(name) != "__init__" and ORDER.index(floor(target)) > ORDER.index(floor(name))
    ]
    assert not upward, "\n".join(upward)


def test_the_floor_test_sees_an_upward_import() -> None:
    edges = graph("trainer")
    assert "trainer.setup.runtime" in edges["trainer.evaluation.evaluate"]  # deferred, too
    assert ORDER.index(floor("trainer.run.trainer")) > ORDER.index(floor("trainer.model.drafter"))


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_trainer_package_has_no_import_cycle() -> None:
    cycle = find_cycle(graph("trainer"))
    assert cycle is None, " → ".join(cycle or [])


def test_no_trainer_module_is_over_400_lines() -> None:
    long = long_modules("trainer", limit=400)
    assert not long, f"split these by job: {long}"


def test_one_entry() -> None:
    """Every command is a verb of `python -m trainer`: no other module runs as a script."""
    scripts = [
        n
        for n, p in modules("trainer").items()
        if "__main__" in p.read_text() and n != "trainer.__main__"
    ]
    assert not scripts, scripts


def test_the_trainer_never_imports_the_operator_side() -> None:
    found = {n: imports_of(p, ("dflash_ops",)) for n, p in modules("trainer").items()}
    assert not {n: i for n, i in found.items() if i}
