"""`trainer.commands.plan`: the split arithmetic, and a real measurement of both roles on a tiny demo
target printing every split of a node."""

from __future__ import annotations

import json

import pytest

from trainer.commands.plan import Rates, colocated, format_report, main, predict, report
from trainer.split.split_rule import default_target_gpus


def rates(rt: float, rd: float) -> Rates:
    return Rates(
        r_target=rt,
        r_drafter=rd,
        tokens_per_batch=1.0,
        target_s_per_batch=1 / rt,
        drafter_s_per_batch=1 / rd,
        target_device="cpu",
        drafter_device="cpu",
    )


@pytest.mark.parametrize("gpus", [2, 3, 8])
def test_predict_is_the_slower_side_of_every_split(gpus: int) -> None:
    r = rates(2.25e3, 4.5e3)
    splits = predict(r, gpus)
    assert [(s.targets, s.drafters) for s in splits] == [(t, gpus - t) for t in range(1, gpus)]
    for s in splits:
        assert s.tokens_per_s == min(s.targets * 2.25e3, s.drafters * 4.5e3)
        assert s.bound_by == ("target" if s.targets * 2.25e3 < s.drafters * 4.5e3 else "drafter")
    assert predict(r, 1) == []
    assert colocated(r) == pytest.approx(1 / (1 / 2.25e3 + 1 / 4.5e3))


def test_seed_node_prefers_five_plus_three() -> None:
    # the seed's measured-by-hand situation: 6 + 2 drafter-bound, 5 + 3 better
    best = max(predict(rates(4.3e3, 7.2e3), 8), key=lambda s: s.tokens_per_s)
    assert (best.targets, best.drafters) == (5, 3)


# bench/results/split/: one H200 a role, Qwen3-8B-shaped target, 5-layer drafter
H200_RATES = (30_156.0, 24_982.0)


def test_default_split_is_half_the_gpus() -> None:
    assert [default_target_gpus(g) for g in (0, 1, 2, 3, 4, 8, 16)] == [0, 0, 1, 1, 2, 4, 8]


@pytest.mark.parametrize("gpus", range(2, 17))
def test_default_split_is_near_the_best_at_the_measured_rates(gpus: int) -> None:
    """At the rates measured on H200s the default split predicts the best rate for G ≤ 11 and
    every odd G, and stays within 6 % of it up to 16; the ≈ 0.6·G rule it replaced lost up to a
    third."""
    splits = {s.targets: s.tokens_per_s for s in predict(rates(*H200_RATES), gpus)}
    best = max(splits.values())
    default = splits[default_target_gpus(gpus)]
    assert default >= (best if gpus <= 11 or gpus % 2 else 0.94 * best)
    assert default >= splits[min(gpus - 1, max(1, round(0.6 * gpus)))]


def test_report_names_the_default_split_beside_the_best() -> None:
    r = report(rates(4.3e3, 7.2e3), 8)
    assert (r["best"]["targets"], r["default"]["targets"]) == (5, 4)
    lines = format_report(r).splitlines()
    assert [line.split()[0] for line in lines if line.endswith("<- best")] == ["5"]
    assert [line.split()[0] for line in lines if line.endswith("<- default")] == ["4"]
    both = report(rates(*H200_RATES), 8)
    assert both["best"] == both["default"] and "<- best, default" in format_report(both)
    assert report(rates(*H200_RATES), 1)["default"] is None


def test_report_marks_the_default_of_the_model_shapes_and_says_its_flops() -> None:
    """With the roles' work per token known, the default row is theirs (here a target costing
    six times the drafter: 6 + 2 of 8 beside ⌊G/2⌋'s 4), and the report says the two figures."""
    from trainer.split.split_shapes import RoleWork

    work = RoleWork(target_flops=60e9, drafter_flops=10e9, tokens=49152)
    r = report(rates(4.3e3, 7.2e3), 8, work=work)
    assert (r["best"]["targets"], r["default"]["targets"]) == (5, 6)
    assert r["default_from"] == {"target_flops": 60e9, "drafter_flops": 10e9, "tokens": 49152}
    text = format_report(r)
    assert [line.split()[0] for line in text.splitlines() if line.endswith("<- default")] == ["6"]
    assert (
        "default split from model FLOPs per token at 49,152 tokens a sequence: target "
        "60.0 GFLOP, drafter 10.0 GFLOP" in text
    )
    assert report(rates(4.3e3, 7.2e3), 8)["default_from"] is None


def test_the_report_names_the_memory_of_a_rank_where_it_was_measured() -> None:
    from dataclasses import replace

    measured = replace(rates(4.3e3, 7.2e3), target_peak_gib=96.04, drafter_peak_gib=55.0)
    assert "memory per rank (peak): target 96.0 GiB, drafter 55.0 GiB" in format_report(
        report(measured, 8)
    )
    assert "memory" not in format_report(report(rates(4.3e3, 7.2e3), 8))  # the CPU: none


def test_plan_measures_a_tiny_config(tmp_path, capsys) -> None:
    from tests.trainer.test_split import DEMO, write_config
    from trainer.settings.config import DemoConfig
    from trainer.setup.demo import ensure_demo_assets

    assets = tmp_path / "assets"
    ensure_demo_assets(assets, DemoConfig(enabled=True, **DEMO))
    cfg = write_config(tmp_path / "c.toml", assets)
    assert (
        main(["--config", str(cfg), "--gpus", "4", "--json", "--steps", "2", "--warmup", "1"]) == 0
    )
    r = json.loads(capsys.readouterr().out)
    assert r["rates"]["r_target"] > 0 and r["rates"]["r_drafter"] > 0
    from trainer.settings.loading import load_config
    from trainer.split.split_shapes import role_work

    work = role_work(load_config(cfg))  # the demo's shapes: the default row is theirs
    assert r["default_from"] == {**vars(work)}
    assert r["default"]["targets"] == work.target_gpus(4)
    assert r["rates"]["target_peak_gib"] is None  # measured on a GPU only
    assert [(s["targets"], s["drafters"]) for s in r["splits"]] == [(1, 3), (2, 2), (3, 1)]
    assert r["best"]["tokens_per_s"] == max(s["tokens_per_s"] for s in r["splits"])


def test_every_shape_of_the_timed_batches_is_warmed_up_first() -> None:
    """A timed batch of a shape the warm-up has not met would time its compile; such shapes
    get one untimed step first, each once."""
    import torch

    from trainer.commands.plan import warmup_batches
    from trainer.data.dataset import Batch

    def batch(length: int, anchors: int) -> Batch:
        return Batch(
            input_ids=torch.zeros(2, length, dtype=torch.long),
            lengths=torch.full((2,), length),
            anchors=torch.zeros(2, anchors, dtype=torch.long),
            valid=torch.ones(2, anchors, dtype=torch.bool),
            labels=torch.zeros(2, anchors, 4, dtype=torch.long),
        )

    warm = [batch(128, 8)]
    timed = [batch(128, 8), batch(256, 8), batch(256, 8), batch(128, 16), batch(384, 8)]
    got = warmup_batches(warm, timed)
    assert got[0] is warm[0]
    assert [id(g) for g in got[1:]] == [id(timed[i]) for i in (1, 3, 4)]
    assert [id(g) for g in warmup_batches([], timed[:1])] == [id(timed[0])]
