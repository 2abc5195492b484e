"""What every entry point shares before its own work starts: the device `run.device` names, the
demo assets `demo.enabled` asks for, and the frozen target as `[model]` describes it.

Training, evaluation, export, generation, planning and the smoke test import these from here,
so none of them imports another entry point (no import cycle) and the target is loaded the
same way everywhere.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.model.target import Target, load_target
from trainer.settings.config import TrainConfig
from trainer.settings.loading import with_overrides


def resolve_device(name: str) -> torch.device:
    """`run.device`: "auto" is the GPU when CUDA is available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_demo(config: TrainConfig, out_dir: Path) -> TrainConfig:
    """With `demo.enabled`, build (or reuse) the demo assets and point the run at them."""
    if not config.demo.enabled:
        return config
    from trainer.setup.demo import ensure_demo_assets  # transformers loads only for the demo

    folder = (
        Path(config.demo.folder) if config.demo.folder else out_dir.resolve().parent / "demo-assets"
    )
    target_dir, data_path = ensure_demo_assets(folder, config.demo)
    return with_overrides(config, model={"target": str(target_dir)}, data={"path": str(data_path)})


# The folder of a checkpoints folder that finished runs are moved into (by `dflash`'s fresh
# deploys): it holds runs only.
ARCHIVE = "archive"


def trained_in(run_dir: Path) -> Path:
    """The folder the run was trained in (its `--out`), so the demo assets are the ones the
    training built, beside it. An archived run (`<out>/archive/<UTC time>/`, where a fresh
    deploy moves the previous run) was trained in `<out>`: assets resolved from the run folder
    itself would land in `archive/`, where only runs belong."""
    if run_dir.parent.name == ARCHIVE:
        return run_dir.parent.parent
    return run_dir


def demo_of_checkpoint(config: TrainConfig, checkpoint: Path) -> TrainConfig:
    """`resolve_demo` for a tool reading `checkpoint` (a `step-…` folder or a run folder, live
    or archived): the demo assets its training used."""
    run_dir = checkpoint.parent if checkpoint.name.startswith("step-") else checkpoint
    return resolve_demo(config, trained_in(run_dir))


def load_configured_target(config: TrainConfig, device: torch.device | None = None) -> Target:
    """The frozen target of `[model]` (`target`, `target_layers`, `num_target_layers`) on
    `device` (default: `run.device`)."""
    m = config.model
    return load_target(
        m.target,
        device=device if device is not None else resolve_device(config.run.device),
        layers=m.target_layers,
        num_layers=m.num_target_layers,
    )
