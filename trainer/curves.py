"""Training curves in TensorBoard: the metrics rows, drawn.

`metrics.jsonl` stays the record (`dflash status` and scripts read it); this writes the same rows
as TensorBoard scalars into `<out>/tensorboard/` so that a user can watch them:

    tensorboard --logdir <out>/tensorboard

Written only when the `tensorboard` package is installed (`pip install 'dflash[tensorboard]'`)
and `run.tensorboard` is on; otherwise nothing happens and nothing is said. The writer opens at
the first row with `purge_step` = that row's step, so a resumed run replaces the points logged
after its checkpoint instead of drawing them twice; every row is flushed at once (rows come every
`run.log_every` steps, and a killed run keeps what it drew).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

FOLDER = "tensorboard"

# metrics row key → scalar tag
SCALARS = {
    "loss": "loss/total",
    "ce": "loss/ce",
    "kl": "loss/kl",
    "cap": "loss/cap",
    "lr": "optim/lr",
    "grad_norm": "optim/grad_norm",
    "tokens_per_s": "throughput/tokens_per_s",
}
PROBE = {
    "tau": "tau/held_out",
    "tau_train": "tau/train_prompts",
    "tau_prompt_lookup": "tau/prompt_lookup",
}


def available() -> bool:
    """Whether torch's TensorBoard writer can be imported (it needs the tensorboard package)."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return False
    return True


def scalars(row: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    """(tag, value) of every number in a metrics row worth a curve."""
    for key, tag in SCALARS.items():
        if _number(row.get(key)):
            yield tag, float(row[key])
    yield from _slots("accuracy", row.get("slot_accuracy"))
    probe = row.get("probe")
    if isinstance(probe, Mapping) and probe.get("step") == row.get("step"):
        for key, tag in PROBE.items():
            if _number(probe.get(key)):
                yield tag, float(probe[key])
        yield from _slots("acceptance", row.get("slot_acceptance"))
    roles = row.get("roles")
    if isinstance(roles, Mapping):
        for role, values in roles.items():
            if isinstance(values, Mapping) and _number(values.get("tokens_per_s")):
                yield f"throughput/{role}_tokens_per_s", float(values["tokens_per_s"])


def _slots(name: str, values: object) -> Iterator[tuple[str, float]]:
    """`name/slot_k` for slots k = 1 … B−1 (a slot without a value, e.g. no label, is skipped)."""
    for k, value in enumerate(values if isinstance(values, list) else [], start=1):
        if _number(value):
            yield f"{name}/slot_{k}", float(value)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


class TrainingCurves:
    """TensorBoard scalars of the metrics rows of one run folder."""

    def __init__(self, out_dir: str | Path, *, enabled: bool = True) -> None:
        self.folder = Path(out_dir) / FOLDER
        self.enabled = enabled and available()
        self._writer: Any = None

    def write(self, row: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        step = int(row["step"])
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.folder), purge_step=step)
        for tag, value in scalars(row):
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
