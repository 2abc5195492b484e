"""The tiny demo target the evaluation tests decode with (built once per test module)."""

from __future__ import annotations

import pytest
import torch

from trainer.model.target import Target, load_target
from trainer.settings.config import DemoConfig
from trainer.setup.demo import ensure_demo_assets

DEMO = DemoConfig(enabled=True, num_samples=8, num_layers=4, prompt_len=6, gen_len=10)


def demo_target(tmp_path_factory: pytest.TempPathFactory) -> Target:
    """The demo's 4-layer random target, reading 2 layers, one CPU thread."""
    torch.set_num_threads(1)
    target_dir, _ = ensure_demo_assets(tmp_path_factory.mktemp("assets"), DEMO)
    return load_target(target_dir, num_layers=2)
