"""Gradient accumulation: one optimizer step over a batch trained in parts (`data.micro_batches`).

A part is a run of whole sequences of the batch (its rows), so no part needs another's context
and nothing is computed twice. Each part's loss divides by the whole batch's normalisers
(`trainer.loss.dflash_loss.loss_norms`), so the parts' losses, loss terms and gradients add up to the
whole batch's; only the activations of one part are alive at a time. What it buys: a batch
larger than the drafter's memory allows, and the optimizer step (a fixed cost per step)
spread over more tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.loss.dflash_loss import IGNORE_INDEX, LossOutput


def part_rows(rows: int, parts: int) -> list[slice]:
    """`rows` split into at most `parts` runs as equal as can be (never an empty one)."""
    parts = max(1, min(parts, rows))
    bounds = [rows * i // parts for i in range(parts + 1)]
    return [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]


def slot_counts(labels: Tensor) -> Tensor:
    """(B,) supervised labels per slot of `labels` (…, B); slot 0 never is."""
    counts = (labels != IGNORE_INDEX).reshape(-1, labels.shape[-1]).sum(0)
    counts[0] = 0
    return counts


def combine(outputs: list[LossOutput], labels: list[Tensor]) -> LossOutput:
    """The whole batch's detached loss output from its parts' (each computed with the batch's
    normalisers, so the terms add); slot accuracy weighted by each part's supervised labels per
    slot (NaN where no part has one, as for one batch)."""
    if len(outputs) == 1:
        return outputs[0]

    def total(name: str) -> Tensor:
        return torch.stack([getattr(o, name).detach() for o in outputs]).sum(0)

    counts = torch.stack([slot_counts(lab).to(outputs[0].slot_accuracy.dtype) for lab in labels])
    accuracy = torch.stack([o.slot_accuracy for o in outputs]).nan_to_num(0.0)
    correct = (accuracy * counts).sum(0)
    return LossOutput(
        loss=total("loss"),
        ce=total("ce"),
        kl=total("kl"),
        cap=total("cap"),
        slot_accuracy=correct / counts.sum(0),  # 0/0: NaN, as for one batch
    )
