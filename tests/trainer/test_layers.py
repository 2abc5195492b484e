"""The trainer's modules form layers: no import cycle (imports inside functions included, so a
deferred import cannot hide one), no module over ~500 lines, and nothing of the operator's
side (`dflash_ops` reaches the trainer only through the bundle it ships)."""

from __future__ import annotations

from tests.layers import find_cycle, graph, imports_of, long_modules, modules


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_trainer_package_has_no_import_cycle() -> None:
    edges = graph("trainer")
    assert "trainer.runtime" in edges["trainer.evaluate"]  # the graph sees deferred imports
    cycle = find_cycle(edges)
    assert cycle is None, " → ".join(cycle or [])


def test_no_trainer_module_is_over_500_lines() -> None:
    long = long_modules("trainer")
    assert not long, f"split these by job: {long}"


def test_the_trainer_never_imports_the_operator_side() -> None:
    found = {n: imports_of(p, ("dflash_ops",)) for n, p in modules("trainer").items()}
    assert not {n: i for n, i in found.items() if i}
