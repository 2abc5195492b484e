"""`python -m bench.recipes`: drafter experiments kept as recipe files (`bench/recipes/*.toml`),
run at `--smoke` sizes on the CPU as they run on a GPU; what each file stands for, and what is
refused before anything runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from bench.recipes.plan import RecipeError, load_plan
from tests.cli_helpers import REPO

RECIPES = REPO / "bench" / "recipes"


def recipes(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.recipes", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO,
    )  # fmt: skip


def test_depth_recipes_run_one_after_another_on_one_target(tmp_path: Path) -> None:
    """`depth.toml`: one target and one data set, the default drafter beside 6 and 5 layers,
    each recipe's setting on record (the layers as trained); one at a time, each run starts
    after the one before has written its result; the summary pairs each with the first."""
    work, out = tmp_path / "work", tmp_path / "out"
    run = recipes("run", str(RECIPES / "depth.toml"), "--work", str(work), "--out", str(out),
                  "--smoke")  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    names = ("base", "layers6", "layers5")
    results = {n: json.loads((out / f"{n}.json").read_text()) for n in names}
    assert {n: r["recipe"]["overrides"] for n, r in results.items()} == {
        "base": [],
        "layers6": ["model.num_layers=6"],
        "layers5": ["model.num_layers=5"],
    }
    layers = {n: r["points"][0]["drafter"]["layers"] for n, r in results.items()}
    assert layers == {"base": 1, "layers6": 6, "layers5": 5}  # --smoke's 1, or the setting's
    assert {r["training_data"] for r in results.values()} == {str(work / "generated-unseen-t1-p16")}
    assert results["base"]["recipe"]["unseen_past_cap"] == 0  # the file's [smoke] table
    lookups = [{k: v for k, v in r["baselines"]["prompt_lookup"].items() if k != "seconds"}
               for r in results.values()]  # fmt: skip
    assert all(lookup == lookups[0] for lookup in lookups)  # one target, the same prompts
    assert json.loads((out / "prepare.json").read_text())["mode"] == "prepare"
    for before, after in zip(names, names[1:], strict=False):
        finished = datetime.fromtimestamp((out / f"{before}.json").stat().st_mtime)
        first = (out / f"{after}.log").read_text().split("]", 1)[0].lstrip("[")
        assert first >= finished.strftime("%H:%M:%S"), (before, after)
    table = (out / "summary.md").read_text()
    assert all(f"| {n} |" in table for n in results)
    assert "held-out τ − base's" in table  # paired against the first recipe
    held = results["base"]["points"][0]["held_out"]
    assert held["draft_cost"] > 0 and held["net_speedup"] < held["speedup"]
    assert f"| {held['net_speedup']:.2f}× (drafts {held['draft_cost']:.2f}) |" in table


def test_prompt_sources_prepare_twice_then_train_on_each(tmp_path: Path) -> None:
    """`prompt-sources.toml`: one target, its answers to its own files and to the kept ones
    (two preparations, the second reusing the target), a drafter on each."""
    work, out = tmp_path / "work", tmp_path / "out"
    run = recipes("run", str(RECIPES / "prompt-sources.toml"), "--work", str(work),
                  "--out", str(out), "--smoke")  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert {p.name for p in out.glob("prepare-*.json")} == {
        "prepare-unseen.json", "prepare-target.json",
    }  # fmt: skip
    own, kept = (
        json.loads((out / f"{n}.json").read_text()) for n in ("target-files", "unseen-files")
    )
    assert own["training_data"] == str(work / "generated-t1-p16")
    assert kept["training_data"] == str(work / "generated-unseen-t1-p16")
    assert own["recipe"]["drafter_prompts"] == "target-files"
    assert kept["recipe"]["drafter_prompts"] == "unseen-files"
    assert own["recipe"]["unseen_every"] == kept["recipe"]["unseen_every"] == 4
    assert own["recipe"]["feature_layers"] == [0]  # the file's [smoke] table
    lookups = [{k: v for k, v in r["baselines"]["prompt_lookup"].items() if k != "seconds"}
               for r in (own, kept)]  # fmt: skip
    assert lookups[0] == lookups[1]  # one target, the same held-out prompts
    split = json.loads((work / "target" / "bench-corpus-split.json").read_text())
    assert split["unseen_every"] == 4
    table = (out / "summary.md").read_text()
    assert "| target-files |" in table and "| unseen-files |" in table


def test_unknown_recipe_is_refused_by_name_before_anything_runs(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    refused = recipes("run", str(RECIPES / "depth.toml"), "--work", str(work), "--out", str(out),
                      "--only", "base,deep9", timeout=120)  # fmt: skip
    assert refused.returncode == 2
    assert "depth.toml has no recipe 'deep9'; its recipes: base, layers6, layers5" in (
        refused.stderr
    )
    assert not work.exists() and not out.exists()


def test_a_typo_in_a_recipe_is_refused_naming_the_recipe(tmp_path: Path) -> None:
    """Every run's options go through `bench_eval.py`'s own parser before a target trains."""
    path = tmp_path / "typo.toml"
    path.write_text('[[prepare]]\n\n[[recipe]]\nname = "a"\n\n[[recipe]]\nname = "b"\n'
                    'sampels = 4\n')  # fmt: skip
    refused = recipes("run", str(path), "--work", str(tmp_path / "w"), "--out",
                      str(tmp_path / "o"), timeout=120)  # fmt: skip
    assert refused.returncode == 2
    assert f"{path}, b: unrecognized arguments: --sampels 4" in refused.stderr
    bad_set = tmp_path / "set.toml"
    bad_set.write_text('[[recipe]]\nname = "a"\nset = { "loss.gama" = 2 }\n')
    checked = recipes("check", str(bad_set), timeout=120)
    assert checked.returncode == 2 and "a: --set: loss.gama: unknown key" in checked.stderr


def test_every_shipped_recipe_file_reads_as_bench_eval_options() -> None:
    """`check` on every file, at full size and at --smoke's: option names, values, --set keys."""
    files = sorted(str(p) for p in RECIPES.glob("*.toml"))
    assert len(files) >= 10
    for smoke in ((), ("--smoke",)):
        checked = recipes("check", *smoke, *files, timeout=300)
        assert checked.returncode == 0, checked.stderr
    for path in RECIPES.glob("*.toml"):  # each file's run on record, where it was run
        record = load_plan(path).record
        assert record is None or (REPO / record / "README.md").is_file(), (path, record)


def test_a_setting_beside_the_default_seed_by_seed() -> None:
    """`extends`: the small target's options, prepare and seeds, with the file's own recipes;
    each recipe once per seed (`run.seed`), its setting after the shared ones."""
    kv = load_plan(RECIPES / "kv-heads.toml", work="W")
    assert [r.name for r in kv.recipes] == [
        "base-s0", "kv2-s0", "base-s1", "kv2-s1", "base-s2", "kv2-s2",
    ]  # fmt: skip
    assert kv.recipes[1].options[-4:] == ["--set", "run.seed=0", "--set", "model.num_kv_heads=2"]
    assert kv.recipes[0].options[-2:] == ["--set", "run.seed=0"]
    assert [r.name for r in kv.prepare] == ["prepare"]
    assert "--train-data" not in kv.prepare[0].options
    deep = load_plan(RECIPES / "depth-small.toml", work="W", only=["deep4"])
    assert [r.name for r in deep.recipes] == ["deep4-s0", "deep4-s1"]
    options = deep.recipes[0].options
    assert options[options.index("--drafter-layers") + 1] == "4"
    assert options.count("--drafter-layers") == 1  # the recipe's value replaces the shared one
    assert options[options.index("--train-data") + 1] == "W/generated"


def test_smoke_gives_the_set_keys_values_the_tiny_drafter_takes() -> None:
    full = load_plan(RECIPES / "capacity.toml")
    smoke = load_plan(RECIPES / "capacity.toml", smoke=True)
    assert full.recipes[0].options[-4:] == [
        "--set", "model.num_kv_heads=12", "--set", "model.intermediate_size=4096",
    ]  # fmt: skip
    assert smoke.recipes[0].options[0] == "--smoke"
    assert smoke.recipes[0].options[-4:] == [
        "--set", "model.num_kv_heads=1", "--set", "model.intermediate_size=96",
    ]  # fmt: skip
    assert smoke.recipes[1].options[-2:] == ["--set", "model.num_kv_heads=1"]  # not the MLP's
    assert "--unseen-past-cap" in full.prepare[0].options
    assert smoke.prepare[0].options[smoke.prepare[0].options.index("--unseen-past-cap") + 1] == "0"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[recipe]]\nname = "a"\n[recipes]\n', "unknown key 'recipes'"),
        ("[[recipe]]\n", "each [[recipe]] needs name"),
        ('[[recipe]]\nname = "a"\n[[recipe]]\nname = "a"\n', "names must differ: a, a"),
        ("about = 'none'\n", "no [[recipe]]"),
        ("[[recipe]\n", "is not valid TOML"),
        ('extends = "nowhere.toml"\n[[recipe]]\nname = "a"\n', "nowhere.toml: no such recipe file"),
    ],
)
def test_a_malformed_file_is_refused_naming_the_file(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "r.toml"
    path.write_text(text)
    with pytest.raises(RecipeError, match=r".*r\.toml|nowhere") as refused:
        load_plan(path)
    assert message in str(refused.value)


def test_the_recipes_take_the_visible_gpus_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recipe i runs on GPU i mod n of CUDA_VISIBLE_DEVICES; with no GPU the env is unchanged."""
    from bench.compare_recipes import gpu_env, visible_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    gpus = visible_gpus()
    assert gpus == ["2", "5"]
    assert [gpu_env(i, gpus)["CUDA_VISIBLE_DEVICES"] for i in range(5)] == list("25252")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []
    assert gpu_env(3, []) == dict(os.environ)
