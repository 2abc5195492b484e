"""Greedy block speculative decoding with the frozen target: what a drafter is worth.

Training accuracy can be high while serving acceptance is near 1 (an off-by-one between mask,
positions and labels does exactly that), so the drafter is judged by decoding with it, the way
an inference engine does, one prompt at a time:

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
correct, and cheap at the sizes this runs on. `evaluate` reports τ, the mean acceptance length
(tokens per verify forward, bonus included, as found by the verify pass even where the output is
then cut at the token budget or EOS); per-slot acceptance (the fraction of verify passes whose
draft at slot k was accepted, so τ = 1 + Σ_k rate_k); for a trained drafter, its accuracy by
slot at every output position (`trainer.slot_accuracy`, the training log's measure); the
speed-up in target forwards against plain greedy decoding (one forward per new token); and, when
asked, a lossless check against the target's own greedy output computed by plain decoding — a
difference raises `LosslessViolation`.
Any `BlockDrafter` can be judged: a trained drafter (`DFlashDrafter`) or a baseline such as
prompt lookup (`trainer.prompt_lookup`), which may propose fewer than B−1 tokens; the verify
pass then covers only what was proposed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.data import bucket_length
from trainer.errors import TrainerError
from trainer.model import Drafter
from trainer.slot_accuracy import SlotAccuracy
from trainer.target import Target
from trainer.tau_bootstrap import prompt_counts, tau_interval


class LosslessViolation(TrainerError):
    """Speculative decoding produced a token the target's own greedy decoding does not."""

    hint = (
        "Speculative decoding must reproduce the target exactly: a bug in the verify step, or "
        "numerics that change the target's argmax between forward lengths (see the logit margin)."
    )

    def __init__(
        self, *, prompt: int, position: int, expected: int | None, got: int | None, margin: float
    ) -> None:
        super().__init__(
            f"prompt {prompt}: new token {position} is {got} with speculative decoding, "
            f"{expected} with plain greedy decoding (target top-2 logit margin there: {margin:.3g})"
        )
        self.prompt = prompt
        self.position = position
        self.expected = expected
        self.got = got


class BlockDrafter(Protocol):
    """What the evaluator calls to draft one block."""

    block_size: int

    def draft(self, features: Tensor, input_ids: Tensor, anchor: int) -> Tensor:
        """features (1, anchor, n·H): the target's features of positions < anchor; input_ids
        (1, anchor + 1): the sequence up to the anchor token → (k,) long with k ≤ B−1, the
        proposals for positions anchor+1 … anchor+k (a trained drafter always proposes B−1;
        prompt lookup proposes none when nothing matches)."""
        ...


class DFlashDrafter:
    """A trained `Drafter` behind the `BlockDrafter` interface: one forward with one anchor.

    The context is padded to a multiple of `bucket` (unseen: the mask stops at the anchor).
    Attention runs on the SDPA backend by default: one block's dense mask is B × (S + B), tiny,
    and it keeps the compiled flex kernels of a training run in the same process from
    recompiling for every context length; both backends implement `dense_mask` exactly.
    """

    def __init__(
        self,
        drafter: Drafter,
        *,
        embed_weight: Tensor,
        lm_head_weight: Tensor,
        bucket: int = 64,
        backend: str = "sdpa",
    ) -> None:
        self.drafter = drafter
        self.embed_weight = embed_weight.detach()
        self.lm_head_weight = lm_head_weight.detach()
        self.block_size = drafter.shape.block_size
        self.bucket = bucket
        self.backend = backend

    def block_hidden(self, features: Tensor, input_ids: Tensor, anchor: int) -> Tensor:
        """The drafter's final hidden states of the block at `anchor` → (B, H): one training
        forward (`Drafter.forward`) with a single valid anchor."""
        return self.blocks_hidden(features, input_ids, [anchor])[0]

    @torch.no_grad()
    def blocks_hidden(self, features: Tensor, input_ids: Tensor, anchors: list[int]) -> Tensor:
        """One block per anchor in one forward → (N, B, H); features (1, ≥ last anchor, n·H)
        and input_ids (1, ≥ last anchor + 1). Each block sees the features before its own
        anchor only (the training mask), so the blocks are those of separate `draft` calls."""
        device = features.device
        last = max(anchors)
        seq = bucket_length(last + 1, self.bucket)
        feats = F.pad(features[:, :last], (0, 0, 0, seq - last))  # (1, S, n·H)
        ids = F.pad(input_ids[:, : last + 1], (0, seq - last - 1))  # (1, S)
        starts = torch.tensor([anchors], device=device)  # (1, N)
        valid = torch.ones_like(starts, dtype=torch.bool)
        was_training, backend = self.drafter.training, self.drafter.attention_backend
        self.drafter.eval()
        self.drafter.attention_backend = self.backend
        autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
        )
        try:
            with autocast:
                hidden = self.drafter(feats, ids, starts, valid, self.embed_weight)  # (1,N,B,H)
        finally:
            self.drafter.train(was_training)
            self.drafter.attention_backend = backend
        return hidden[0]

    def draft(self, features: Tensor, input_ids: Tensor, anchor: int) -> Tensor:
        hidden = self.block_hidden(features, input_ids, anchor)  # (B, H)
        logits = hidden[1:].float() @ self.lm_head_weight.float().T  # (B−1, V)
        return logits.argmax(-1)


# ---- decoding --------------------------------------------------------------------------------


def _logits(target: Target, last_hidden: Tensor) -> Tensor:
    """(…, H) → (…, V) fp32 through the frozen lm_head."""
    return last_hidden.float() @ target.lm_head_weight.float().T


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


@torch.no_grad()
def greedy_decode(
    target: Target, prompt: Sequence[int], max_new_tokens: int, *, eos: Sequence[int] | None = None
) -> list[int]:
    """The target's own greedy output: one forward over the whole sequence per new token."""
    stop = _eos_ids(target, eos)
    ids = torch.tensor([list(prompt)], device=target.device)  # (1, L)
    new: list[int] = []
    while True:
        out = target(ids)
        tok = int(_logits(target, out.last_hidden[0, -1]).argmax())
        new, done = _cut([*new, tok], max_new_tokens, stop)
        if done:
            return new
        ids = torch.cat([ids, ids.new_tensor([[tok]])], dim=1)


@dataclass(frozen=True)
class PromptResult:
    tokens: list[int]  # the new tokens
    accepted: list[int]  # per verify pass: draft tokens accepted (0 … B−1), bonus not counted
    target_forwards: int  # prefill + verify passes


@torch.no_grad()
def speculative_decode(
    target: Target,
    drafter: BlockDrafter,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    eos: Sequence[int] | None = None,
) -> PromptResult:
    """Greedy block speculative decoding of one prompt (steps in the module docstring)."""
    if not prompt:
        raise ValueError("empty prompt")
    stop = _eos_ids(target, eos)
    b = drafter.block_size
    ids = torch.tensor([list(prompt)], device=target.device)  # (1, P)
    out = target(ids)  # prefill
    forwards = 1
    first = int(_logits(target, out.last_hidden[0, -1]).argmax())
    new, done = _cut([first], max_new_tokens, stop)
    features = out.features  # (1, P, n·H): context of the anchor at position P
    accepted: list[int] = []
    while not done:
        anchor = ids.shape[1]  # position of the newest token, not yet seen by the target
        ids = torch.cat([ids, ids.new_tensor([[new[-1]]])], dim=1)  # (1, anchor + 1)
        draft = drafter.draft(features, ids, anchor).to(ids.device)  # (k,), k ≤ B−1
        k = draft.shape[0]
        if k > b - 1:
            raise ValueError(f"the drafter proposed {k} tokens, more than B−1 = {b - 1}")
        out = target(torch.cat([ids, draft[None]], dim=1))  # verify: (1, anchor + 1 + k)
        forwards += 1
        preds = _logits(target, out.last_hidden[0, anchor:]).argmax(-1)  # (k+1,) g_1 … g_k+1
        match = (draft == preds[:k]).long()
        a = int(match.cumprod(0).sum())  # longest matching prefix
        accepted.append(a)
        gained = [*draft[:a].tolist(), int(preds[a])]
        new, done = _cut([*new, *gained], max_new_tokens, stop)
        ids = torch.cat([ids, ids.new_tensor([gained[:-1]])], dim=1)  # accepted drafts
        features = out.features[:, : ids.shape[1]]  # features of every confirmed position
    return PromptResult(tokens=new, accepted=accepted, target_forwards=forwards)


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
    # slots 1 … B−1: right proposals of a block drafted at every output position, as in training
    # (`trainer.slot_accuracy`); None for a drafter that is not a trained one
    slot_accuracy: list[float] | None = None
    # 95 % bootstrap interval of τ over the prompts (`tau_interval`): what other prompts like
    # these could give; two drafters whose intervals overlap much are not told apart
    tau_interval: tuple[float, float] | None = None
    # each prompt's (tokens, verify passes): what the interval and paired comparisons of two
    # drafters on the same prompts are computed from (`trainer.tau_bootstrap`)
    prompt_counts: list[tuple[int, int]] | None = None

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
        every = ""
        if self.slot_accuracy is not None:
            every = f" | acc% at every position {_percents(self.slot_accuracy)}"
        spread = ""
        if self.tau_interval is not None:
            lo, hi = self.tau_interval
            spread = f" (95% {lo:.2f}–{hi:.2f})"
        return (
            f"tau {self.tau:.3f}{spread} | accept% by slot {slots}{every} | "
            f"{self.new_tokens} tokens, "
            f"{self.target_forwards} target forwards vs {self.plain_forwards} plain "
            f"(x{self.speedup:.2f}) | {self.prompts} prompts, B={self.block_size} | {check}"
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
) -> EvalReport:
    """Speculative decoding over `prompts`; with `check_lossless`, also plain greedy decoding
    of each prompt (or its output given in `expected`, to decode it once for several drafters),
    and `LosslessViolation` on the first differing token. `progress(done, total, τ so far)`
    after each prompt (a long evaluation is not silent until its end)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be ≥ 1")
    if not prompts:
        raise ValueError("no prompts")
    if expected is not None and len(expected) != len(prompts):
        raise ValueError(f"{len(expected)} expected outputs for {len(prompts)} prompts")
    b = drafter.block_size
    results = []
    every = SlotAccuracy(target, drafter) if isinstance(drafter, DFlashDrafter) else None
    for i, prompt in enumerate(prompts):
        res = speculative_decode(target, drafter, prompt, max_new_tokens, eos=eos)
        if check_lossless:
            want = None if expected is None else expected[i]
            _check_lossless(target, i, prompt, res.tokens, max_new_tokens, eos, want=want)
        if every is not None:  # the output is the target's greedy one (checked or not)
            every.add(prompt, res.tokens)
        results.append(res)
        if progress is not None:
            so_far = [a for r in results for a in r.accepted]
            tau = (sum(so_far) + len(so_far)) / len(so_far) if so_far else float("nan")
            progress(i + 1, len(prompts), tau)
    accepted = [a for r in results for a in r.accepted]
    verifies = len(accepted)
    counts = prompt_counts([r.accepted for r in results])
    new_tokens = sum(len(r.tokens) for r in results)
    forwards = sum(r.target_forwards for r in results)
    slots = [sum(a >= k for a in accepted) / max(verifies, 1) for k in range(1, b)]
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
        slot_accuracy=None if every is None else every.rates(),
        tau_interval=tau_interval(counts) if verifies else None,
        prompt_counts=counts,
    )


def _check_lossless(
    target: Target,
    index: int,
    prompt: Sequence[int],
    got: list[int],
    max_new_tokens: int,
    eos: Sequence[int] | None,
    *,
    want: list[int] | None = None,
) -> None:
    if want is None:
        want = greedy_decode(target, prompt, max_new_tokens, eos=eos)
    if got == want:
        return
    pos = next(
        (j for j, (w, g) in enumerate(zip(want, got, strict=False)) if w != g),
        min(len(want), len(got)),
    )
    with torch.no_grad():
        seq = torch.tensor([[*prompt, *want[:pos]]], device=target.device)
        top2 = _logits(target, target(seq).last_hidden[0, -1]).topk(2).values
    raise LosslessViolation(
        prompt=index,
        position=pos,
        expected=want[pos] if pos < len(want) else None,
        got=got[pos] if pos < len(got) else None,
        margin=float(top2[0] - top2[1]),
    )
