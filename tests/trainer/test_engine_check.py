"""The engine report and its check against the project's decoding: a report of exactly what the
project decodes agrees; a changed token or accepted count is found at its place; a served K other
than B − 1 is decoded with the engine's block and said to be another drafter; bad lines are
refused by line and key."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tests.trainer.demo_target import demo_target
from trainer.evaluation.drafters import DFlashDrafter
from trainer.evaluation.engine_check import (
    Parting,
    accepted_counts,
    check_engine,
    drafter_at,
    parting,
)
from trainer.evaluation.engine_report import (
    EngineReportError,
    EngineRequest,
    read_report,
    write_report,
)
from trainer.evaluation.speculative import greedy_outputs, speculative_decode_many
from trainer.model.drafter import Drafter, shape_from_target
from trainer.model.target import Target
from trainer.settings.config import ModelConfig

BLOCK = 4
NEW = 12


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Target:
    return demo_target(tmp_path_factory)


def drafter(target: Target, block: int = BLOCK, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    shape = shape_from_target(
        target.config, ModelConfig(num_layers=2, block_size=block), num_features=len(target.layers)
    )
    return DFlashDrafter(
        Drafter(shape), embed_weight=target.embed_weight, lm_head_weight=target.lm_head_weight
    )


def prompts(n: int = 4) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (3 + i,), generator=gen).tolist() for i in range(n)]


def project_report(target: Target, d: DFlashDrafter, k: int) -> list[EngineRequest]:
    """What an engine that computes the project's function reports (K = k)."""
    decoded = speculative_decode_many(target, drafter_at(d, k + 1), prompts(), NEW, eos=[])
    return [
        EngineRequest(p, r.tokens, NEW, r.accepted, k)
        for p, r in zip(prompts(), decoded, strict=True)
    ]


def test_a_report_of_the_projects_own_decoding_agrees(target, tmp_path) -> None:
    d = drafter(target)
    path = write_report(tmp_path / "r.jsonl", project_report(target, d, BLOCK - 1))
    requests = read_report(path)
    assert requests == project_report(target, d, BLOCK - 1)
    result = check_engine(target, d, requests)
    assert result.agree and result.engine_tau == result.project_tau
    assert "engine and project agree" in result.summary()
    assert json.loads(json.dumps(result.to_json()))["agree"] is True


def test_a_changed_token_or_count_is_found_where_it_is(target) -> None:
    d = drafter(target)
    requests = project_report(target, d, BLOCK - 1)
    greedy5 = requests[1].output[5]
    out = list(requests[1].output)
    out[5] = (greedy5 + 1) % 256
    counts = list(requests[2].accepted or [])
    counts[3] = (counts[3] + 1) % BLOCK
    requests[1] = replace(requests[1], output=out)
    requests[2] = replace(requests[2], accepted=counts)
    result = check_engine(target, d, requests)
    assert not result.agree
    assert result.requests[1].output == Parting(5, out[5], greedy5)
    assert result.requests[2].accepted is not None and result.requests[2].accepted.at == 3
    assert [r.index for r in result.requests if r.output or r.accepted] == [1, 2]
    text = result.summary()
    assert "request 1: output parts at new token 5" in text
    assert "request 2: acceptance parts at verify step 3" in text
    assert text.endswith("engine and project part")


def test_another_k_is_decoded_with_the_engines_block_and_named(target) -> None:
    d = drafter(target)
    requests = project_report(target, d, 2)  # an engine serving K = 2 (block of 3), B = 4
    result = check_engine(target, d, requests)
    assert result.agree and result.num_speculative_tokens == 2
    assert "not the drafter as trained (B = 4" in result.summary()
    assert "num_speculative_tokens = 3" in result.summary()


def test_a_smaller_block_drafts_as_a_drafter_built_with_it(target) -> None:
    """`drafter_at` (the weights, a block of K + 1) is the drafter built for that block."""
    d = drafter(target, block=BLOCK)
    small = drafter(target, block=3)
    small.drafter.load_state_dict(d.drafter.state_dict())
    got = accepted_counts(target, drafter_at(d, 3), prompts(), NEW, eos=[])
    want = accepted_counts(target, small, prompts(), NEW, eos=[])
    assert got == want
    assert d.block_size == BLOCK  # the original is untouched


def test_a_run_without_a_drafter_is_checked_on_its_outputs(target) -> None:
    greedy = greedy_outputs(target, prompts(), NEW, eos=[])
    requests = [EngineRequest(p, g, NEW) for p, g in zip(prompts(), greedy, strict=True)]
    result = check_engine(target, drafter(target), requests)
    assert result.agree and result.engine_tau is None
    assert "acceptance" not in result.summary()


def test_parting_counts_an_early_end() -> None:
    assert parting([1, 2, 3], [1, 2, 3]) is None
    assert parting([1, 2], [1, 2, 3]) == Parting(2, None, 3)
    assert parting([1, 5, 3], [1, 2, 3]) == Parting(1, 5, 2)


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("not json", "not JSON"),
        ('{"prompt": [], "output": [], "max_tokens": 4}', "prompt is empty"),
        ('{"prompt": [1], "output": [1, 2], "max_tokens": 1}', "more than max_tokens"),
        (
            '{"prompt": [1], "output": [2], "max_tokens": 4, "accepted": [1]}',
            "num_speculative_tokens",
        ),
        (
            '{"prompt": [1], "output": [2], "max_tokens": 4, "accepted": [5], "num_speculative_tokens": 3}',
            "above",
        ),
        ('{"prompt": [1, -2], "output": [2], "max_tokens": 4}', "prompt must be a list"),
        ('{"prompt": [1], "output": [2], "max_tokens": true}', "max_tokens must be"),
    ],
)
def test_a_bad_line_is_refused_by_line_and_key(tmp_path, line: str, words: str) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('{"prompt": [1], "output": [2], "max_tokens": 4}\n' + line + "\n")
    with pytest.raises(EngineReportError, match=words) as info:
        read_report(path)
    assert f"{path}:2" in str(info.value)


def test_requests_of_different_k_are_refused(tmp_path) -> None:
    a = EngineRequest([1], [2], 4, [0], 3)
    b = EngineRequest([1], [2], 4, [0], 7)
    with pytest.raises(EngineReportError, match="different num_speculative_tokens"):
        read_report(write_report(tmp_path / "r.jsonl", [a, b]))
