"""Greedy block speculative decoding with the frozen target: what a drafter is worth.

Training accuracy can be high while serving acceptance is near 1 (an off-by-one between mask,
positions and labels does exactly that), so the drafter is judged by decoding with it, the way
an inference engine does (each prompt on its own; a batch of prompts shares every forward, each
right-padded row computing what it would alone):

1. prefill: the target runs over the prompt (positions 0…P−1); its selected hidden states are the
   context features and its greedy prediction at P−1 is the first new token, at position p = P;
2. draft: the drafter fills the block `[x_p, MASK, …, MASK]` (positions p…p+B−1) in one forward of
   `Drafter.forward` with a single anchor p — the same mask as in training
   (`trainer.model.masks.dense_mask`: the block sees the features of positions < p, and itself); slot k
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
slot at every output position (`trainer.evaluation.slot_accuracy`, the training log's measure); the
speed-up in target forwards against plain greedy decoding (one forward per new token); and, when
asked, a lossless check against the target's own greedy output computed by plain decoding
(`trainer.evaluation.lossless`: near-ties of the target's logits are counted, any other difference raises
`LosslessViolation`).
Any `BlockDrafter` can be judged: a trained drafter (`DFlashDrafter`) or a baseline such as
prompt lookup (`trainer.evaluation.prompt_lookup`), which may propose fewer than B−1 tokens; the verify
pass then covers only what was proposed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.evaluation.drafters import BlockDrafter, DraftRequest, draft_many
from trainer.model.target import Target, TargetOutput

# Tokens of one batched forward at its longest (rows × longest row): the verify pass of a batch
# of prompts keeps every selected layer's hidden states of all its positions.
BATCH_TOKENS = 8192


# ---- decoding --------------------------------------------------------------------------------


def eos_ids(target: Target, eos: Sequence[int] | None) -> set[int]:
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
    stop = eos_ids(target, eos)
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
    stop = eos_ids(target, eos)
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
