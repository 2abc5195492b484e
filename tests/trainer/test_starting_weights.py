"""`model.init_layers`: a drafter whose layers start from the target's. Each drafter layer holds
the named target layer's weights and the final norm the target's; what reads the target's
features keeps its random start; wrong indices and lengths are refused by name; and the key does
not tie a checkpoint (a resumed run may change it)."""

from __future__ import annotations

import pytest
import torch

from trainer.data.dataset import Batch
from trainer.model.target import Target, load_target
from trainer.run.pipeline import DrafterWorker
from trainer.run.target_worker import TargetWorker
from trainer.settings.config import DemoConfig, TrainConfigError
from trainer.settings.loading import config_from_dict
from trainer.setup.demo import ensure_demo_assets

DEMO = DemoConfig(enabled=True, num_samples=4, num_layers=4, prompt_len=6, gen_len=10)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Target:
    target_dir, _ = ensure_demo_assets(tmp_path_factory.mktemp("assets"), DEMO)
    return load_target(target_dir, num_layers=2)


def config(**model: object):
    raw = {"model": {"target": "t", "num_layers": 2, "block_size": 4, **model}}
    return config_from_dict({**raw, "data": {"path": "d"}, "run": {"device": "cpu"}})


def worker(target: Target, **model: object) -> DrafterWorker:
    torch.manual_seed(0)
    return DrafterWorker.for_target(target, config(**model), torch.device("cpu"))


def test_drafter_layers_start_as_the_named_target_layers(target) -> None:
    started = worker(target, init_layers=[3, 0]).drafter
    base = target.model.model
    for i, j in enumerate([3, 0]):
        want = base.layers[j].state_dict()
        got = started.layers[i].state_dict()
        assert set(got) == set(want)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), (i, name)
    assert torch.equal(started.norm.weight, base.norm.weight)
    # the projection of the target's features is the drafter's own: the same random start
    plain = worker(target).drafter
    assert torch.equal(started.fc.weight, plain.fc.weight)
    assert torch.equal(started.hidden_norm.weight, plain.hidden_norm.weight)
    assert not torch.equal(started.layers[0].mlp.up_proj.weight, plain.layers[0].mlp.up_proj.weight)


def test_started_drafter_trains(target) -> None:
    """A step runs and changes the copied weights, not the target's (no shared storage)."""
    w = worker(target, init_layers=[1, 2])
    before = target.model.model.layers[1].mlp.up_proj.weight.clone()
    anchors = torch.tensor([[6, 12], [8, 20]])
    batch = Batch(
        input_ids=torch.randint(0, 200, (2, 32)),
        lengths=torch.tensor([32, 32]),
        anchors=anchors,
        valid=torch.ones_like(anchors, dtype=torch.bool),
        labels=torch.randint(0, 200, (2, 2, 4)),
    )
    result = w.train_step(TargetWorker(target).produce(batch), 0)
    assert result.loss > 0
    assert torch.equal(target.model.model.layers[1].mlp.up_proj.weight, before)
    assert not torch.equal(w.drafter.layers[0].mlp.up_proj.weight, before)


def test_bad_starting_layers_are_refused_by_name(target) -> None:
    with pytest.raises(TrainConfigError, match=r"model.init_layers.*one target layer index"):
        config(init_layers=[0])
    with pytest.raises(TrainConfigError, match=r"model.init_layers.*one target layer index"):
        config(init_layers=[0, -1])
    with pytest.raises(TrainConfigError, match=r"model.init_layers: \[9\] outside 0…3"):
        worker(target, init_layers=[0, 9])


def test_a_checkpoint_is_not_tied_to_the_starting_layers() -> None:
    assert config().model_data_hash() == config(init_layers=[1, 0]).model_data_hash()
    assert "model.init_layers" not in config(init_layers=[1, 0]).model_data_settings()


def test_an_unfitting_target_layer_is_named(target) -> None:
    drafter = worker(target).drafter
    weights = target.starting_weights([0, 1])
    weights["layers.0.mlp.up_proj.weight"] = weights["layers.0.mlp.up_proj.weight"][:, :-1]
    del weights["layers.1.input_layernorm.weight"]
    with pytest.raises(TrainConfigError, match="missing.*layers.1.input_layernorm.weight") as err:
        drafter.start_from(weights)
    assert "layers.0.mlp.up_proj.weight" in str(err.value)


def test_a_wider_mlp_cannot_start_from_the_target_layers(target) -> None:
    with pytest.raises(TrainConfigError, match="model.intermediate_size other than the target"):
        worker(target, init_layers=[0, 1], intermediate_size=2 * target.config.intermediate_size)


def test_other_key_value_heads_cannot_start_from_the_target_layers(target) -> None:
    kv = 2 * target.config.num_key_value_heads
    with pytest.raises(TrainConfigError, match="model.num_kv_heads other than the target"):
        worker(target, init_layers=[0, 1], num_kv_heads=kv)


def test_other_query_heads_cannot_start_from_the_target_layers(target) -> None:
    heads = 2 * target.config.num_attention_heads
    with pytest.raises(TrainConfigError, match=r"\(a model.num_heads other than the target"):
        worker(target, init_layers=[0, 1], num_heads=heads)


def test_another_head_size_is_named_alone(target) -> None:
    head_dim = 2 * target.config.head_dim
    with pytest.raises(TrainConfigError, match=r"\(a model.head_dim other than the target"):
        worker(target, init_layers=[0, 1], head_dim=head_dim)
