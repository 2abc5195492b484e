"""Decoding prompts in batches (right-padded rows sharing every forward) against decoding each
alone, in float64 on a tiny demo target (so that no argmax tie can tell the two apart): the
greedy outputs equal a one-forward-per-token reference, every prompt's speculative result
(tokens, acceptance per pass, forwards) is the one it gets alone, whatever the drafter, and
`evaluate`'s report does not depend on how prompts are batched."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.trainer.demo_target import demo_target
from trainer.evaluation.drafters import DFlashDrafter, DraftRequest
from trainer.evaluation.prompt_lookup import PromptLookupDrafter
from trainer.evaluation.report import evaluate
from trainer.evaluation.speculative import (
    greedy_decode_many,
    prompt_batches,
    speculative_decode,
    speculative_decode_many,
)
from trainer.model.drafter import Drafter, shape_from_target
from trainer.model.target import Target
from trainer.settings.config import ModelConfig

BLOCK = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Target:
    loaded = demo_target(tmp_path_factory)
    loaded.model.double()
    return loaded


def prompts_of_lengths(lengths: list[int], *, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=gen).tolist() for n in lengths]


PROMPTS = prompts_of_lengths([7, 3, 12, 5, 9, 4], seed=5)


def reference_greedy(target: Target, prompt: list[int], max_new: int, stop: set[int]) -> list[int]:
    """One unpadded forward over the whole sequence per new token."""
    seq, new = list(prompt), []
    with torch.no_grad():
        while len(new) < max_new:
            hidden = target(torch.tensor([seq])).last_hidden[0, -1]
            tok = int((hidden @ target.lm_head_weight.T).argmax())
            new.append(tok)
            seq.append(tok)
            if tok in stop:
                break
    return new


class NoisyOracle:
    """Proposes the target's greedy continuation with the slots where (anchor + slot) is a
    multiple of 3 wrong: acceptance that differs from pass to pass and from prompt to prompt."""

    def __init__(self, target: Target) -> None:
        self.target, self.block_size = target, BLOCK

    def draft(self, features: torch.Tensor, input_ids: torch.Tensor, anchor: int) -> torch.Tensor:
        tokens = reference_greedy(self.target, input_ids[0].tolist(), BLOCK - 1, set())
        wrong = [(t + 1) % 256 if (anchor + j) % 3 == 0 else t for j, t in enumerate(tokens, 1)]
        return torch.tensor(wrong)


def random_drafter(target: Target) -> DFlashDrafter:
    torch.manual_seed(0)
    shape = shape_from_target(
        target.config, ModelConfig(num_layers=1, block_size=BLOCK), num_features=len(target.layers)
    )
    return DFlashDrafter(
        Drafter(shape).double(),
        embed_weight=target.embed_weight,
        lm_head_weight=target.lm_head_weight,
    )


def stop_token(target: Target) -> int:
    """A token some prompts' greedy outputs reach early: their rows leave the batch first."""
    outputs = [reference_greedy(target, p, 12, set()) for p in PROMPTS]
    return outputs[1][4]


def test_batched_greedy_equals_one_forward_per_token(target) -> None:
    stop = stop_token(target)
    got = greedy_decode_many(target, PROMPTS, 12, eos=[stop])
    want = [reference_greedy(target, p, 12, {stop}) for p in PROMPTS]
    assert got == want
    assert any(len(w) < 12 for w in want) and any(len(w) == 12 for w in want)


@pytest.mark.parametrize("kind", ["noisy-oracle", "prompt-lookup", "dflash"])
def test_each_prompt_decodes_in_a_batch_as_alone(target, kind) -> None:
    drafter = {
        "noisy-oracle": NoisyOracle,
        "prompt-lookup": lambda _: PromptLookupDrafter(BLOCK),
        "dflash": random_drafter,
    }[kind](target)
    stop = stop_token(target)
    together = speculative_decode_many(target, drafter, PROMPTS, 12, eos=[stop])
    alone = [speculative_decode(target, drafter, p, 12, eos=[stop]) for p in PROMPTS]
    assert together == alone
    assert [r.tokens for r in together] == [
        reference_greedy(target, p, 12, {stop}) for p in PROMPTS
    ]
    if kind == "noisy-oracle":  # passes accept different numbers of drafts
        assert len({a for r in together for a in r.accepted}) >= 2


def test_drafter_blocks_of_several_sequences_equal_their_own(target) -> None:
    """`rows_hidden` pads the sequences to one length: each block still sees only its own
    features, as `block_hidden` of that sequence alone computes them."""
    block = random_drafter(target)
    requests = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        anchor = len(prompt) - 1
        requests.append(DraftRequest(target(ids[:, :anchor]).features, ids, anchor))
    together = block.rows_hidden(requests)  # (n, B, H)
    for row, r in zip(together, requests, strict=True):
        alone = block.block_hidden(r.features, r.input_ids, r.anchor)
        assert float((row - alone).norm() / alone.norm()) < 1e-12
    assert [d.tolist() for d in block.draft_many(requests)] == [
        block.draft(*r).tolist() for r in requests
    ]


def test_the_report_does_not_depend_on_batching(target) -> None:
    drafter = NoisyOracle(target)
    one_each = evaluate(target, drafter, PROMPTS, max_new_tokens=10, batch_tokens=1)
    all_at_once = evaluate(target, drafter, PROMPTS, max_new_tokens=10, batch_tokens=10**6)
    assert dataclasses.asdict(one_each) == dataclasses.asdict(all_at_once)
    seen: list[int] = []
    evaluate(
        target, drafter, PROMPTS, max_new_tokens=10, batch_tokens=40,
        progress=lambda done, total, tau: seen.append(done),
    )  # fmt: skip
    assert seen[-1] == len(PROMPTS) and len(seen) > 1 and seen == sorted(seen)


def test_prompt_batches_keep_order_and_bound_tokens() -> None:
    prompts = [[1] * n for n in (5, 5, 20, 3, 3, 3)]
    # rows are as long as the batch's longest prompt + 10
    assert prompt_batches(prompts, 10, 45) == [[0, 1], [2], [3, 4, 5]]
    assert prompt_batches(prompts, 10, 1) == [[i] for i in range(6)]  # one prompt at least
    assert prompt_batches(prompts, 10, 10**6) == [list(range(6))]
    for batch in prompt_batches(prompts, 10, 60):
        assert len(batch) * max(len(prompts[i]) + 10 for i in batch) <= 60 or len(batch) == 1
