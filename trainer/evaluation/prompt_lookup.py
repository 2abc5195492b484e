"""Prompt lookup (n-gram) drafting: the free baseline a trained drafter must clear.

It proposes the tokens that followed the last earlier occurrence of the newest n tokens, trying
n from `max_n` down to `min_n` (the longest suffix that occurred before wins). It needs neither
weights nor the target's features, and it is strong exactly where text repeats itself (code,
quoting, lists), so a drafter whose held-out τ is not clearly above it has learned nothing that
carries over.

When the continuation reaches the newest token (a pattern that repeats with period d), the copy
keeps going through the tokens it has just proposed: `a b a b a` proposes `b a b …`. With no
earlier occurrence of even the newest token, nothing is proposed and the verify pass decodes one
token, as an engine does.
"""

from __future__ import annotations

import torch
from torch import Tensor


def lookup(sequence: Tensor, *, num_tokens: int, max_n: int = 4, min_n: int = 1) -> Tensor:
    """sequence (L,) long → (k,) long with k = `num_tokens`, or k = 0 when no n-gram matches."""
    length = sequence.shape[0]
    empty = sequence.new_empty(0)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix_at = length - n  # where the newest n tokens start
        windows = sequence.unfold(0, n, 1)[:suffix_at]  # (suffix_at, n): earlier n-grams
        found = (windows == sequence[suffix_at:]).all(dim=1).nonzero()
        if found.numel() == 0:
            continue
        start = int(found[-1, 0])  # the last earlier occurrence
        period = suffix_at - start
        follow = torch.arange(num_tokens, device=sequence.device) + start + n  # (k,)
        # past the newest token the pattern repeats: position j copies j − period
        follow = torch.where(follow < length, follow, length - period + (follow - length) % period)
        return sequence[follow]
    return empty


class PromptLookupDrafter:
    """Prompt lookup behind the evaluator's `BlockDrafter` interface (features are ignored)."""

    def __init__(self, block_size: int, *, max_n: int = 4, min_n: int = 1) -> None:
        if block_size < 2:
            raise ValueError("block_size must be ≥ 2")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 ≤ min_n ≤ max_n, got min_n={min_n}, max_n={max_n}")
        self.block_size = block_size
        self.max_n = max_n
        self.min_n = min_n

    def weights_read(self) -> int:
        """Nothing: it proposes from the text itself (`trainer.evaluation.draft_cost`)."""
        return 0

    def draft(self, features: Tensor, input_ids: Tensor, anchor: int) -> Tensor:
        """input_ids (1, anchor + 1) → (B−1,) proposals, or (0,) when nothing matches."""
        return lookup(
            input_ids[0, : anchor + 1],
            num_tokens=self.block_size - 1,
            max_n=self.max_n,
            min_n=self.min_n,
        )

    def describe(self) -> str:
        return f"prompt lookup (n {self.max_n}…{self.min_n})"


BASELINES = ("prompt-lookup", "none")


def baseline_drafter(
    name: str, block_size: int, *, max_n: int = 4, min_n: int = 1
) -> PromptLookupDrafter | None:
    """The baseline `name` (one of `BASELINES`) at the drafter's block size; None for "none"."""
    if name == "none":
        return None
    if name == "prompt-lookup":
        return PromptLookupDrafter(block_size, max_n=max_n, min_n=min_n)
    raise ValueError(f"unknown baseline {name!r}: expected one of {', '.join(BASELINES)}")
