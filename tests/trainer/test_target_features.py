"""The target's features: the selected layers' outputs, kept by hooks on those layers, equal
`transformers`' own `hidden_states[i + 1]` (dense and hybrid targets, several layer choices,
padded rows), and the other layers' outputs are freed as the forward goes: while the last
decoder layer runs, only the selected layers' outputs and the one flowing are alive, where
`output_hidden_states=True` holds every layer's."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.trainer.hybrid_target import hybrid_model
from trainer.model.target import Target, load_target
from trainer.settings.config import DemoConfig
from trainer.setup.demo import ensure_demo_assets

DEMO = DemoConfig(enabled=True, num_samples=4, num_layers=6, prompt_len=6, gen_len=10)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory):
    target_dir, _ = ensure_demo_assets(tmp_path_factory.mktemp("assets"), DEMO)
    return target_dir


def reference(target: Target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`transformers`' own hidden states, picked and concatenated as the features are."""
    base = getattr(target.model, target.model.base_model_prefix)
    with torch.no_grad():
        out = base(input_ids=ids, output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    return torch.cat([hs[i + 1] for i in target.layers], dim=-1), out.last_hidden_state


@pytest.mark.parametrize("layers", [[0], [1, 3], [0, 2, 4], [4, 1]])
def test_dense_features_equal_the_hidden_states(dense_dir, layers: list[int]) -> None:
    target = load_target(dense_dir, layers=layers)
    g = torch.Generator().manual_seed(len(layers))
    for rows, width in ((1, 5), (3, 17), (2, 40)):
        ids = torch.randint(1, 200, (rows, width), generator=g)
        out = target(ids)
        features, last = reference(target, ids)
        assert out.features.shape == (rows, width, len(layers) * target.hidden_size)
        assert torch.equal(out.features, features) and torch.equal(out.last_hidden, last)
    assert target._kept == {}  # nothing of a forward is held after it


def test_hybrid_features_equal_the_hidden_states() -> None:
    target = Target(hybrid_model(), [0, 1, 2])
    ids = torch.randint(1, 300, (2, 23), generator=torch.Generator().manual_seed(0))
    out = target(ids)
    features, last = reference(target, ids)
    assert torch.equal(out.features, features) and torch.equal(out.last_hidden, last)


def alive_while_the_last_layer_runs(target: Target, call) -> int:  # type: ignore[no-untyped-def]
    """Tensors of the hidden states' shape alive when the last decoder layer starts."""
    base = getattr(target.model, target.model.base_model_prefix)
    ids = torch.randint(1, 200, (2, 31), generator=torch.Generator().manual_seed(1))
    shape = (2, 31, target.hidden_size)
    seen: list[int] = []

    def count(module, args) -> None:  # type: ignore[no-untyped-def]
        gc.collect()
        seen.append(
            sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.shape == shape)
        )

    handle = base.layers[-1].register_forward_pre_hook(count)
    try:
        with torch.no_grad():
            call(ids)
    finally:
        handle.remove()
    return seen[0]


def test_only_the_selected_layers_outputs_stay_alive(dense_dir) -> None:
    target = load_target(dense_dir, layers=[1, 3])
    base = getattr(target.model, target.model.base_model_prefix)
    ours = alive_while_the_last_layer_runs(target, target)
    everything = alive_while_the_last_layer_runs(
        target, lambda ids: base(input_ids=ids, output_hidden_states=True, use_cache=False)
    )
    layers = len(base.layers)
    assert everything >= layers  # the embedding output and every layer's output so far
    assert ours <= 2 + 2  # layers 1 and 3, the hidden state flowing in, and one spare
    assert ours < everything


@pytest.mark.slow
def test_the_memory_benchmark_runs_both_modes(tmp_path) -> None:
    """`bench/target_features_memory.py` at a tiny shape: both modes run, their features agree."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "target_features_memory.py"
    tiny = ["--layers", "3", "--hidden", "64", "--intermediate", "64", "--heads", "4",
            "--kv-heads", "2", "--tokens", "64", "--features", "2"]  # fmt: skip
    run = subprocess.run(
        [sys.executable, str(script), *tiny, "--out", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["features_equal"] and [r["mode"] for r in record["rows"]] == [
        "hooks",
        "hidden_states",
    ]
    assert record["arithmetic_saved_gib"] == 2 * 64 * 64 * 4 / 2**30
