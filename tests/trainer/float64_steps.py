"""Float64 training steps on a real (tiny) target, for tests that compare two ways of taking the
same step: the features of a fixed batch, and the comparisons."""

from __future__ import annotations

import pytest
import torch

from trainer.data.dataset import Batch
from trainer.loss.dflash_loss import IGNORE_INDEX
from trainer.model.target import Target
from trainer.run.pipeline import StepResult
from trainer.run.target_worker import Features, TargetWorker


def features(target: Target, seed: int) -> Features:
    """Five sequences of different lengths, some blocks invalid and some labels ignored."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([32, 20, 28, 12, 32])
    anchors = torch.tensor([[4, 10, 20], [3, 9, 0], [6, 15, 22], [2, 0, 0], [5, 11, 25]])
    valid = anchors > 0
    labels = torch.randint(0, 200, (5, 3, 4), generator=g)
    labels[~valid] = IGNORE_INDEX
    labels[:, :, 0] = IGNORE_INDEX
    labels[2, 1, 2:] = IGNORE_INDEX
    batch = Batch(
        input_ids=torch.randint(1, 200, (5, 32), generator=g),
        lengths=lengths,
        anchors=anchors,
        valid=valid,
        labels=labels,
    )
    f = TargetWorker(target).produce(batch)
    return Features(
        **{k: v.double() if v.is_floating_point() else v for k, v in f.tensors().items()},
        num_tokens=f.num_tokens,
    )


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def same_result(got: StepResult, want: StepResult) -> None:
    for name in ("loss", "ce", "kl", "cap", "grad_norm"):
        assert getattr(got, name) == pytest.approx(getattr(want, name), rel=1e-10), name
    assert got.slot_accuracy == pytest.approx(want.slot_accuracy, rel=1e-12)
    assert got.tokens == want.tokens
