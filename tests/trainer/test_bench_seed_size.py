"""bench/seed_size.py: the whole script on the CPU with a tiny random Qwen3.5-shaped target (each
stage in its own process, the split on two gloo ranks), the node plan's arithmetic from given
rates, and the model FLOPs it divides by."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.flops import attention_pairs, delta_rule_flops_per_token, target_forward_flops
from bench.seed_plan import plan_summary, summary_fields
from bench.seed_size import main, parse_caps

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_smoke_runs_every_stage_and_writes_the_record(tmp_path: Path) -> None:
    out = tmp_path / "seed-size"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "seed_size.py"), "--cpu-smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    ended = {name: stage["ended"] for name, stage in s["stages"].items()}
    ended["split"] = ended["split"].split(" (second try")[0]  # a second try is said, and taken
    assert ended == {
        "target": "done",
        "drafter": "done",
        "drafter-recompute": "done",
        "target-fallback": "done",
        "drafter-flash": "not started: a GPU stage",
        "target-compiled": "not started: a GPU stage",
        "split": "done",
    }, run.stderr[-3000:]
    assert (s["gpu"], s["torch"]) == ("cpu", torch.__version__)
    t, d, plan = s["target"], s["drafter"], s["plan"]
    assert t["tokens"] == t["fallback_tokens"] == 256
    assert t["tokens_per_s"] > 0 and t["mfu"] > 0 and t["fallback_tokens_per_s"] > 0
    # without the kernels extra (and on the CPU) both stages ran transformers' reference
    reference = {"gated delta rule": "PyTorch reference", "causal conv1d": "PyTorch F.conv1d"}
    assert t["linear_attention"] == reference
    assert [r["tokens"] for r in t["rows"]] == [r["tokens"] for r in t["fallback_rows"]]
    assert d["mfu"] > 0 and d["tokens_per_s"] > 0 and d["step_s"] > 0
    assert d["default_kernels"]["shape"].startswith("drafter: 2 layers × 64, 8 heads (2 kv) × 8")
    again = d["recompute"]
    assert again["shape"].endswith("layers recomputed in the backward") and again["mfu"] > 0
    assert plan["with_recompute"]["best_split"] in {f"{g}+{8 - g}" for g in range(1, 8)}
    assert plan["best_split"] in {f"{g}+{8 - g}" for g in range(1, 8)}
    assert plan["best_tokens_per_s"] == max(
        x["tokens_per_s"] for x in plan["reports"]["8"]["splits"]
    )
    assert set(plan["reports"]) == {"8", "4", "2"} and plan["seed_tokens_per_s"]["5+3"] == 21_500
    split = s["split"]
    assert (split["targets"], split["drafters"]) == (1, 1) and split["measured_tokens_per_s"] > 0
    assert "plan for 8 GPUs" in run.stdout and "<- best" in run.stdout


@pytest.mark.slow
def test_a_stage_cut_at_its_cap_leaves_the_figures_of_those_before(tmp_path: Path) -> None:
    out = tmp_path / "seed-size"
    argv = [sys.executable, str(ROOT / "bench" / "seed_size.py"), "--cpu-smoke", "--out", str(out),
            "--stages", "target,target-fallback", "--caps", "target-fallback=1"]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["stages"]["target"]["ended"] == "done" and s["target"]["tokens_per_s"] > 0
    assert s["stages"]["target-fallback"]["ended"] == "cut at its cap of 1 s"
    assert s["target"]["fallback_tokens_per_s"] is None and not list(out.glob("*.tmp"))


def test_the_plan_of_eight_gpus_from_given_rates() -> None:
    """The seed's hand-measured situation (target 4.3 K, drafter 7.2 K tokens/s a GPU): 5 + 3
    is best at min(5 × 4.3 K, 3 × 7.2 K) = 21.5 K, 6 + 2 drafter-bound at 14.4 K; a target rank
    holds its forward's peak and two batches in flight."""
    target = {"target": {"rows": [{"tokens": 49152, "tokens_per_s": 4300.0, "mfu": 0.4,
                                   "peak_gib": 90.0, "features_gib": 3.0}],
                         "linear_attention": {"gated delta rule": "fla 0.6.0"}, "env": {}},
              "drafter": {"result": {"tokens": 49152, "tokens_per_s": 7200.0, "mfu": 0.5,
                                     "peak_gib": 55.0, "step_s": 49152 / 7200.0}}}  # fmt: skip
    summary = summary_fields(target, {}, max_in_flight=2)
    plan = plan_summary(summary)
    assert plan["best_split"] == "5+3" and plan["best_tokens_per_s"] == pytest.approx(21_500)
    assert plan["predicted_at_seed_splits"] == pytest.approx({"6+2": 14_400, "5+3": 21_500})
    splits = {(x["targets"], x["drafters"]): x for x in plan["reports"][8]["splits"]}
    assert len(splits) == 7 and splits[(6, 2)]["bound_by"] == "drafter"
    assert splits[(4, 4)]["tokens_per_s"] == pytest.approx(17_200)
    assert plan["reports"][4]["best"]["targets"] == 2 and plan["reports"][2]["best"]["targets"] == 1
    assert plan["memory"] == {"target_peak_gib": 96.0, "drafter_peak_gib": 55.0}
    assert "memory per rank (peak): target 96.0 GiB, drafter 55.0 GiB" in plan["reports"][8]["text"]
    assert summary["target"]["fallback_tokens_per_s"] is None
    assert plan["with_recompute"] is None  # that stage did not run
    slower = {"result": {"tokens": 49152, "tokens_per_s": 5400.0, "peak_gib": 40.0}}
    again = plan_summary(
        summary_fields({**target, "drafter-recompute": slower}, {}, max_in_flight=2)
    )
    assert again["with_recompute"] == {  # 3 × 5.4 K < 5 × 4.3 K: 4 + 4 = min(17.2 K, 21.6 K)
        "best_split": "4+4", "best_tokens_per_s": pytest.approx(17_200), "drafter_peak_gib": 40.0
    }  # fmt: skip
    assert (
        plan_summary(summary_fields({"target": target["target"]}, {}, max_in_flight=2))[
            "best_split"
        ]
        is None
    )  # no drafter rate yet: no plan


def test_bad_caps_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_caps("drafter=400,target=12.5") == {"drafter": 400.0, "target": 12.5}
    with pytest.raises(SystemExit):
        main(["--out", "x", "--caps", "drafer=400"])
    assert "'drafer=400': STAGE=SECONDS" in capsys.readouterr().err


def test_attention_pairs_are_the_dense_masks_trues() -> None:
    """Counted per slot, the pairs are exactly the dense mask's: windows narrower and wider
    than a block, causal or not, invalid blocks."""
    from trainer.model.masks import batched_dense_mask

    gen = torch.Generator().manual_seed(0)
    anchors = torch.sort(torch.randint(1, 200, (2, 37), generator=gen)).values
    valid = torch.rand(2, 37, generator=gen) > 0.2
    cases = ((4, None, False), (4, 24, True), (4, None, True), (6, 3, True), (6, 3, False))
    for block, window, causal in cases:
        kinds = {"window": window, "causal_in_block": causal}
        whole = batched_dense_mask(anchors, 256, block, valid=valid, **kinds)
        assert attention_pairs(anchors, valid, 256, block, **kinds) == int(whole.sum()) > 0


def test_the_targets_flops_count_its_own_weights_and_the_chunked_delta_rule() -> None:
    from tests.trainer.hybrid_target import hybrid_model

    model = hybrid_model()
    c = model.config
    flops = target_forward_flops(model, 100)
    linear = sum(m.weight.numel() for m in model.model.layers.modules()
                 if isinstance(m, torch.nn.Linear))  # fmt: skip
    assert flops["matmul"] == 2 * 100 * linear
    assert flops["attention"] == 2 * 4 * c.head_dim * c.num_attention_heads * 100 * 101 / 2
    per_token = 2 * 64 * (3 * 16 + 2 * 16) + 6 * 16 * 16 + 2 * 64**2 / 3
    assert delta_rule_flops_per_token(16, 16) == per_token
    assert flops["delta_rule"] == 2 * c.linear_num_value_heads * 100 * per_token
    assert flops["total"] == sum(v for k, v in flops.items() if k != "total")


def test_the_peak_is_taken_apart_from_the_allocators_history() -> None:
    """The replay finds the highest point of a trace (not its end) and groups what is alive
    there by the innermost frame of the trainer's code, else by the innermost Python frame."""
    from bench.memory_peak import _alive_at_peak, _where

    own = {"filename": "/r/trainer/model/drafter.py", "line": 9, "name": "forward"}
    lib = {"filename": "/usr/lib/torch/nn/functional.py", "line": 3, "name": "linear"}
    made = {"filename": "/tmp/torchinductor_root/ab/cab.py", "line": 1, "name": "call"}
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": [lib, own]},
        {"action": "alloc", "addr": 2, "size": 50, "frames": [made]},
        {"action": "free_requested", "addr": 2, "size": 50},
        {"action": "free_completed", "addr": 2, "size": 50},
        {"action": "alloc", "addr": 3, "size": 70, "frames": []},  # the peak: 170
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 4, "size": 90, "frames": [lib]},  # 160: lower
    ]
    alive = _alive_at_peak(trace)
    assert {addr: size for addr, (size, _) in alive.items()} == {1: 100, 3: 70}
    assert _where([lib, own]) == "model/drafter.py:9 forward"
    assert _where([made]) == "compiled code"
    assert _where([lib]) == "/usr/lib/torch/nn/functional.py:3 linear"
    assert _where([]).startswith("no Python frame")
