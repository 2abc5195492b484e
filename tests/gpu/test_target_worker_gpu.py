"""The target's training forward compiled on CUDA (`run.compile_target`, on by default there):
the same features and final hidden states as the eager forward within bf16 rounding, at every
length bucket and batch size a run meets, and no new compile for shapes already seen."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _ids(rows: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 8192, (rows, width), generator=g)


def test_compiled_target_forward_matches_eager_and_settles(tmp_path) -> None:
    from torch._dynamo.utils import counters

    from bench.eval_target import target_config
    from trainer.data.dataset import Batch
    from trainer.model.target import load_target
    from trainer.run.target_worker import TargetWorker

    torch._dynamo.reset()
    counters.clear()
    device = torch.device("cuda")
    target = load_target(target_config(768, 8, 8192, pad_token_id=0), device=device, seed=0)
    eager, compiled = TargetWorker(target), TargetWorker(target, compiled=True)

    def batch(rows: int, width: int, seed: int) -> Batch:
        anchors = torch.zeros(rows, 2, dtype=torch.long)
        return Batch(
            input_ids=_ids(rows, width, seed),
            lengths=torch.full((rows,), width),
            anchors=anchors,
            valid=anchors > 0,
            labels=torch.zeros(rows, 2, 8, dtype=torch.long),
        )

    shapes = [(128, 256), (128, 128), (96, 256), (128, 384)]
    for seed, (rows, width) in enumerate(shapes):
        b = batch(rows, width, seed)
        want, got = eager.produce(b), compiled.produce(b)
        for name in ("hidden", "last_hidden"):
            w, g = getattr(want, name).float(), getattr(got, name).float()
            assert g.dtype == w.dtype and g.shape == w.shape, name
            assert float((g - w).norm() / w.norm()) < 3e-2, name
    graphs = counters["stats"]["unique_graphs"]
    for seed, (rows, width) in enumerate(shapes * 2, start=10):
        compiled.produce(batch(rows, width, seed))
    assert counters["stats"]["unique_graphs"] == graphs, "a seen shape compiled again"
    torch.cuda.synchronize()
