"""Speculative-decoding evaluation on a tiny demo target: an oracle drafter reaches τ = B, a
random drafter τ ≈ 1, every run reproduces the target's greedy output, the single-block drafter
call is the training forward, prompts load from both training formats, and prompt lookup decodes
losslessly beside a drafter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.demo_target import demo_target
from trainer.data.eval_prompts import PromptFileError, load_prompts
from trainer.evaluation.drafters import DFlashDrafter
from trainer.evaluation.evaluate import compare
from trainer.evaluation.lossless import LosslessViolation, check_output
from trainer.evaluation.prompt_lookup import PromptLookupDrafter
from trainer.evaluation.report import evaluate
from trainer.evaluation.speculative import greedy_decode, speculative_decode
from trainer.evaluation.tau_bootstrap import prompt_counts, tau_difference, tau_interval
from trainer.model.drafter import Drafter, shape_from_target
from trainer.model.target import Target
from trainer.settings.config import ModelConfig

BLOCK = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Target:
    return demo_target(tmp_path_factory)


def random_prompts(n: int, length: int, *, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, length), generator=gen).tolist()


class OracleDrafter:
    """Test stand-in: proposes the target's own greedy continuation of the block's anchor."""

    def __init__(self, target: Target, block_size: int) -> None:
        self.target = target
        self.block_size = block_size
        self.calls: list[int] = []

    def draft(self, features: torch.Tensor, input_ids: torch.Tensor, anchor: int) -> torch.Tensor:
        assert features.shape[1] == anchor and input_ids.shape[1] == anchor + 1
        self.calls.append(anchor)
        tokens = greedy_decode(self.target, input_ids[0].tolist(), self.block_size - 1, eos=[])
        return torch.tensor(tokens)


def random_drafter(target: Target, *, seed: int = 0, block_size: int = BLOCK) -> DFlashDrafter:
    torch.manual_seed(seed)
    shape = shape_from_target(
        target.config,
        ModelConfig(num_layers=1, block_size=block_size),
        num_features=len(target.layers),
    )
    return DFlashDrafter(
        Drafter(shape), embed_weight=target.embed_weight, lm_head_weight=target.lm_head_weight
    )


def test_oracle_reaches_block_size_and_is_lossless(target) -> None:
    oracle = OracleDrafter(target, BLOCK)
    new = 1 + 3 * BLOCK  # prefill token + three full blocks
    report = evaluate(target, oracle, random_prompts(3, 6, seed=1), max_new_tokens=new)
    assert report.tau == BLOCK
    assert report.slot_acceptance == [1.0] * (BLOCK - 1)
    assert report.verify_forwards == 3 * 3 and report.target_forwards == 3 * 4
    assert report.new_tokens == report.plain_forwards == 3 * new
    assert report.speedup == pytest.approx(new / 4)
    assert report.lossless_checked


def test_oracle_budget_cut_midblock_still_lossless(target) -> None:
    oracle = OracleDrafter(target, BLOCK)
    prompt = random_prompts(1, 5, seed=2)[0]
    res = speculative_decode(target, oracle, prompt, 7, eos=[])
    assert res.tokens == greedy_decode(target, prompt, 7, eos=[])
    assert res.accepted == [BLOCK - 1, BLOCK - 1]  # 1 + 4 + 4 ≥ 7: the output is cut to 7
    assert oracle.calls == [5, 5 + BLOCK]  # anchors: the first new token, then each bonus token


def test_eos_stops_both_decodings(target) -> None:
    prompt = random_prompts(1, 6, seed=3)[0]
    plain = greedy_decode(target, prompt, 12, eos=[])
    stop = plain[4]
    want = plain[: plain.index(stop) + 1]
    assert greedy_decode(target, prompt, 12, eos=[stop]) == want
    got = speculative_decode(target, OracleDrafter(target, BLOCK), prompt, 12, eos=[stop])
    assert got.tokens == want


def test_random_drafter_tau_near_one_and_lossless(target) -> None:
    report = evaluate(
        target, random_drafter(target), random_prompts(4, 6, seed=4), max_new_tokens=16
    )
    assert 1.0 <= report.tau < 1.3
    assert len(report.slot_acceptance) == BLOCK - 1
    assert report.tau == pytest.approx(1 + sum(report.slot_acceptance))
    assert report.speedup < 1.3


def test_single_block_draft_is_the_training_forward(target) -> None:
    """The inference call (context cut at the anchor, padded) equals the block of the same
    anchor inside a training batch that holds the whole sequence's features."""
    block = random_drafter(target, seed=5)
    ids = torch.tensor(random_prompts(1, 20, seed=6))  # (1, 20)
    feats = target(ids).features  # (1, 20, n·H)
    anchors = torch.tensor([[3, 9, 14]])
    with torch.no_grad():
        train_hidden = block.drafter(
            feats, ids, anchors, torch.ones_like(anchors, dtype=torch.bool), block.embed_weight
        )  # (1, 3, B, H)
    for n, p in enumerate(anchors[0].tolist()):
        got = block.block_hidden(feats[:, :p], ids[:, : p + 1], p)  # (B, H)
        torch.testing.assert_close(got, train_hidden[0, n], rtol=1e-4, atol=1e-5)


def test_lossless_violation_names_prompt_and_position(target) -> None:
    prompt = random_prompts(1, 6, seed=7)[0]
    want = greedy_decode(target, prompt, 8, eos=[])
    bad = [*want[:5], (want[5] + 1) % 256, *want[6:]]
    with pytest.raises(LosslessViolation) as err:
        check_output(target, 3, prompt, bad, want, max_new_tokens=8, eos=set())
    assert err.value.prompt == 3 and err.value.position == 5
    assert err.value.expected == want[5] and "prompt 3: new token 5" in str(err.value)


def test_prompts_from_both_training_formats(tmp_path, target) -> None:
    tok = tmp_path / "tok.jsonl"
    rows = [
        {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},
        {"input_ids": [9, 10], "loss_mask": [False, False]},
    ]
    tok.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_prompts(tok) == [[5, 6], [9, 10]]
    chat = tmp_path / "chat.jsonl"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    chat.write_text(json.dumps({"messages": msgs}) + "\n")
    folder = Path(target.model.name_or_path)
    (prompt,) = load_prompts(chat, tokenizer_dir=folder)
    from transformers import AutoTokenizer

    tk = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert tk.decode(prompt) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input_ids": [1, 2], "loss_mask": [1, 1]}) + "\n")
    with pytest.raises(PromptFileError, match="bad.jsonl:1: empty prompt"):
        load_prompts(bad)


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b'{"input_ids": [1, 2]}\n{"input_ids": [1, -2]}\n', r"p.jsonl:2: input_ids must be"),
        (b'{"input_ids": [1, 2], "loss_mask": [0]}\n', r"p.jsonl:1: input_ids \(2\) and loss"),
        (b'{"messages": [{"role": "user"}]}\n', r"p.jsonl:1: messages\[0\] \(user\) has no"),
        (b'{"messages": "hi"}\n', r"p.jsonl:1: 'messages' must be a non-empty list"),
        (b'{"text": "hi"}\n', r"p.jsonl:1: expected input_ids or messages"),
        (b"{oops\n", r"p.jsonl:1: not JSON"),
        (b"\xff\xfe\n", r"p.jsonl: not UTF-8 text"),
        (b"\n\n", r"p.jsonl: no prompts"),
    ],
)
def test_a_bad_prompt_line_is_named_with_the_training_formats_reasons(
    tmp_path: Path, content: bytes, why: str
) -> None:
    """Prompt files are read by the training formats' own parsers (a line without loss_mask
    is all prompt; a conversation may end without an assistant turn)."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    with pytest.raises(PromptFileError, match=why):
        load_prompts(path)
    path.write_bytes(b'{"input_ids": [3, 4]}\n')
    assert load_prompts(path) == [[3, 4]]


# ---- prompt lookup beside the drafter ---------------------------------------------------------


def test_speculative_decoding_with_prompt_lookup_is_the_greedy_output(target) -> None:
    """Distinct prompt tokens (no match at first: empty proposals) and repetitive ones (long
    proposals, some right, some wrong): the output is the target's greedy output either way."""
    lookup_drafter = PromptLookupDrafter(4)
    accepted = []
    for prompt in [
        list(range(40, 48)),
        [3, 9, 3, 9, 3, 9, 3],
        *([t % 8 for t in p] for p in random_prompts(3, 6, seed=8)),
    ]:
        res = speculative_decode(target, lookup_drafter, prompt, 24, eos=[])
        assert res.tokens == greedy_decode(target, prompt, 24, eos=[])
        accepted += res.accepted
    assert max(accepted) > 0 and min(accepted) == 0  # it drafted right and wrong


def test_evaluate_reports_prompt_lookup_beside_the_drafter(target) -> None:
    held = random_prompts(4, 6, seed=9)
    base = PromptLookupDrafter(4)
    alone = evaluate(target, base, held, max_new_tokens=20)  # raises on any lossless violation
    assert alone.lossless_checked and alone.tau >= 1.0
    assert alone.tau == pytest.approx(1 + sum(alone.slot_acceptance))
    # the demo target falls into cycles: prompt lookup catches them
    assert alone.tau > 1.2, alone.summary()

    both = compare(target, base, {"prompt_lookup": PromptLookupDrafter(4)}, held, max_new_tokens=20)
    assert both.drafter == alone and both.baselines["prompt_lookup"] == alone
    data = both.to_json()
    assert data["tau"] == alone.tau and data["baselines"]["prompt_lookup"]["tau"] == alone.tau
    lines = both.summary().splitlines()
    assert lines[0].startswith("drafter ") and lines[1].startswith("prompt lookup ")
    assert f"({alone.tau:.2f} vs {alone.tau:.2f})" in lines[2] and "x1.00" in lines[2]
    assert "tau difference +0.00 (95% +0.00…+0.00, paired over the prompts)" in lines[2]
    lo, hi = alone.tau_interval
    assert lo <= alone.tau <= hi and f"(95% {lo:.2f}–{hi:.2f})" in alone.summary()
    assert json.loads(json.dumps(data))["tau_interval"] == [lo, hi]


def test_tau_interval_matches_the_normal_approximation_on_many_prompts() -> None:
    """With equal verify passes per prompt τ is the mean of the prompts' τ: over 400 random
    prompts the bootstrap interval is the mean ± 1.96 standard errors (within 10 % of its
    width), and it narrows as 1/√n."""
    gen = torch.Generator().manual_seed(3)
    accepted = torch.randint(0, 8, (400, 10), generator=gen).tolist()
    taus = torch.tensor([1 + sum(a) / len(a) for a in accepted], dtype=torch.float64)
    mean, se = taus.mean().item(), (taus.std() / len(taus) ** 0.5).item()
    lo, hi = tau_interval(prompt_counts(accepted))
    assert abs(lo - (mean - 1.96 * se)) < 0.1 * (3.92 * se)
    assert abs(hi - (mean + 1.96 * se)) < 0.1 * (3.92 * se)
    lo4, hi4 = tau_interval(prompt_counts(accepted[:100]))
    assert 1.6 < (hi4 - lo4) / (hi - lo) < 2.4  # a quarter of the prompts: twice as wide


def test_tau_interval_weighs_prompts_by_their_verify_passes() -> None:
    def interval(accepted: list[list[int]], **kw: float) -> tuple[float, float]:
        return tau_interval(prompt_counts(accepted), **kw)

    # τ pools tokens over passes: half of the resamples hold both prompts, whose τ is
    # 58 / 51, not the prompts' mean τ (1 + 8) / 2
    median = 58 / 51
    assert interval([[0] * 50, [7]], level=0.0) == pytest.approx((median, median))
    assert interval([[3, 3], [3]]) == (4.0, 4.0)  # every prompt alike: no spread
    assert interval([[1, 2]], level=0.5) == (2.5, 2.5)  # one prompt: itself
    assert interval([[1], [5]], seed=1) == interval([[1], [5]], seed=1)  # seeded
    lo, hi = interval([[], []])
    assert lo != lo and hi != hi  # no verify pass: nan


def test_paired_difference_tells_apart_what_separate_intervals_cannot() -> None:
    """Two drafters on the same 32 prompts of very different difficulty, the second accepting
    one more draft on one pass of every prompt: their own intervals overlap almost entirely,
    the paired interval of the difference excludes zero, and equals a direct recomputation on
    the same draws."""
    gen = torch.Generator().manual_seed(5)
    hard = [int(x) for x in torch.randint(0, 7, (32,), generator=gen)]
    a = [[h] * 10 for h in hard]  # prompt i accepts hard[i] drafts on each of 10 passes
    b = [[min(h + 1, 7)] + [h] * 9 for h in hard]
    ca, cb = prompt_counts(a), prompt_counts(b)
    (lo_a, hi_a), (lo_b, hi_b) = tau_interval(ca), tau_interval(cb)
    assert min(hi_a, hi_b) - max(lo_a, lo_b) > 0.8 * (hi_a - lo_a)  # separately: no telling
    diff, lo, hi = tau_difference(cb, ca)
    want = sum(t for t, _ in cb) / sum(p for _, p in cb) - sum(t for t, _ in ca) / sum(
        p for _, p in ca
    )
    assert diff == pytest.approx(want) and 0 < lo <= diff <= hi < 0.2
    pick = torch.randint(32, (4000, 32), generator=torch.Generator().manual_seed(0))
    ref = []
    for row in pick.tolist():
        ta = sum(ca[i][0] for i in row) / sum(ca[i][1] for i in row)
        tb = sum(cb[i][0] for i in row) / sum(cb[i][1] for i in row)
        ref.append(tb - ta)
    ref.sort()

    def quantile(q: float) -> float:  # linear between the two nearest order statistics
        pos = q * (len(ref) - 1)
        i = int(pos)
        return ref[i] + (pos - i) * (ref[min(i + 1, len(ref) - 1)] - ref[i])

    assert (lo, hi) == pytest.approx((quantile(0.025), quantile(0.975)), rel=1e-9)
    with pytest.raises(ValueError, match="same prompts"):
        tau_difference(ca, cb[:-1])
