"""The lossless check of speculative decoding: every token it emits must be the target's greedy
choice, up to numerical ties.

Plain greedy decoding (one forward per new token) and speculative decoding (one verify forward
per block) run the target over prefixes of different lengths, whose matrix products round
differently. Where the target's two best logits lie closer than that rounding, the two may pick
different tokens, each the target's greedy choice within its precision: a near-tie, not a fault
(serving engines see the same between batch shapes), and common in bf16. Past one, the outputs
are different texts, so the speculative output is then checked on its own: one forward over the
prompt and that output, every token within the tie tolerance of the best logit at its position,
and decoding stopped only at the token budget or an EOS. Anything else is a `LosslessViolation`:
a bug in drafting or verifying.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.base.errors import TrainerError
from trainer.model.target import Target

# The tie tolerance, relative to the best logit's size (at least 1), above what rounding moves
# logits between forward lengths (`bench/logit_rounding.py`, random Qwen3s of 4 and 16 layers on
# a CPU: up to 1.1e-6 in float32, 1.4e-2 in bf16). A wrong token accepted by a bug lies far below
# the best logit; one within this of it is a tie, counted in the report.
TIE_RTOL = {torch.float64: 1e-8, torch.float32: 1e-4}
HALF_RTOL = 5e-2  # bf16 (8 significant bits), fp16 (11): 3.5× the largest change measured


class LosslessViolation(TrainerError):
    """Speculative decoding produced a token the target's own greedy decoding does not."""

    hint = (
        "Speculative decoding must reproduce the target's greedy output (near-ties of its logits "
        "aside, which are counted, not refused): this is a bug in the drafting or verify step."
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


def tie_tolerance(target: Target, best: float) -> float:
    """How far below the best logit `best` a token still counts as tied with it."""
    rtol = TIE_RTOL.get(target.lm_head_weight.dtype, HALF_RTOL)
    return rtol * max(1.0, abs(best))


def check_output(
    target: Target,
    index: int,
    prompt: Sequence[int],
    got: list[int],
    want: list[int],
    *,
    max_new_tokens: int,
    eos: set[int],
) -> int:
    """The near-ties on the way from `prompt` to `got` (speculative decoding's output), given
    `want` (plain greedy decoding's); `LosslessViolation` at the first token that is no tie.
    At the first difference both tokens must lie within the tie tolerance of the best logit."""
    if got == want:
        return 0
    pos = next(
        (j for j, (w, g) in enumerate(zip(want, got, strict=False)) if w != g),
        min(len(want), len(got)),
    )
    with torch.no_grad():
        seq = torch.tensor([[*prompt, *want[:pos]]], device=target.device)
        logits = target.logits(target(seq).last_hidden[0, -1])
    both = pos < min(len(want), len(got))
    if both and _tied(target, logits, got[pos]) and _tied(target, logits, want[pos]):
        return 1 + _check_alone(target, index, prompt, got, pos + 1, max_new_tokens, eos)
    top2 = logits.topk(2).values
    raise LosslessViolation(
        prompt=index,
        position=pos,
        expected=want[pos] if pos < len(want) else None,
        got=got[pos] if pos < len(got) else None,
        margin=float(top2[0] - top2[1]),
    )


def _tied(target: Target, logits: torch.Tensor, token: int) -> bool:
    best = float(logits.max())
    return best - float(logits[token]) <= tie_tolerance(target, best)


@torch.no_grad()
def _check_alone(
    target: Target,
    index: int,
    prompt: Sequence[int],
    got: list[int],
    start: int,
    max_new_tokens: int,
    eos: set[int],
) -> int:
    """`got[start:]` against the target's logits from one forward over `prompt` + `got`: each
    token the best or tied with it (the ties counted), and the output cut only where greedy
    decoding would stop."""
    seq = torch.tensor([[*prompt, *got]], device=target.device)
    logits = target.logits(target(seq).last_hidden[0, len(prompt) - 1 :])  # (len(got) + 1, V)
    for j in range(start - 1, len(got) - 1):
        if got[j] in eos:  # decoding went on past an EOS
            raise _violation(index, j + 1, logits[j + 1], got[j + 1])
    if len(got) > max_new_tokens:
        raise _violation(index, max_new_tokens, logits[max_new_tokens], got[max_new_tokens])
    ties = 0
    for j in range(start, len(got)):
        if int(logits[j].argmax()) != got[j]:
            if not _tied(target, logits[j], got[j]):
                raise _violation(index, j, logits[j], got[j])
            ties += 1
    if len(got) < max_new_tokens and got[-1] not in eos:  # stopped early
        raise _violation(index, len(got), logits[len(got)], None)
    return ties


def _violation(
    index: int, position: int, logits: torch.Tensor, got: int | None
) -> LosslessViolation:
    top2 = logits.topk(2)
    return LosslessViolation(
        prompt=index,
        position=position,
        expected=int(top2.indices[0]),
        got=got,
        margin=float(top2.values[0] - top2.values[1]),
    )
