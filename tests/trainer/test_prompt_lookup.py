"""Prompt lookup drafting: the proposals on hand-made sequences (the longest earlier n-gram, its
last occurrence, an overlapping repeat, no match) and against a token-by-token reference on
random sequences. Decoding with it (lossless, beside a drafter) is in `test_evaluate.py`."""

from __future__ import annotations

import pytest
import torch

from trainer.evaluation.prompt_lookup import PromptLookupDrafter, baseline_drafter, lookup


def propose(seq: list[int], k: int = 3, *, max_n: int = 4, min_n: int = 1) -> list[int]:
    return lookup(torch.tensor(seq), num_tokens=k, max_n=max_n, min_n=min_n).tolist()


def test_the_longest_suffix_wins_over_a_later_shorter_match() -> None:
    # newest 2-gram [1, 2] occurred at 0 (followed by 7 8 9); the newest token 2 alone occurred
    # later, at 5 (followed by 5 6): n = 2 is tried first
    seq = [1, 2, 7, 8, 9, 2, 5, 6, 1, 2]
    assert propose(seq, max_n=2) == [7, 8, 9]
    assert propose(seq, max_n=1) == [5, 6, 1]
    assert propose(seq, max_n=2, min_n=2) == [7, 8, 9]


def test_the_last_earlier_occurrence_is_used() -> None:
    seq = [4, 5, 10, 11, 12, 4, 5, 20, 21, 22, 4, 5]
    assert propose(seq) == [20, 21, 22]
    assert propose(seq, 2) == [20, 21]


def test_no_match_proposes_nothing() -> None:
    assert propose([1, 2, 3, 4]) == []
    assert propose([9]) == []
    assert propose([1, 2, 3, 1], min_n=2) == []  # only a 1-gram matches


def test_a_match_at_the_end_continues_through_its_own_proposals() -> None:
    # the last earlier occurrence of [3] ends right before the newest token: the repeat has
    # period 2 (3 8 | 3), so it continues 8 3 8 …
    assert propose([1, 3, 8, 3], 5) == [8, 3, 8, 3, 8]
    assert propose([6, 6], 3) == [6, 6, 6]


def test_an_overlapping_match() -> None:
    # [a b a] occurs at 0 and overlaps the newest [a b a] at 2: continues with b a b …
    assert propose([1, 2, 1, 2, 1], 4, max_n=3) == [2, 1, 2, 1]
    # the 4-gram [7 7 7 7] in a run of five 7s: its last earlier occurrence starts at 0
    assert propose([7, 7, 7, 7, 7], 3) == [7, 7, 7]


def reference(seq: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Plain-Python statement of the rule, token by token."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(seq):
            continue
        starts = [i for i in range(len(seq) - n) if seq[i : i + n] == seq[len(seq) - n :]]
        if starts:
            out = list(seq)
            j = starts[-1] + n
            for _ in range(k):
                out.append(out[j])
                j += 1
            return out[len(seq) :]
    return []


def test_matches_the_reference_on_random_sequences() -> None:
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        length = int(torch.randint(1, 30, (1,), generator=gen))
        vocab = 2 + trial % 5
        seq = torch.randint(0, vocab, (length,), generator=gen).tolist()
        max_n = 1 + trial % 4
        min_n = 1 + (trial // 4) % max_n
        k = 1 + trial % 7
        assert propose(seq, k, max_n=max_n, min_n=min_n) == reference(seq, k, max_n, min_n), (
            seq,
            k,
            max_n,
            min_n,
        )


def test_the_drafter_reads_the_sequence_up_to_the_anchor() -> None:
    drafter = PromptLookupDrafter(4, max_n=2)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6]])
    assert drafter.draft(torch.empty(1, 5, 3), ids, 5).tolist() == [7, 8, 5]
    with pytest.raises(ValueError, match="min_n"):
        PromptLookupDrafter(4, max_n=1, min_n=2)
    assert baseline_drafter("none", 4) is None
    with pytest.raises(ValueError, match="unknown baseline"):
        baseline_drafter("ngram", 4)
