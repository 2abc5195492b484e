"""`python -m trainer smoke` on the CPU path: the production step against its float64 reference,
the reference against the loss's own written-out definition, and a broken step being caught."""

from __future__ import annotations

import json

import torch

from tests.trainer.test_loss import reference
from trainer.commands import smoke
from trainer.model.attention import build_draft_mask

TINY = smoke.Shape(
    batch=2, heads=4, kv_heads=2, head_dim=8, context=64, blocks=3, block_size=4, vocab=97
)


def test_cpu_run_passes_and_reports_errors_and_times():
    report = smoke.run(force_cpu=True)
    assert report["ok"], report.get("error")
    assert report["backend"] == "sdpa" and report["device"] == "cpu"
    bounds = smoke.TOLERANCE["cpu"]
    assert report["rel_errors"]["loss"] <= bounds["loss"]
    assert all(report["rel_errors"][f"grad_{n}"] <= bounds["grad"] for n in "qkv")
    assert report["first_step_s"] > 0 and report["step_s"] > 0


def test_main_prints_one_json_object(capsys):
    assert smoke.main(["--json", "--cpu"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["ok"] is True


def test_vectorised_reference_loss_matches_the_written_out_definition():
    g = torch.Generator().manual_seed(3)
    n, b, d, v = 6, 5, 12, 40
    hidden = torch.randn(n, b, d, generator=g, dtype=torch.float64)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64) / 2
    target = hidden + 0.5 * torch.randn(n, b, d, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (n, b), generator=g)
    labels[torch.rand(n, b, generator=g) < 0.3] = -100
    labels[0, 1] = -100  # a block whose slot 1 is unsupervised: left out of cap
    want = reference(
        hidden, weight, labels, gamma=smoke.GAMMA, target_hidden=target,
        kl_weight=smoke.KL_WEIGHT, cap_weight=smoke.CAP_WEIGHT,
    )[0]  # fmt: skip
    got = smoke.reference_loss(hidden, weight, labels, target)
    assert abs(float(got) - float(want)) <= 1e-10 * abs(float(want))


def test_a_step_with_the_wrong_mask_is_caught():
    """The comparison can fail: attention that is causal inside the block is not the drafter's."""
    inputs = smoke.make_inputs(TINY, device=torch.device("cpu"), dtype=torch.float32, seed=1)
    wrong = build_draft_mask(
        inputs.anchors, inputs.valid, TINY.context, TINY.block_size, causal_in_block=True,
        backend="sdpa",
    )  # fmt: skip
    loss, grads = smoke.step(inputs, TINY, wrong)
    ref_loss, ref_grads = smoke.reference_step(inputs, TINY)
    errors = [smoke.rel_error(g, r) for g, r in zip(grads, ref_grads, strict=True)]
    assert max(errors) > 100 * smoke.TOLERANCE["cpu"]["grad"]
    right = build_draft_mask(
        inputs.anchors, inputs.valid, TINY.context, TINY.block_size, backend="sdpa"
    )
    loss, grads = smoke.step(inputs, TINY, right)
    assert smoke.rel_error(loss, ref_loss) <= smoke.TOLERANCE["cpu"]["loss"]
    assert all(
        smoke.rel_error(g, r) <= smoke.TOLERANCE["cpu"]["grad"]
        for g, r in zip(grads, ref_grads, strict=True)
    )
