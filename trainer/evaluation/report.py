"""τ over a prompt set: `evaluate` decodes the prompts in batches with a `BlockDrafter` against
the target (`trainer.evaluation.speculative`), checks the output is the target's own (lossless),
and reports τ with its 95 % interval, per-slot acceptance and the draft's cost (`EvalReport`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from trainer.evaluation.draft_cost import draft_cost, net_speedup
from trainer.evaluation.drafters import BlockDrafter, DFlashDrafter
from trainer.evaluation.lossless import check_output
from trainer.evaluation.slot_accuracy import SlotAccuracy
from trainer.evaluation.speculative import (
    BATCH_TOKENS,
    PromptResult,
    eos_ids,
    greedy_decode_many,
    prompt_batches,
    speculative_decode_many,
)
from trainer.evaluation.tau_bootstrap import prompt_counts, tau_interval
from trainer.model.target import Target


@dataclass(frozen=True)
class EvalReport:
    tau: float  # mean acceptance length: tokens per verify forward, bonus included
    slot_acceptance: list[float]  # slots 1 … B−1: fraction of verify passes accepting slot k
    block_size: int
    prompts: int
    new_tokens: int
    verify_forwards: int
    target_forwards: int  # speculative: prefill + verify passes
    plain_forwards: int  # plain greedy decoding: one per new token
    speedup: float  # plain_forwards / target_forwards
    lossless_checked: bool
    # where plain and speculative decoding picked different tokens whose logits were tied within
    # the target's rounding (`trainer.evaluation.lossless`); lossless all the same
    lossless_ties: int = 0
    # slots 1 … B−1: right proposals of a block drafted at every output position, as in training
    # (`trainer.evaluation.slot_accuracy`); None for a drafter that is not a trained one
    slot_accuracy: list[float] | None = None
    # 95 % bootstrap interval of τ over the prompts (`tau_interval`): what other prompts like
    # these could give; two drafters whose intervals overlap much are not told apart
    tau_interval: tuple[float, float] | None = None
    # each prompt's (tokens, verify passes): what the interval and paired comparisons of two
    # drafters on the same prompts are computed from (`trainer.evaluation.tau_bootstrap`)
    prompt_counts: list[tuple[int, int]] | None = None
    # weights one draft reads ÷ those of a target forward, and `speedup` with every draft
    # counted at that (`trainer.evaluation.draft_cost`: a small-batch estimate); None: not known
    draft_cost: float | None = None
    net_speedup: float | None = None

    @classmethod
    def from_dict(cls, d: dict) -> EvalReport:
        """The report back from its JSON (`asdict`), the tuples JSON turned into lists made
        tuples again."""
        interval, counts = d.get("tau_interval"), d.get("prompt_counts")
        return cls(
            **{
                **d,
                "tau_interval": None if interval is None else tuple(interval),
                "prompt_counts": None if counts is None else [tuple(c) for c in counts],
            }
        )

    def summary(self) -> str:
        slots = _percents(self.slot_acceptance)
        check = "lossless" if self.lossless_checked else "lossless not checked"
        if self.lossless_ties:
            check += f" ({self.lossless_ties} near-tie{'s' if self.lossless_ties > 1 else ''})"
        every = ""
        if self.slot_accuracy is not None:
            every = f" | acc% at every position {_percents(self.slot_accuracy)}"
        spread = ""
        if self.tau_interval is not None:
            lo, hi = self.tau_interval
            spread = f" (95% {lo:.2f}–{hi:.2f})"
        net = ""
        if self.draft_cost and self.net_speedup is not None:
            net = f"; x{self.net_speedup:.2f} with drafts at {self.draft_cost:.2f} of a forward"
        return (
            f"tau {self.tau:.3f}{spread} | accept% by slot {slots}{every} | "
            f"{self.new_tokens} tokens, "
            f"{self.target_forwards} target forwards vs {self.plain_forwards} plain "
            f"(x{self.speedup:.2f}{net}) | {self.prompts} prompts, B={self.block_size} | {check}"
        )


def _percents(rates: Sequence[float]) -> str:
    return " ".join(f"{100 * r:.0f}" for r in rates)


def evaluate(
    target: Target,
    drafter: BlockDrafter,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    check_lossless: bool = True,
    eos: Sequence[int] | None = None,
    expected: Sequence[list[int]] | None = None,
    progress: Callable[[int, int, float], None] | None = None,
    batch_tokens: int = BATCH_TOKENS,
) -> EvalReport:
    """Speculative decoding over `prompts`; with `check_lossless`, also plain greedy decoding
    of each prompt (or its output given in `expected`, to decode it once for several drafters),
    and `LosslessViolation` on the first differing token that is no near-tie (those are
    counted: `trainer.evaluation.lossless`). Prompts go in batches of about
    `batch_tokens` tokens at their longest (`prompt_batches`); `progress(done, total, τ so
    far)` after each batch (a long evaluation is not silent until its end)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be ≥ 1")
    if not prompts:
        raise ValueError("no prompts")
    if expected is not None and len(expected) != len(prompts):
        raise ValueError(f"{len(expected)} expected outputs for {len(prompts)} prompts")
    b = drafter.block_size
    results: list[PromptResult] = []
    every = SlotAccuracy(target, drafter) if isinstance(drafter, DFlashDrafter) else None
    stop, ties = eos_ids(target, eos), 0
    for batch in prompt_batches(prompts, max_new_tokens + b, batch_tokens):
        chunk = [prompts[i] for i in batch]
        decoded = speculative_decode_many(target, drafter, chunk, max_new_tokens, eos=eos)
        if check_lossless:
            want = (
                greedy_decode_many(target, chunk, max_new_tokens, eos=eos)
                if expected is None
                else [expected[i] for i in batch]
            )
            for i, res, w in zip(batch, decoded, want, strict=True):
                ties += check_output(
                    target, i, prompts[i], res.tokens, w, max_new_tokens=max_new_tokens, eos=stop
                )
        for prompt, res in zip(chunk, decoded, strict=True):
            if every is not None:  # the output is the target's greedy one (checked or not)
                every.add(prompt, res.tokens)
        results.extend(decoded)
        if progress is not None:
            so_far = [a for r in results for a in r.accepted]
            tau = (sum(so_far) + len(so_far)) / len(so_far) if so_far else float("nan")
            progress(len(results), len(prompts), tau)
    accepted = [a for r in results for a in r.accepted]
    verifies = len(accepted)
    counts = prompt_counts([r.accepted for r in results])
    new_tokens = sum(len(r.tokens) for r in results)
    forwards = sum(r.target_forwards for r in results)
    slots = [sum(a >= k for a in accepted) / max(verifies, 1) for k in range(1, b)]
    cost = draft_cost(target, drafter)
    return EvalReport(
        tau=(sum(accepted) + verifies) / verifies if verifies else float("nan"),
        slot_acceptance=slots,
        block_size=b,
        prompts=len(prompts),
        new_tokens=new_tokens,
        verify_forwards=verifies,
        target_forwards=forwards,
        plain_forwards=new_tokens,
        speedup=new_tokens / forwards,
        lossless_checked=check_lossless,
        lossless_ties=ties,
        slot_accuracy=None if every is None else every.rates(),
        tau_interval=tau_interval(counts) if verifies else None,
        prompt_counts=counts,
        draft_cost=cost,
        net_speedup=None if cost is None else net_speedup(new_tokens, forwards, verifies, cost),
    )
