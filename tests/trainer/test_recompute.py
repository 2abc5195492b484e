"""`run.recompute_layers`: each drafter layer keeps only its inputs in the training forward and
runs again in the backward. Against the same drafter keeping its activations, in float64 on a
real (tiny) target: the same step (loss terms, gradients, weights after), eager and compiled;
and what the forward keeps for the backward shrinks to what lies outside the layers."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.float64_steps import features, rel
from trainer.model.target import Target, load_target
from trainer.run.pipeline import DrafterWorker
from trainer.run.target_worker import Features
from trainer.settings.config import DemoConfig, TrainConfigError
from trainer.settings.loading import config_from_dict
from trainer.setup.demo import ensure_demo_assets

DEMO = DemoConfig(enabled=True, num_samples=4, num_layers=4, prompt_len=6, gen_len=10)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Target:
    target_dir, _ = ensure_demo_assets(tmp_path_factory.mktemp("assets"), DEMO)
    return load_target(target_dir, num_layers=2)


def config(recompute: bool, micro_batches: int = 1, layers: int = 3):
    return config_from_dict(
        {
            "model": {"target": "t", "num_layers": layers, "block_size": 4, "sliding_window": 8,
                      "sliding_layers": [1]},
            "data": {"path": "d", "batch_size": 3, "micro_batches": micro_batches},
            "loss": {"kl_weight": 0.3, "cap_weight": 0.2},
            "run": {"device": "cpu", "recompute_layers": recompute},
        }
    )  # fmt: skip


def float64_worker(
    target: Target, recompute: bool, micro_batches: int = 1, layers: int = 3
) -> DrafterWorker:
    torch.manual_seed(0)
    cfg = config(recompute, micro_batches, layers)
    w = DrafterWorker.for_target(target, cfg, torch.device("cpu"))
    w.drafter.double()
    w.embed_weight, w.lm_head_weight = w.embed_weight.double(), w.lm_head_weight.double()
    return w


def step_grads(worker: DrafterWorker, f: Features, step: int) -> list[torch.Tensor]:
    """One training step; the gradients it applied (read before the optimizer clears them)."""
    seen: list[list[torch.Tensor]] = []
    original = worker.optimizer.step

    def recording_step(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append([p.grad.clone() for p in worker.drafter.parameters()])
        return original(*args, **kwargs)

    worker.optimizer.step = recording_step  # type: ignore[method-assign]
    try:
        result = worker.train_step(f, step)
    finally:
        worker.optimizer.step = original  # type: ignore[method-assign]
    worker.last_result = result  # type: ignore[attr-defined]
    return seen[0]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_recomputed_layers_train_the_same_steps(target, compiled) -> None:
    kept, again = float64_worker(target, False), float64_worker(target, True)
    assert not any(layer.recompute for layer in kept.drafter.drafter_layers())
    assert all(layer.recompute for layer in again.drafter.drafter_layers())
    assert "layers recomputed in the backward" in again.drafter.describe()
    if compiled:
        torch._dynamo.reset()
        for w in (kept, again):
            w.drafter.compile_layers(backend="aot_eager")
    for step in range(2):  # the second step starts from the weights the first one left
        f = features(target, seed=step)
        want, got = step_grads(kept, f, step), step_grads(again, f, step)
        for name in ("loss", "ce", "kl", "cap", "grad_norm"):
            assert getattr(again.last_result, name) == pytest.approx(
                getattr(kept.last_result, name), rel=1e-10
            ), name
        for g, w in zip(got, want, strict=True):
            assert rel(g, w) < 1e-10
    for g, w in zip(again.drafter.parameters(), kept.drafter.parameters(), strict=True):
        assert rel(g, w) < 1e-10
    if compiled:
        torch._dynamo.reset()


def test_recomputed_layers_in_parts_train_the_whole_batch_step(target) -> None:
    """With `data.micro_batches` too: each part recomputes its own layers."""
    whole, parts = float64_worker(target, False), float64_worker(target, True, micro_batches=3)
    f = features(target, seed=3)
    want, got = step_grads(whole, f, 0), step_grads(parts, f, 0)
    assert parts.last_result.loss == pytest.approx(whole.last_result.loss, rel=1e-10)
    for g, w in zip(got, want, strict=True):
        assert rel(g, w) < 1e-9


def saved_bytes(worker: DrafterWorker, f: Features) -> int:
    """What the drafter's training forward keeps for its backward (bytes of saved tensors,
    each storage once), the loss left out."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = worker.drafter(f.hidden, f.input_ids, f.anchors, f.valid, worker.embed_weight)
    out.sum().backward()
    return sum(storages.values())


def test_recomputed_layers_keep_only_what_lies_outside_them(target) -> None:
    """The layers' own activations (norms, q/k/v, attention, the MLP's products) are not kept:
    a layer more adds its input, one (Bsz, N·B, H) tensor, where keeping them adds many."""
    f = features(target, seed=0)
    kept = {n: saved_bytes(float64_worker(target, False, layers=n), f) for n in (2, 3)}
    again = {n: saved_bytes(float64_worker(target, True, layers=n), f) for n in (2, 3)}
    hidden = float64_worker(target, True).drafter.shape.hidden_size
    one_input = f.anchors.numel() * 4 * hidden * 8  # (Bsz, N·B, H) in float64
    assert again[3] - again[2] == one_input, (again, kept)
    assert kept[3] - kept[2] > 10 * one_input, (again, kept)
    assert again[3] < kept[3] / 4, (again, kept)


def test_recompute_layers_is_a_bool() -> None:
    with pytest.raises(TrainConfigError, match="run.recompute_layers"):
        config("yes")  # type: ignore[arg-type]
