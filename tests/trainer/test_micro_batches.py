"""`data.micro_batches`: a batch trained in parts of whole sequences, gradients accumulated, one
optimizer step. Against the same step over the whole batch at once (the reference), in float64
on a real (tiny) target: the same loss terms, slot accuracy, gradient norm and gradients."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.float64_steps import features, rel, same_result
from trainer.loss.micro_batches import part_rows
from trainer.model.target import Target, load_target
from trainer.run.pipeline import DrafterWorker
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
