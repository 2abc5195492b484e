"""`bench/bench_eval.py --smoke` on the CPU: a tiny target trained on standard-library sources,
two drafter points, each with held-out τ, prompt lookup's τ, training-prompt τ, samples and
epochs, on greedy and sampled answers interleaved; then the same target reused with training data
given from outside (`--train-data`, several sources), and `--prepare-only`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_helpers import REPO
from trainer.data.dataset import load_samples

SCRIPT = REPO / "bench" / "bench_eval.py"
BLOCK = 4  # the smoke drafter's block size


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def check_point(point: dict, *, samples: int, steps: int, batch: int = 4) -> None:
    assert point["samples"] == samples
    assert point["drafter"]["steps"] == steps
    assert point["epochs"] == steps * batch / samples
    for row in (point["held_out"], point["baselines"]["prompt_lookup"], point["train_prompts"]):
        assert 1.0 <= row["tau"] <= BLOCK
        assert row["lossless"] is True and row["lossless_checked"] is True
        assert row["tau"] == pytest.approx(1 + sum(row["slot_acceptance"]))
    for row in (point["held_out"], point["train_prompts"]):  # the drafter's, not the baseline's
        assert len(row["slot_accuracy"]) == BLOCK - 1
        assert all(0.0 <= a <= 1.0 for a in row["slot_accuracy"])
    assert point["baselines"]["prompt_lookup"]["slot_accuracy"] is None
    exported = point["exported"]  # the same drafter read back from its exported folder
    assert exported["lossless"] is True and exported["prompts"] == point["held_out"]["prompts"]
    assert (Path(exported["folder"]) / "model.safetensors").is_file()


def test_smoke_points_and_train_data(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "eval.json"
    run = bench(
        "--work", str(work), "--out", str(out), "--gen-temperatures", "0,1",
        "--gen-sampled-prefix", "2",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["recipe"]["gen_temperatures"] == [0.0, 1.0]
    assert result["recipe"]["gen_sampled_prefix"] == 2
    assert result["target"]["steps"] == 20  # a step count, not a time budget: the same target
    assert "temperatures 0, 1 (sampled prefix 2)" in result["training_data"]
    # by default every 4th file is kept from the target and gives the drafter's prompts
    assert result["recipe"]["unseen_every"] == 4
    assert result["recipe"]["drafter_prompts"] == "unseen-files"
    assert "answers to windows of the unseen-files" in result["training_data"]
    assert "kept from the target" in run.stdout and not (work / "generated").exists()
    greedy = load_samples(work / "generated-unseen")
    sampled = load_samples(work / "generated-unseen-t1-p2")
    assert len(greedy) == len(sampled) == 16  # one answer per prompt and temperature
    prompt_len = greedy[0].loss_mask.index(True)
    assert all(s.loss_mask.index(True) == prompt_len + 2 for s in sampled)  # prefix unsupervised
    # the first 8 samples trained on alternate between the two sources
    trained = [json.loads(line)["input_ids"] for line in (work / "train-8.jsonl").open()]
    assert trained == [s.input_ids for i in range(4) for s in (greedy[i], sampled[i])]
    assert any(greedy[i].input_ids != sampled[i].input_ids for i in range(16))
    assert [p["samples"] for p in result["points"]] == [8, 16]
    # each trainer.generation.generate run's rate, then plain generate against trainer.generation.decode, same run
    runs = result["generation"]["trainer_generate"]
    assert [r["data"] for r in runs] == ["generated-unseen", "generated-unseen-t1-p2"]
    for run_row, made in zip(runs, (greedy, sampled), strict=True):
        assert run_row["samples"] == len(made)
        assert run_row["answer_tokens"] == sum(sum(s.loss_mask) for s in made)
        assert run_row["tokens_per_s"] == run_row["answer_tokens"] / run_row["seconds"]
    engines = result["generation"]["engines"]
    assert engines["prompts"] == 16 and engines["timed_prompts"] == 8  # the first batch warms up
    assert [r["engine"] for r in engines["rows"]] == [
        "transformers generate",
        "trainer.generation.decode",
    ]
    hf, ours = (r["tokens_per_s"] for r in engines["rows"])
    assert all(0 < r["answer_tokens"] <= 8 * 24 for r in engines["rows"])
    assert engines["speedup_vs_generate"] == ours / hf
    assert engines["identical_answers"] == 1.0  # fp32 on the CPU: the same greedy answers
    # every point trains the steps that fit the time budget at the measured step time
    steps = max(1, int(0.3 / result["drafter_step_s"]))
    for point in result["points"]:
        check_point(point, samples=point["samples"], steps=steps)
    # the largest point's fields at the top level
    assert result["samples"] == 16 and result["epochs"] == steps * 4 / 16
    assert result["held_out"] == result["points"][-1]["held_out"]
    assert result["train_prompts"] == result["points"][-1]["train_prompts"]
    lookup = result["baselines"]["prompt_lookup"]
    assert lookup["max_n"] == 4 and lookup["prompts"] == result["held_out"]["prompts"] == 2
    assert "prompt lookup (n 4…1):" in run.stdout

    data = tmp_path / "data.jsonl"  # data made elsewhere with the same target
    shutil.copy(work / "train-8.jsonl", data)
    sources = f"{data},{work / 'generated-unseen-t1-p2'}"
    again = bench(
        "--work", str(work), "--out", str(out), "--reuse-target", "--train-data", sources,
        "--drafter-steps", "4", "--feature-layers", "0", "--kl-weight", "0.5",
        "--set", "loss.gamma=2", "--set", "model.init_layers=[1]", "--export-dtype", "fp32",
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    reused = json.loads(out.read_text())
    assert reused["training_data"] == sources.replace(",", ", ")
    assert reused["target"] == {"reused": str(work / "target")}
    assert reused["generation"] is None  # no data made here
    assert reused["recipe"]["feature_layers"] == [0] and reused["recipe"]["kl_weight"] == 0.5
    assert reused["recipe"]["overrides"] == ["loss.gamma=2", "model.init_layers=[1]"]
    # the reused target's own split; the given data's prompts are not known here
    assert reused["recipe"]["unseen_every"] == 4 and reused["recipe"]["drafter_prompts"] is None
    assert reused["recipe"]["gen_temperatures"] is None  # not this run's unused default
    (manifest,) = (work / "run-8").glob("step-*/manifest.json")  # what the drafter trained with
    resolved = json.loads(manifest.read_text())["resolved"]
    assert resolved["loss.gamma"] == 2.0 and resolved["model.init_layers"] == [1]
    assert [p["samples"] for p in reused["points"]] == [8, 16]  # of 8 + 16 given
    check_point(reused["points"][0], samples=8, steps=4)
    for point in reused["points"]:  # fp32 weights through the folder: the very same drafts
        exported, held_out = point["exported"], point["held_out"]
        assert exported["dtype"] == "fp32"
        assert exported["prompt_counts"] == held_out["prompt_counts"]
        assert exported["slot_acceptance"] == held_out["slot_acceptance"]
    assert reused["baselines"]["prompt_lookup"]["tau"] == lookup["tau"]  # same target, prompts

    prepared = bench(
        "--work", str(work), "--out", str(out), "--reuse-target", "--train-data", str(data),
        "--prepare-only",
    )  # fmt: skip
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    assert json.loads(out.read_text())["mode"] == "prepare"
    assert "prompt lookup" not in prepared.stdout  # stopped before the baseline

    typo = bench("--work", str(work), "--set", "loss.gama=2")
    assert typo.returncode == 2 and "--set: loss.gama: unknown key" in typo.stderr
    # checked against the benchmark's own drafter (one layer in the smoke run)
    wrong = bench("--work", str(work), "--set", "model.init_layers=[0,1]")
    assert (
        wrong.returncode == 2
        and "one target layer index (≥ 0) per drafter layer (1" in wrong.stderr
    )
    refused = bench("--work", str(work), "--train-data", str(data))
    assert refused.returncode == 2 and "--train-data needs --reuse-target" in refused.stderr
    # the held-out files depend on the split: another one could hold out what the target learnt
    other = bench("--work", str(work), "--reuse-target", "--train-data", str(data),
                  "--prepare-only", "--holdout-every", "7")  # fmt: skip
    assert other.returncode != 0 and "was trained with the corpus split" in other.stderr
    bad = bench("--work", str(work), "--gen-temperatures", "0,0")
    assert bad.returncode == 2 and "distinct temperatures" in bad.stderr


def test_corpus_split_keeps_files_from_the_target_without_moving_the_held_out_ones() -> None:
    from bench.eval_corpus import corpus

    plain, split = corpus(400_000, 4, 0), corpus(400_000, 4, 3)
    assert split.held == plain.held  # the evaluation's prompts do not depend on the split
    assert plain.unseen == []
    assert sorted(split.train + split.unseen) == sorted(plain.train)
    assert not set(split.train) & set(split.unseen)
    assert split.unseen == plain.train[2::3]  # every third file the target would have learnt


def test_files_past_the_cap_add_unseen_code_and_leave_the_rest_as_it_was() -> None:
    """`--unseen-past-cap`: more code for the drafter's prompts; the target learns the same
    files and the evaluation holds out the same ones."""
    from bench.bench_eval import parse_args
    from bench.eval_corpus import corpus

    capped, more = corpus(400_000, 4, 3), corpus(400_000, 4, 3, past_cap=300_000)
    assert more.train == capped.train and more.held == capped.held
    assert more.unseen[: len(capped.unseen)] == capped.unseen
    extra = more.unseen[len(capped.unseen) :]
    everything = corpus(10**9, 4, 3)  # the files past the cap, in the same order
    assert extra and all(text in everything.train + everything.unseen for text in extra)
    assert not set(extra) & set(everything.held)  # a held-out place stays out
    assert 300_000 <= sum(map(len, extra)) < 300_000 + max(map(len, extra))
    assert more.past_cap_bytes == sum(map(len, extra)) and capped.past_cap_bytes == 0
    assert more.package_bytes == 0  # the standard library had enough past the cap
    assert "0.0 MB of installed packages" in more.describe(400_000, 300_000)
    assert "past --corpus-bytes" not in capped.describe(400_000, 0)
    assert parse_args(["--unseen-every", "0", "--unseen-past-cap", "1000"]).drafter_prompts == (
        "unseen-files"
    )
    with pytest.raises(SystemExit):
        parse_args(["--unseen-past-cap", "-1"])


def test_past_the_end_of_the_standard_library_packages_sources_are_kept() -> None:
    """A Python whose standard library ends before the cap (builds without the test suite):
    the rest of `--unseen-past-cap` comes from installed packages' sources, none of them a
    copy of a held-out file; the target's and the held-out files are those of the whole
    library."""
    from bench.eval_corpus import corpus, package_sources

    whole = corpus(10**10, 20, 4)
    more = corpus(10**10, 20, 4, past_cap=400_000)
    assert more.train == whole.train and more.held == whole.held
    assert more.unseen[: len(whole.unseen)] == whole.unseen
    added = more.unseen[len(whole.unseen) :]
    assert more.package_bytes == more.past_cap_bytes == sum(map(len, added)) >= 400_000
    want, _ = package_sources(400_000, whole.held)
    assert added == want and not set(added) & set(whole.held)
    assert "MB of installed packages' sources" in more.describe(10**10, 400_000)


def test_package_files_that_copy_held_out_code_are_left_out(tmp_path: Path) -> None:
    from bench.eval_corpus import package_sources

    held = "\n".join(
        f"    value_{i} = compute_something_long(argument_{i}, other)" for i in range(40)
    )
    fresh = [
        "\n".join(f"    name_{k}_{i} = another_function_call(thing_{i}, more)" for i in range(30))
        for k in range(6)
    ]
    for k, text in enumerate(fresh):
        (tmp_path / f"pkg{k}").mkdir()
        (tmp_path / f"pkg{k}" / "mod.py").write_text(text)
    vendored = held.replace("value_3 =", "changed_3 =")  # a near copy of the held-out file
    (tmp_path / "backport").mkdir()
    (tmp_path / "backport" / "copy.py").write_text(vendored)
    (tmp_path / "tiny.py").write_text("x = 1\n")  # a stub: too short to count
    texts, left_out = package_sources(10**9, [held], root=tmp_path)
    assert sorted(texts) == sorted(fresh) and left_out == 1
    some, _ = package_sources(len(fresh[0]) + 1, [held], root=tmp_path)
    assert len(some) == 2 and set(some) <= set(fresh)  # stops once the budget is reached
    assert package_sources(10**9, [held], root=tmp_path)[0] == texts  # the same order each time


def windows_of(stream: list[int], prompts: list[list[int]]) -> bool:
    """Whether every prompt is a run of consecutive tokens of `stream`."""
    text = "," + ",".join(map(str, stream)) + ","
    return all("," + ",".join(map(str, p)) + "," in text for p in prompts)


def test_drafter_prompts_from_files_the_target_never_learnt(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from bench.eval_corpus import corpus
    from bench.eval_target import encode

    work, out = tmp_path / "work", tmp_path / "prepare.json"
    split = ("--unseen-every", "2", "--drafter-prompts", "unseen-files", "--gen-temperatures", "0")
    run = bench("--work", str(work), "--out", str(out), "--prepare-only", *split)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "kept from the target" in run.stdout
    tokenizer = AutoTokenizer.from_pretrained(str(work / "target"), local_files_only=True)
    texts = corpus(150_000, 20, 2)  # the smoke run's corpus
    unseen, learnt = (encode(tokenizer, t).tolist() for t in (texts.unseen, texts.train))
    prompts = [json.loads(line)["input_ids"] for line in (work / "generate-prompts.jsonl").open()]
    assert len(prompts) == 16 and windows_of(unseen, prompts)
    assert not windows_of(learnt, prompts)
    answers = load_samples(work / "generated-unseen")
    assert sorted(s.input_ids[: len(prompts[0])] for s in answers) == sorted(prompts)

    # data made anew from a reused target must come from the split it was trained with
    other = bench("--work", str(work), "--reuse-target", "--prepare-only", "--unseen-every", "3")
    assert other.returncode != 0 and "was trained with the corpus split" in other.stderr
    again = bench("--work", str(work), "--reuse-target", "--prepare-only", "--out", str(out),
                  "--drafter-prompts", "target-files", "--gen-temperatures", "0")  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]  # its saved split: the target's own files
    assert len(load_samples(work / "generated")) == 16
    prompts = [json.loads(line)["input_ids"] for line in (work / "generate-prompts.jsonl").open()]
    assert windows_of(learnt, prompts) and not windows_of(unseen, prompts)

    for argv, message in (
        (("--unseen-every", "0", "--drafter-prompts", "unseen-files"), "needs files kept"),
        (("--unseen-every", "1"), "0 (no file kept from the target) or K ≥ 2"),
    ):
        refused = bench("--work", str(work), *argv)
        assert refused.returncode == 2 and message in refused.stderr


def test_points_train_three_epochs_or_the_steps_given() -> None:
    """Each point's steps: 3 passes over its samples and at least 600 by default (the same on
    every GPU), one count for all, or one per point with the samples sorted; bad lists refused
    before anything runs."""
    from bench.bench_eval import parse_args, point_plan

    default = parse_args([])
    assert default.samples == [2048, 20480, 262144]
    assert point_plan(default, 10**6) == {2048: 600, 20480: 600, 262144: 6144}
    assert point_plan(default, 50_000) == {2048: 600, 20480: 600, 50_000: 1172}  # all there are
    assert point_plan(default, 2000) == {2000: 600}  # every count past the data: one point
    given = parse_args(["--samples", "20480,2048", "--drafter-steps", "100,900"])
    assert point_plan(given, 10**6) == {2048: 100, 20480: 900}  # smallest point first
    assert point_plan(parse_args(["--drafter-steps", "50"]), 10**6) == dict.fromkeys(
        [2048, 20480, 262144], 50
    )
    assert point_plan(parse_args(["--drafter-steps", "0"]), 10**6) == dict.fromkeys(
        [2048, 20480, 262144], 0
    )  # from the time budget
    for steps in ("100,200", "0,5,5", "x"):
        with pytest.raises(SystemExit) as refused:
            parse_args(["--drafter-steps", steps])
        assert refused.value.code == 2


COMPARE = REPO / "bench" / "compare_recipes.py"


def test_recipes_side_by_side_share_one_target_and_data(tmp_path: Path) -> None:
    """`compare_recipes.py`: one preparation, then every recipe's own run on it, at once."""
    work, out = tmp_path / "work", tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(COMPARE), "--work", str(work), "--out", str(out),
         "--prepare", "--smoke --gen-temperatures 0,1 --gen-sampled-prefix 0",
         "--recipe", "greedy: --smoke --drafter-steps 2 --train-data {work}/generated-unseen",
         "--recipe", "mixed: --smoke --drafter-steps 2 --kl-weight 0.5 "
                     "--train-data {work}/generated-unseen,{work}/generated-unseen-t1"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    greedy, mixed = (json.loads((out / f"{n}.json").read_text()) for n in ("greedy", "mixed"))
    assert json.loads((out / "prepare.json").read_text())["mode"] == "prepare"  # beside them
    # one target for both: the same prompt lookup figure on the same prompts
    assert greedy["target"] == {"reused": str(work / "greedy" / "target")}
    assert (work / "greedy" / "target").resolve() == (work / "target").resolve()
    lookups = [{k: v for k, v in r["baselines"]["prompt_lookup"].items() if k != "seconds"}
               for r in (greedy, mixed)]  # fmt: skip
    assert lookups[0] == lookups[1]
    assert greedy["training_data"] == str(work / "generated-unseen")
    assert mixed["recipe"]["kl_weight"] == 0.5 and greedy["recipe"]["kl_weight"] == 0.15
    table, versus = (out / "summary.md").read_text().split("\n\n")
    table = table.splitlines()
    assert table[0].startswith("| recipe | samples |") and len(table) == 2 + 2 + 2  # 2 points each
    assert table[2].startswith("| greedy | 8 | 2 |") and table[4].startswith("| mixed | 8 | 2 |")
    assert len(table[2].split("|")[-2].split()) == BLOCK - 1  # held-out accuracy by slot
    tau, interval = (
        greedy["points"][0]["held_out"]["tau"],
        greedy["points"][0]["held_out"]["tau_interval"],
    )
    assert table[2].split("|")[5].strip() == f"{tau:.2f} ({interval[0]:.2f}–{interval[1]:.2f})"
    assert table[2].split("|")[6].strip() == f"{greedy['points'][0]['exported']['tau']:.2f}"
    # mixed against greedy, paired over the same held-out prompts, at each point
    from trainer.evaluation.tau_bootstrap import tau_difference

    rows = versus.splitlines()
    assert rows[0] == "| recipe | samples | held-out τ − greedy's (95 % paired interval) |"
    for row, point, ref in zip(rows[2:], mixed["points"], greedy["points"], strict=True):
        diff, lo, hi = tau_difference(
            point["held_out"]["prompt_counts"], ref["held_out"]["prompt_counts"]
        )
        assert row == f"| mixed | {point['samples']:,} | {diff:+.2f} ({lo:+.2f}…{hi:+.2f}) |"
        assert diff == pytest.approx(point["held_out"]["tau"] - ref["held_out"]["tau"])

    bad = subprocess.run(
        [sys.executable, str(COMPARE), "--work", str(work), "--out", str(out), "--skip-prepare",
         "--recipe", "a: --smoke", "--recipe", "a: --smoke"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "recipe names must differ" in bad.stderr


def test_summary_reads_results_written_before_the_export_was_measured() -> None:
    """A stored H200 result without `exported`: its row says so instead of failing the table."""
    from bench.compare_recipes import load_results, summary

    stored = REPO / "bench" / "results" / "prompt-sources-h200"
    results = load_results(stored, ["target-files", "unseen-files"])
    rows = summary(results)
    assert len(rows) == 2 + 2
    cells = rows[2].split("|")
    assert cells[1].strip() == "target-files" and cells[6].strip() == "—"
    assert cells[5].strip().startswith("2.22 (") and cells[10].strip() == "—"  # nor the cost


def test_a_point_on_all_of_one_generated_run_reads_its_shards_in_place(tmp_path: Path) -> None:
    from bench.bench_eval import point_data
    from trainer.data.shards import shard_name, write_shard

    folder = tmp_path / "generated"
    folder.mkdir()
    rows = [([i, i + 1, i + 2, i + 3, i + 4], [False, False, True, True, True]) for i in range(6)]
    write_shard(folder / shard_name(0), rows[:4])
    write_shard(folder / shard_name(1), rows[4:])
    work = tmp_path / "work"
    work.mkdir()
    every = load_samples(folder)
    assert point_data(work, every) == folder  # nothing copied
    assert point_data(work, every[:6]) == folder  # a slice that is all of it, too
    assert list(work.iterdir()) == []
    first = point_data(work, every[:3])  # a part: a file of just those samples
    assert first == work / "train-3.jsonl"
    assert [s.input_ids for s in load_samples(first)] == [list(r[0]) for r in rows[:3]]
    cut = point_data(work, load_samples(folder, max_len=4))  # cut samples: not the folder's
    assert cut == work / "train-6.jsonl"
    assert [len(s.input_ids) for s in load_samples(cut)] == [4] * 6


def test_a_lossless_violation_is_logged_and_tau_still_measured(tmp_path_factory, capsys) -> None:
    from bench.bench_eval import measure
    from tests.trainer.demo_target import demo_target
    from trainer.evaluation.prompt_lookup import PromptLookupDrafter
    from trainer.evaluation.speculative import greedy_outputs

    target = demo_target(tmp_path_factory)
    prompts = [[5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11]]
    want = greedy_outputs(target, prompts, 8)
    lookup = PromptLookupDrafter(block_size=4, max_n=2)
    clean = measure(target, lookup, prompts, 8, expected=want)
    assert clean["lossless"] is True and clean["lossless_violation"] is None
    wrong = [want[0], [*want[1][:3], (want[1][3] + 1) % 256, *want[1][4:]]]
    row = measure(target, lookup, prompts, 8, expected=wrong)
    assert row["lossless"] is False and row["lossless_checked"] is False
    assert row["lossless_violation"].startswith("prompt 1: new token 3 is")
    assert row["tau"] == clean["tau"]  # the same decoding, measured without the check
    assert "lossless check: prompt 1: new token 3" in capsys.readouterr().out
