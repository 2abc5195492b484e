"""`dflash_ops` in layers, each folder importing only from the ones below it:
untrusted (text from a place, made safe to show) → errors → connect → settings → remote → commands → cli (→ `__main__`); no import cycle between
modules (imports inside functions included), no module over ~500 lines, and of the trainer only
`trainer.export.serving`, torch-free: the CLI runs without torch."""

from __future__ import annotations

import subprocess
import sys

from tests.layers import find_cycle, graph, imports_of, long_modules, modules

ORDER = ["untrusted", "errors", "connect", "settings", "remote", "commands", "cli", "__main__"]


def layer(module: str) -> str:
    """`dflash_ops.remote.job` → `remote`; `dflash_ops.errors` → `errors`."""
    return module.split(".")[1] if "." in module else "__init__"


def test_every_module_belongs_to_a_layer() -> None:
    outside = {layer(m) for m in modules("dflash_ops")} - {*ORDER, "__init__"}
    assert not outside, f"modules outside the layers {ORDER}: {outside}"


def test_each_layer_imports_only_from_the_layers_below() -> None:
    upward = [
        f"{name} imports {target}"
        for name, targets in graph("dflash_ops").items()
        for target in targets
        if layer(name) != "__init__" and ORDER.index(layer(target)) > ORDER.index(layer(name))
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycle_between_modules() -> None:
    edges = graph("dflash_ops")
    assert "dflash_ops.remote.client" in edges["dflash_ops.commands.operations"]
    cycle = find_cycle(edges)
    assert cycle is None, " → ".join(cycle or [])


def test_no_module_is_over_500_lines() -> None:
    long = long_modules("dflash_ops")
    assert not long, f"split these by job: {long}"


TORCH_FREE = {"trainer.export.serving"}


def test_of_the_trainer_only_the_serving_lines() -> None:
    """The rest reaches the place in the bundle: `export` prints the engines' command lines."""
    known = frozenset(modules("trainer"))
    used = set().union(
        *(imports_of(p, ("trainer",), known) for p in modules("dflash_ops").values())
    )
    assert used <= TORCH_FREE, used


def test_the_trainer_modules_the_cli_imports_load_no_torch() -> None:
    code = f"import sys; import {', '.join(sorted(TORCH_FREE))}; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False"
