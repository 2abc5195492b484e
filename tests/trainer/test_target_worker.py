"""`TargetWorker`: the target's training forward, eager or through `torch.compile`
(`run.compile_target`). The compiled forward must give the eager one's features and final
hidden states at every batch shape a run meets (new lengths and batch sizes recompile), and
leave the target itself eager for the probe's decoding."""

from __future__ import annotations

import pytest
import torch

from trainer.data.dataset import Batch
from trainer.model.target import Target, load_target
from trainer.run.target_worker import TargetWorker
from trainer.settings.config import DemoConfig
from trainer.setup.demo import ensure_demo_assets

DEMO = DemoConfig(enabled=True, num_samples=4, num_layers=4, prompt_len=6, gen_len=10)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Target:
    target_dir, _ = ensure_demo_assets(tmp_path_factory.mktemp("assets"), DEMO)
    return load_target(target_dir, num_layers=2)


def batch(rows: int, width: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    anchors = torch.zeros(rows, 2, dtype=torch.long)
    return Batch(
        input_ids=torch.randint(1, 200, (rows, width), generator=g),
        lengths=torch.full((rows,), width),
        anchors=anchors,
        valid=anchors > 0,
        labels=torch.zeros(rows, 2, 4, dtype=torch.long),
    )


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_compiled_forward_gives_the_eager_features_at_every_shape(target: Target) -> None:
    torch._dynamo.reset()
    eager = TargetWorker(target)
    compiled = TargetWorker(target, compiled=True, backend="aot_eager")
    for seed, (rows, width) in enumerate([(3, 16), (3, 24), (5, 32), (2, 16), (5, 40)]):
        b = batch(rows, width, seed)
        want, got = eager.produce(b), compiled.produce(b)
        assert (
            got.hidden.shape
            == want.hidden.shape
            == (rows, width, len(target.layers) * target.hidden_size)
        )
        assert rel(got.hidden, want.hidden) < 1e-5
        assert rel(got.last_hidden, want.last_hidden) < 1e-5
        assert not got.hidden.requires_grad
    assert (eager.compiled, compiled.compiled) == (False, True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # static, then dynamic


def test_the_target_itself_stays_eager(target: Target) -> None:
    torch._dynamo.reset()
    TargetWorker(target, compiled=True, backend="aot_eager").produce(batch(2, 16, 0))
    counters = torch._dynamo.utils.counters
    frames = counters["stats"]["unique_graphs"]
    target(torch.randint(1, 200, (2, 9)))  # what the τ probe calls
    assert counters["stats"]["unique_graphs"] == frames


def test_a_forward_that_does_not_compile_names_the_switch(target: Target) -> None:
    """A compiler failure (here a backend that raises, as inductor does on a model it cannot
    lower) is a typed error that names `run.compile_target`, not a dynamo traceback."""
    from trainer.base.errors import TargetCompileFailed

    def failing_backend(graph: torch.fx.GraphModule, inputs: list) -> None:
        raise RuntimeError("cannot lower this op")

    torch._dynamo.reset()
    worker = TargetWorker(target, compiled=True, backend=failing_backend)
    with pytest.raises(TargetCompileFailed, match="did not compile") as err:
        worker.produce(batch(2, 16, 0))
    assert "run.compile_target = false" in str(err.value)
    assert err.value.exit_code == 2
