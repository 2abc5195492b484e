"""The drafter's accuracy by slot at every position of the target's own output: the training
log's `acc%`, measured on the prompts an evaluation decodes.

Speculative decoding's acceptance by slot counts verify passes, and passes crowd where drafting
fails (a pass that accepts nothing advances one token, one that accepts seven advances eight), so
it weighs hard positions more than the training accuracy does, and the two cannot be compared.
Here the drafter drafts one block at every position p of the target's greedy output (the anchor
x_p, the target's features of the positions before p, exactly as in decoding) and slot k is right
when it proposes x_{p+k}: the training measure, on prompts the drafter may never have seen. Far
below the training accuracy, the drafter has not learnt what carries over (more data); about
equal, acceptance is low because the target is hard to follow where it matters (more capacity or
steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from trainer.model.target import Target

ANCHORS_PER_FORWARD = 32  # blocks drafted in one drafter forward (logits are N × (B−1) × V)


class BlocksDrafter(Protocol):
    block_size: int
    lm_head_weight: Tensor

    def blocks_hidden(self, features: Tensor, input_ids: Tensor, anchors: list[int]) -> Tensor:
        """The drafter's final hidden states of one block per anchor → (N, B, H)."""
        ...


class SlotAccuracy:
    """Counts right proposals by slot over the sequences added."""

    def __init__(self, target: Target, drafter: BlocksDrafter) -> None:
        self.target, self.drafter = target, drafter
        self.right = torch.zeros(drafter.block_size - 1, dtype=torch.long)
        self.blocks = 0

    @torch.no_grad()
    def add(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Draft a block at every position of `output` with a full block of output after it."""
        b = self.drafter.block_size
        ids = torch.tensor([[*prompt, *output]], device=self.target.device)  # (1, S)
        anchors = list(range(len(prompt), ids.shape[1] - b + 1))
        if not anchors:
            return
        features = self.target(ids).features  # (1, S, n·H)
        head = self.drafter.lm_head_weight.float().T  # (H, V): fp32, as `draft` proposes
        for start in range(0, len(anchors), ANCHORS_PER_FORWARD):
            chunk = anchors[start : start + ANCHORS_PER_FORWARD]
            hidden = self.drafter.blocks_hidden(features, ids, chunk)  # (N, B, H)
            logits = hidden[:, 1:].float() @ head
            labels = torch.stack([ids[0, a + 1 : a + b] for a in chunk])  # (N, B−1)
            self.right += (logits.argmax(-1) == labels).sum(0).cpu()
            self.blocks += len(chunk)

    def rates(self) -> list[float] | None:
        """Slots 1 … B−1: the share of blocks whose slot k was right (None: no block)."""
        if not self.blocks:
            return None
        return (self.right.double() / self.blocks).tolist()
