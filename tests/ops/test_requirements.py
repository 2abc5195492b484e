"""The modules the trainer imports, read from its sources, and the requirements that provide
them: `trainer/requirements.txt` (what `dflash setup` installs) and the package's own
dependencies must cover every one, and name nothing it does not import. A new import fails
here until it is declared, so the check at the place never drifts from the code."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from dflash_ops.remote.requirements import REQUIREMENTS, required_modules

REPO = Path(__file__).resolve().parents[2]


def names(lines: list[str]) -> dict[str, str]:
    """Normalised distribution name → the requirement line."""
    found = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            name = re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0]
            found[re.sub(r"[-_.]+", "-", name).lower()] = line
    return found


def test_the_trainers_imports_are_its_requirements() -> None:
    modules = required_modules(REPO / "trainer")
    assert {"torch", "numpy", "transformers"} <= set(modules)  # the scan sees real imports
    assert "triton" not in modules and "tensorboard" not in modules  # probed for: optional
    wanted = names((REPO / "trainer" / REQUIREMENTS).read_text().splitlines())
    providers = metadata.packages_distributions()
    covered = set()
    for module in modules:
        dists = {re.sub(r"[-_.]+", "-", d).lower() for d in providers.get(module, [])}
        assert dists & wanted.keys(), f"trainer imports {module}: add {dists} to {REQUIREMENTS}"
        covered |= dists & wanted.keys()
    assert covered == wanted.keys(), f"{REQUIREMENTS} names what the trainer does not import"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = names(project["dependencies"])
    for name, line in wanted.items():
        assert declared.get(name) == line, f"pyproject.toml must require {line!r} too"


def test_a_new_import_is_required_and_a_probed_one_is_not(tmp_path: Path) -> None:
    trainer = tmp_path / "trainer"
    trainer.mkdir()
    (trainer / "a.py").write_text(
        "from __future__ import annotations\nimport os, json\nimport numpy as np\n"
        "from trainer import b\nfrom . import b as c\nfrom yaml.loader import Loader\n"
        "def f():\n    import scipy.linalg\n"
        "try:\n    import triton\nexcept ImportError:\n    triton = None\n"
        "try:\n    from transformers import Thing\nexcept ImportError:\n    pass\n"
    )
    (trainer / "b.py").write_text("import a\n")  # a sibling module, not a distribution
    assert required_modules(trainer) == ["numpy", "scipy", "transformers", "yaml"]
    assert required_modules(tmp_path / "none") == []
