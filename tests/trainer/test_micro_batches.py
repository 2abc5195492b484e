"""`data.micro_batches`: a batch trained in parts of whole sequences, gradients accumulated, one
optimizer step. Against the same step over the whole batch at once (the reference), in float64
on a real (tiny) target: the same loss terms, slot accuracy, gradient norm and gradients."""

from __future__ import annotations

import pytest
import torch

from trainer.data.dataset import Batch
from trainer.loss.dflash_loss import IGNORE_INDEX
from trainer.loss.micro_batches import part_rows
from trainer.model.target import Target, load_target
from trainer.run.pipeline import DrafterWorker, StepResult
from trainer.run.target_worker import Features, TargetWorker
from trainer.settings.config import DemoConfig, TrainConfigError
from trainer.settings.loading import config_from_dict
from trainer.setup.demo import ensure_demo_assets

DEMO = DemoConfig(enabled=True, num_samples=4, num_layers=4, prompt_len=6, gen_len=10)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Target:
    target_dir, _ = ensure_demo_assets(tmp_path_factory.mktemp("assets"), DEMO)
    return load_target(target_dir, num_layers=2)


def config(micro_batches: int, batch_size: int = 5):
    return config_from_dict(
        {
            "model": {"target": "t", "num_layers": 2, "block_size": 4},
            "data": {"path": "d", "batch_size": batch_size, "micro_batches": micro_batches,
                     "noise": 0.05},
            "loss": {"kl_weight": 0.3, "cap_weight": 0.2},
            "run": {"device": "cpu"},
        }
    )  # fmt: skip


def float64_worker(target: Target, micro_batches: int) -> tuple[DrafterWorker, list]:
    """A worker in float64 whose optimizer step first records the gradients it is given."""
    torch.manual_seed(0)
    w = DrafterWorker.for_target(target, config(micro_batches), torch.device("cpu"))
    w.drafter.double()
    w.embed_weight, w.lm_head_weight = w.embed_weight.double(), w.lm_head_weight.double()
    seen: list[list[torch.Tensor]] = []
    step = w.optimizer.step

    def recording_step(*args, **kwargs):
        seen.append([p.grad.clone() for p in w.drafter.parameters()])
        return step(*args, **kwargs)

    w.optimizer.step = recording_step
    return w, seen


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
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def same_result(got: StepResult, want: StepResult) -> None:
    for name in ("loss", "ce", "kl", "cap", "grad_norm"):
        assert getattr(got, name) == pytest.approx(getattr(want, name), rel=1e-10), name
    assert got.slot_accuracy == pytest.approx(want.slot_accuracy, rel=1e-12)
    assert got.tokens == want.tokens


@pytest.mark.parametrize("parts", [2, 3, 5])
def test_parts_give_the_whole_batch_step(target, parts) -> None:
    whole, whole_grads = float64_worker(target, 1)
    split, split_grads = float64_worker(target, parts)
    for step in range(2):  # the second step starts from the weights the first one left
        f = features(target, seed=step)
        same_result(split.train_step(f, step), whole.train_step(f, step))
        for got, want in zip(split_grads[-1], whole_grads[-1], strict=True):
            assert rel(got, want) < 1e-9
    for got, want in zip(split.drafter.parameters(), whole.drafter.parameters(), strict=True):
        assert rel(got, want) < 1e-9


def test_part_rows_are_whole_and_never_empty() -> None:
    assert part_rows(5, 2) == [slice(0, 2), slice(2, 5)]
    assert part_rows(4, 4) == [slice(i, i + 1) for i in range(4)]
    assert part_rows(3, 8) == [slice(0, 1), slice(1, 2), slice(2, 3)]  # a smaller last batch
    assert part_rows(7, 1) == [slice(0, 7)]


def test_more_parts_than_sequences_is_refused_by_name() -> None:
    with pytest.raises(TrainConfigError, match="data.micro_batches") as caught:
        config(micro_batches=6)
    assert "raise data.batch_size" in str(caught.value)
    with pytest.raises(TrainConfigError, match="data.micro_batches"):
        config(micro_batches=0)
