"""What a drafter saves once its own drafts are paid for.

τ counts target forwards only, as if drafting were free. At the small batches where speculative
decoding pays off, a forward's time is mostly the reading of its weights, so a draft that reads
half the target's weights costs about half a target forward. `draft_cost` is that ratio and
`net_speedup` the speed-up over plain decoding with every draft counted at it: what tells a
deeper drafter's higher τ from its higher price. An estimate, not a serving measurement: it
leaves out the KV cache's reads and an engine's own overheads (launches, sampling); at large
batches compute, not weight reads, sets a forward's time; and it counts a dense target's weights
(a mixture-of-experts forward reads only the experts it routes to).
"""

from __future__ import annotations

from trainer.model.target import Target


def draft_cost(target: Target, drafter: object) -> float | None:
    """Weights one draft reads ÷ weights one target forward reads; None for a drafter that
    does not say (`weights_read`)."""
    read = getattr(drafter, "weights_read", None)
    return None if read is None else read() / target.weights_read()


def net_speedup(new_tokens: int, target_forwards: int, drafts: int, cost: float) -> float:
    """Plain decoding's forwards (one per token) ÷ speculative decoding's, each draft counted as
    `cost` of a target forward."""
    return new_tokens / (target_forwards + cost * drafts)
