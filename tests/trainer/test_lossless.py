"""The lossless check against near-ties: a token whose logit lies within the target's rounding of
the best one is the target's greedy choice too, so speculative decoding that takes it is counted,
not refused; the output past it is then checked on its own. The ties are made exact on the demo
target: one token's lm_head row is set to another's, scaled by 1 − δ."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.demo_target import demo_target
from trainer.evaluation.lossless import LosslessViolation, check_output, tie_tolerance
from trainer.evaluation.prompt_lookup import PromptLookupDrafter
from trainer.evaluation.report import evaluate
from trainer.evaluation.speculative import greedy_decode
from trainer.model.target import Target

PROMPT = [17, 4, 99, 23, 61, 8]
NEW = 8
AT = 2  # the position of the tie in the greedy output


def twin_target(tmp_path_factory: pytest.TempPathFactory, delta: float) -> tuple[Target, int, int]:
    """The demo target with token b's logits (1 − δ) × token a's, a = the greedy token at `AT`:
    (target, a, b)."""
    target = demo_target(tmp_path_factory)
    a = greedy_decode(target, PROMPT, NEW, eos=[])[AT]
    b = (a + 1) % target.lm_head_weight.shape[0]
    with torch.no_grad():
        target.lm_head_weight[b] = target.lm_head_weight[a] * (1 - delta)
    return target, a, b


def through(target: Target, b: int) -> list[int]:
    """The greedy output of `PROMPT` had it taken `b` at `AT`."""
    want = greedy_decode(target, PROMPT, NEW, eos=[])
    head = [*want[:AT], b]
    return head + greedy_decode(target, PROMPT + head, NEW - len(head), eos=[])


def best_logit(target: Target, prefix: list[int]) -> float:
    with torch.no_grad():
        hidden = target(torch.tensor([prefix])).last_hidden[0, -1]
    return float(target.logits(hidden).max())


@pytest.mark.parametrize("delta", [0.0, 1e-6])
def test_a_near_tie_is_counted_and_the_output_past_it_checked(tmp_path_factory, delta) -> None:
    target, a, b = twin_target(tmp_path_factory, delta)
    want = greedy_decode(target, PROMPT, NEW, eos=[])
    assert want[AT] == a  # greedy keeps the first of two equal logits, or the larger
    best = best_logit(target, PROMPT + want[:AT])
    assert best > 0 and delta * best <= tie_tolerance(target, best)
    other = through(target, b)
    assert other != want
    assert check_output(target, 0, PROMPT, other, want, max_new_tokens=NEW, eos=set()) == 1
    # the same through `evaluate`, the other way round: plain decoding's output given as the
    # one through b, speculative decoding (prompt lookup) taking a
    report = evaluate(
        target, PromptLookupDrafter(4), [PROMPT], max_new_tokens=NEW, expected=[other], eos=[]
    )
    assert report.lossless_checked and report.lossless_ties == 1
    assert report.summary().endswith("| lossless (1 near-tie)")


def test_a_gap_past_the_tolerance_is_a_violation(tmp_path_factory) -> None:
    target, a, b = twin_target(tmp_path_factory, 0.05)
    want = greedy_decode(target, PROMPT, NEW, eos=[])
    best = best_logit(target, PROMPT + want[:AT])
    assert 0.05 * best > tie_tolerance(target, best)  # float32: far from rounding
    with pytest.raises(LosslessViolation) as err:
        evaluate(
            target, PromptLookupDrafter(4), [PROMPT], max_new_tokens=NEW,
            expected=[through(target, b)], eos=[],
        )  # fmt: skip
    assert err.value.position == AT and err.value.expected == b and err.value.got == a


def test_past_a_tie_a_wrong_token_or_an_early_stop_is_a_violation(tmp_path_factory) -> None:
    target, a, b = twin_target(tmp_path_factory, 0.0)
    want = greedy_decode(target, PROMPT, NEW, eos=[])
    other = through(target, b)
    wrong = [*other[:5], (other[5] + 1) % 256, *other[6:]]
    with pytest.raises(LosslessViolation) as err:
        check_output(target, 3, PROMPT, wrong, want, max_new_tokens=NEW, eos=set())
    assert err.value.prompt == 3 and err.value.position == 5 and err.value.expected == other[5]
    with pytest.raises(LosslessViolation) as err:  # stopped with no EOS, before the budget
        check_output(target, 3, PROMPT, other[:6], want, max_new_tokens=NEW, eos=set())
    assert err.value.position == 6 and err.value.got is None
    # an EOS ends the output: here the token at 5 is one (first met at `end`, past the tie), and
    # decoding went on past it
    end = other.index(other[5])
    assert AT < end < NEW - 1
    with pytest.raises(LosslessViolation) as err:
        check_output(target, 3, PROMPT, other, want, max_new_tokens=NEW, eos={other[5]})
    assert err.value.position == end + 1
    # cut right after it, the output is whole
    whole = other[: end + 1]
    assert check_output(target, 3, PROMPT, whole, want, max_new_tokens=NEW, eos={other[5]}) == 1
    # the tied token itself an EOS, and decoding went on
    with pytest.raises(LosslessViolation) as err:
        check_output(target, 3, PROMPT, other, want, max_new_tokens=NEW, eos={b})
    assert err.value.position == AT + 1
    with pytest.raises(LosslessViolation) as err:  # past the token budget
        check_output(target, 3, PROMPT, other, want, max_new_tokens=NEW - 2, eos=set())
    assert err.value.position == NEW - 2 and err.value.got == other[NEW - 2]


def test_the_tolerance_follows_the_target_precision(tmp_path_factory) -> None:
    target = demo_target(tmp_path_factory)
    assert tie_tolerance(target, 20.0) == pytest.approx(2e-3)  # float32
    assert tie_tolerance(target, 0.1) == pytest.approx(1e-4)  # at least 1 × rtol
    target.model.to(torch.bfloat16)
    assert tie_tolerance(target, 20.0) == pytest.approx(1.0)
