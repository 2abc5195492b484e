"""Greedy block speculative decoding with the frozen target: what a drafter is worth.

Training accuracy can be high while serving acceptance is near 1 (an off-by-one between mask,
positions and labels does exactly that), so the drafter is judged by decoding with it, the way
an inference engine does (each prompt on its own; a batch of prompts shares every forward, each
right-padded row computing what it would alone):

1. prefill: the target runs over the prompt (positions 0…P−1); its selected hidden states are the
   context features and its greedy prediction at P−1 is the first new token, at position p = P;
2. draft: the drafter fills the block `[x_p, MASK, …, MASK]` (positions p…p+B−1) in one forward of
   `Drafter.forward` with a single anchor p — the same mask as in training
   (`trainer.masks.dense_mask`: the block sees the features of positions < p, and itself); slot k
   proposes x_{p+k};
3. verify: the target runs over the sequence with the B−1 draft tokens appended (one forward) and
   predicts g_1…g_B for positions p+1…p+B; the longest prefix of drafts equal to the target's
   predictions is accepted (a tokens), plus the target's own g_{a+1} (the bonus token);
4. the bonus token becomes the next anchor and the features of the accepted positions the new
   context; repeat until `max_new_tokens` new tokens or EOS.

The target recomputes the whole prefix at each verify (no KV cache): simple and obviously
correct, and cheap at the sizes this runs on; prompts are decoded `batch_tokens` at a time (a
row leaves the batch when it is finished), so a verify or greedy step is one forward for many
prompts rather than one each. `evaluate` reports τ, the mean acceptance length
(tokens per verify forward, bonus included, as found by the verify pass even where the output is
then cut at the token budget or EOS); per-slot acceptance (the fraction of verify passes whose
draft at slot k was accepted, so τ = 1 + Σ_k rate_k); for a trained drafter, its accuracy by
slot at every output position (`trainer.slot_accuracy`, the training log's measure); the
speed-up in target forwards against plain greedy decoding (one forward per new token); and, when
asked, a lossless check against the target's own greedy output computed by plain decoding
(`trainer.lossless`: near-ties of the target's logits are counted, any other difference raises
`LosslessViolation`).
Any `BlockDrafter` can be judged: a trained drafter (`DFlashDrafter`) or a baseline such as
prompt lookup (`trainer.prompt_lookup`), which may propose fewer than B−1 tokens; the verify
pass then covers only what was proposed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.draft_cost import draft_cost, net_speedup
from trainer.drafters import BlockDrafter, DFlashDrafter, DraftRequest, draft_many
from trainer.lossless import check_output
from trainer.slot_accuracy import SlotAccuracy
from trainer.target import Target, TargetOutput
from trainer.tau_bootstrap import prompt_counts, tau_interval

# Tokens of one batched forward at its longest (rows × longest row): the verify pass of a batch
# of prompts keeps every selected layer's hidden states of all its positions.
BATCH_TOKENS = 8192


# ---- decoding --------------------------------------------------------------------------------


def _eos_ids(target: Target, eos: Sequence[int] | None) -> set[int]:
    if eos is not None:
        return set(eos)
    value = getattr(target.config, "eos_token_id", None)
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


def _cut(tokens: list[int], max_new: int, eos: set[int]) -> tuple[list[int], bool]:
    """Tokens up to the budget and the first EOS (kept); True when decoding is finished."""
    for i, tok in enumerate(tokens[:max_new]):
        if tok in eos:
            return tokens[: i + 1], True
    return tokens[:max_new], len(tokens) >= max_new


def _rows(rows: Sequence[Sequence[int]], device: torch.device) -> Tensor:
    """(n, longest) right-padded with token 0: causal attention keeps each row's own positions
    exactly as they would be alone."""
    width = max(len(r) for r in rows)
    return torch.tensor([[*r, *[0] * (width - len(r))] for r in rows], device=device)


def _forward_next(target: Target, seqs: Sequence[Sequence[int]]) -> tuple[TargetOutput, list[int]]:
    """The target over `seqs` (right-padded rows), and each row's greedy next token."""
    out = target(_rows(seqs, target.device))
    last = torch.tensor([len(q) - 1 for q in seqs], device=target.device)
    rows = torch.arange(len(seqs), device=target.device)
    return out, target.logits(out.last_hidden[rows, last]).argmax(-1).tolist()


def greedy_decode(
    target: Target, prompt: Sequence[int], max_new_tokens: int, *, eos: Sequence[int] | None = None
) -> list[int]:
    """The target's own greedy output for one prompt (`greedy_decode_many`)."""
    return greedy_decode_many(target, [prompt], max_new_tokens, eos=eos)[0]


@torch.no_grad()
def greedy_decode_many(
    target: Target,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos: Sequence[int] | None = None,
) -> list[list[int]]:
    """Each prompt's greedy output: one forward over the sequences still going per new token."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    stop = _eos_ids(target, eos)
    seqs = [list(p) for p in prompts]
    new: list[list[int]] = [[] for _ in prompts]
    going = list(range(len(prompts)))
    while going:
        _, tokens = _forward_next(target, [seqs[i] for i in going])
        still = []
        for i, tok in zip(going, tokens, strict=True):
            new[i], done = _cut([*new[i], tok], max_new_tokens, stop)
            seqs[i].append(tok)
            if not done:
                still.append(i)
        going = still
    return new


def greedy_outputs(
    target: Target,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos: Sequence[int] | None = None,
    batch_tokens: int = BATCH_TOKENS,
) -> list[list[int]]:
    """`greedy_decode_many` over any number of prompts, `batch_tokens` at a time: the outputs
    the lossless check compares with, decoded once for several drafters."""
    outputs: list[list[int]] = []
    for batch in prompt_batches(prompts, max_new_tokens, batch_tokens):
        outputs += greedy_decode_many(target, [prompts[i] for i in batch], max_new_tokens, eos=eos)
    return outputs


@dataclass(frozen=True)
class PromptResult:
    tokens: list[int]  # the new tokens
    accepted: list[int]  # per verify pass: draft tokens accepted (0 … B−1), bonus not counted
    target_forwards: int  # prefill + verify passes


def speculative_decode(
    target: Target,
    drafter: BlockDrafter,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    eos: Sequence[int] | None = None,
) -> PromptResult:
    """Greedy block speculative decoding of one prompt (`speculative_decode_many`)."""
    return speculative_decode_many(target, drafter, [prompt], max_new_tokens, eos=eos)[0]


@dataclass
class _Sequence:
    """One prompt's decoding state: `ids` are the positions the target has confirmed (their
    features are `features`); `new` ends with the token the next block is anchored on."""

    ids: list[int]
    features: Tensor  # (1, len(ids), n·H)
    new: list[int]
    accepted: list[int]
    forwards: int = 1  # the prefill


@torch.no_grad()
def speculative_decode_many(
    target: Target,
    drafter: BlockDrafter,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos: Sequence[int] | None = None,
) -> list[PromptResult]:
    """Greedy block speculative decoding of each prompt (steps in the module docstring), the
    prompts still going drafted together (`draft_many`) and verified in one forward."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    if not prompts:
        return []
    stop = _eos_ids(target, eos)
    out, firsts = _forward_next(target, prompts)  # prefill
    seqs, going = [], []
    for i, (prompt, first) in enumerate(zip(prompts, firsts, strict=True)):
        new, done = _cut([first], max_new_tokens, stop)
        seqs.append(_Sequence(list(prompt), out.features[i : i + 1, : len(prompt)], new, []))
        if not done:
            going.append(i)
    while going:
        going = _verify_round(
            target, drafter, [seqs[i] for i in going], going, max_new_tokens, stop
        )
    return [
        PromptResult(tokens=q.new, accepted=q.accepted, target_forwards=q.forwards) for q in seqs
    ]


def _verify_round(
    target: Target,
    drafter: BlockDrafter,
    seqs: list[_Sequence],
    indices: list[int],
    max_new_tokens: int,
    stop: set[int],
) -> list[int]:
    """One draft and verify pass of every sequence in `seqs` (updated in place); returns the
    `indices` of those still going."""
    b = drafter.block_size
    device = target.device
    for q in seqs:
        q.ids.append(q.new[-1])  # the anchor: the newest token, not yet seen by the target
    requests = [
        DraftRequest(q.features, torch.tensor([q.ids], device=device), len(q.ids) - 1) for q in seqs
    ]
    drafts = [d.to(device) for d in draft_many(drafter, requests)]  # (k,) each, k ≤ B−1
    for d in drafts:
        if d.shape[0] > b - 1:
            raise ValueError(f"the drafter proposed {d.shape[0]} tokens, more than B−1 = {b - 1}")
    out = target(_rows([q.ids + d.tolist() for q, d in zip(seqs, drafts, strict=True)], device))
    still = []
    for row, (q, d, i) in enumerate(zip(seqs, drafts, indices, strict=True)):
        anchor, k = len(q.ids) - 1, d.shape[0]
        q.forwards += 1
        preds = target.logits(out.last_hidden[row, anchor : anchor + k + 1]).argmax(-1)
        a = int((d == preds[:k]).long().cumprod(0).sum())  # longest matching prefix
        q.accepted.append(a)
        gained = [*d[:a].tolist(), int(preds[a])]
        q.new, done = _cut([*q.new, *gained], max_new_tokens, stop)
        q.ids.extend(gained[:-1])  # accepted drafts
        q.features = out.features[row : row + 1, : len(q.ids)]  # every confirmed position
        if not done:
            still.append(i)
    return still


# ---- the report ------------------------------------------------------------------------------


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
    # the target's rounding (`trainer.lossless`); lossless all the same
    lossless_ties: int = 0
    # slots 1 … B−1: right proposals of a block drafted at every output position, as in training
    # (`trainer.slot_accuracy`); None for a drafter that is not a trained one
    slot_accuracy: list[float] | None = None
    # 95 % bootstrap interval of τ over the prompts (`tau_interval`): what other prompts like
    # these could give; two drafters whose intervals overlap much are not told apart
    tau_interval: tuple[float, float] | None = None
    # each prompt's (tokens, verify passes): what the interval and paired comparisons of two
    # drafters on the same prompts are computed from (`trainer.tau_bootstrap`)
    prompt_counts: list[tuple[int, int]] | None = None
    # weights one draft reads ÷ those of a target forward, and `speedup` with every draft
    # counted at that (`trainer.draft_cost`: a small-batch estimate); None: not known
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
    counted: `trainer.lossless`). Prompts go in batches of about
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
    stop, ties = _eos_ids(target, eos), 0
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


def prompt_batches(
    prompts: Sequence[Sequence[int]], extra: int, batch_tokens: int
) -> list[list[int]]:
    """Consecutive runs of prompt indices whose rows, each as long as the batch's longest
    prompt plus `extra` tokens, stay within `batch_tokens` (one prompt at least): the memory of
    a forward over the batch, kept in prompt order so that reports stay per prompt."""
    batches: list[list[int]] = []
    longest = 0
    for i, prompt in enumerate(prompts):
        width = max(longest, len(prompt) + extra)
        if batches and width * (len(batches[-1]) + 1) <= batch_tokens:
            batches[-1].append(i)
            longest = width
        else:
            batches.append([i])
            longest = len(prompt) + extra
    return batches
