"""How far a τ measured on a few prompts could move on other prompts like them.

τ pools tokens over verify passes: τ = Σ tokens / Σ passes over the prompts, a prompt's tokens
being its accepted drafts plus one bonus token per pass. Prompts differ far more than the passes
of one prompt, so the bootstrap resamples prompts with replacement and recomputes τ. Two
drafters decoded on the same prompts are compared paired: each resample takes the same prompts
for both, which cancels how hard each prompt is, so a difference far smaller than either
drafter's own interval can still be told apart.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# one prompt: (tokens = accepted drafts + one bonus per pass, verify passes)
PromptCounts = tuple[int, int]


def prompt_counts(accepted: Sequence[Sequence[int]]) -> list[PromptCounts]:
    """Each prompt's (tokens, passes) from its accepted drafts per verify pass."""
    return [(sum(a) + len(a), len(a)) for a in accepted]


def _resampled_taus(
    counts: Sequence[Sequence[PromptCounts]], resamples: int, seed: int
) -> list[torch.Tensor]:
    """τ of every set of prompts in `counts` on the same `resamples` draws of prompt indices."""
    n = len(counts[0])
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randint(n, (resamples, n), generator=gen)
    taus = []
    for one in counts:
        tokens, passes = torch.tensor(one, dtype=torch.float64)[pick].sum(1).unbind(-1)
        taus.append(tokens / passes)  # nan where a draw holds no verify pass
    return taus


def _quantiles(values: torch.Tensor, level: float) -> tuple[float, float]:
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    lo, hi = torch.nanquantile(values, q).tolist()
    return (lo, hi)


def tau_interval(
    counts: Sequence[PromptCounts], *, level: float = 0.95, resamples: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """The `level` bootstrap interval of τ over the prompts (seeded: the same counts give the
    same interval); nan without a verify pass."""
    if not sum(p for _, p in counts):
        return (float("nan"), float("nan"))
    (taus,) = _resampled_taus([counts], resamples, seed)
    return _quantiles(taus, level)


def tau_difference(
    a: Sequence[PromptCounts],
    b: Sequence[PromptCounts],
    *,
    level: float = 0.95,
    resamples: int = 4000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(τ_a − τ_b, and its `level` paired bootstrap interval) for two drafters decoded on the
    same prompts, in the same order."""
    if len(a) != len(b):
        raise ValueError(f"paired counts need the same prompts: {len(a)} against {len(b)}")
    if not sum(p for _, p in a) or not sum(p for _, p in b):
        nan = float("nan")
        return (nan, nan, nan)
    ta, tb = _resampled_taus([a, b], resamples, seed)
    diff = sum(t for t, _ in a) / sum(p for _, p in a) - sum(t for t, _ in b) / sum(p for _, p in b)
    return (diff, *_quantiles(ta - tb, level))
