"""What a draft costs beside a target forward: the weights each reads, counted by hand from the
shapes, and the speed-up over plain decoding once every draft is paid for."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from tests.trainer.demo_target import demo_target
from trainer.evaluation.draft_cost import draft_cost, net_speedup
from trainer.evaluation.drafters import DFlashDrafter
from trainer.evaluation.prompt_lookup import PromptLookupDrafter
from trainer.evaluation.report import EvalReport, evaluate
from trainer.model.drafter import Drafter, shape_from_target
from trainer.model.target import Target
from trainer.settings.config import ModelConfig

H, HEADS, KV, HEAD_DIM, MLP, VOCAB = 64, 4, 2, 16, 96, 300


def qwen3_layer(kv: int = KV, mlp: int = MLP) -> int:
    """One Qwen3 decoder layer's parameters: q, k, v, o, the q/k norms, the MLP, two norms."""
    attention = H * HEADS * HEAD_DIM + 2 * H * kv * HEAD_DIM + HEADS * HEAD_DIM * H
    return attention + 2 * HEAD_DIM + 3 * H * mlp + 2 * H


def small_target(*, tied: bool) -> Target:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=H, num_hidden_layers=3, num_attention_heads=HEADS,
        num_key_value_heads=KV, head_dim=HEAD_DIM, intermediate_size=MLP,
        tie_word_embeddings=tied,
    )  # fmt: skip
    return Target(Qwen3ForCausalLM(config), [0, 1])


@pytest.mark.parametrize("tied", [True, False])
def test_a_target_forward_reads_every_weight_but_the_embedding_table(tied: bool) -> None:
    """Its layers, final norm and lm_head; the embedding table only where it is the lm_head."""
    assert small_target(tied=tied).weights_read() == 3 * qwen3_layer() + H + VOCAB * H


def test_a_draft_reads_the_drafters_own_weights_and_the_lm_head() -> None:
    target = small_target(tied=False)
    model = ModelConfig(num_layers=2, block_size=4, num_kv_heads=4, intermediate_size=128)
    drafter = DFlashDrafter(
        Drafter(shape_from_target(target.config, model, num_features=2)),
        embed_weight=target.embed_weight,
        lm_head_weight=target.lm_head_weight,
    )
    own = 2 * qwen3_layer(kv=4, mlp=128) + 2 * H * H + H + H  # layers, fc, hidden_norm, norm
    assert drafter.weights_read() == own + VOCAB * H
    reads = 3 * qwen3_layer() + H + VOCAB * H
    assert draft_cost(target, drafter) == pytest.approx((own + VOCAB * H) / reads, rel=1e-12)
    assert draft_cost(target, PromptLookupDrafter(4)) == 0.0
    assert draft_cost(target, object()) is None  # a drafter that does not say


def test_net_speedup_counts_each_draft_at_its_cost() -> None:
    # 12 tokens in 4 target forwards (a prefill, 3 verify passes after 3 drafts)
    assert net_speedup(12, 4, 3, 0.5) == pytest.approx(12 / 5.5)
    assert net_speedup(12, 4, 3, 0.0) == 3.0


def test_the_report_pays_for_the_drafts(tmp_path_factory: pytest.TempPathFactory) -> None:
    target = demo_target(tmp_path_factory)
    torch.manual_seed(0)
    shape = shape_from_target(
        target.config, ModelConfig(num_layers=1, block_size=4), num_features=len(target.layers)
    )
    drafter = DFlashDrafter(
        Drafter(shape), embed_weight=target.embed_weight, lm_head_weight=target.lm_head_weight
    )
    prompts = torch.randint(0, 256, (3, 6), generator=torch.Generator().manual_seed(1)).tolist()
    report = evaluate(target, drafter, prompts, max_new_tokens=12)
    cost = draft_cost(target, drafter)
    assert cost is not None and 0 < cost < 1 and report.draft_cost == cost
    paid = report.target_forwards + cost * report.verify_forwards
    assert report.net_speedup == pytest.approx(report.new_tokens / paid, rel=1e-12)
    assert report.net_speedup < report.speedup
    assert f"x{report.net_speedup:.2f} with drafts at {cost:.2f} of a forward" in report.summary()
    assert EvalReport.from_dict(asdict(report)) == report

    lookup = evaluate(target, PromptLookupDrafter(4), prompts, max_new_tokens=12)
    assert lookup.draft_cost == 0.0 and lookup.net_speedup == lookup.speedup
    assert "with drafts" not in lookup.summary()  # drafting from the text costs no forward


def test_a_report_written_before_the_cost_was_counted_still_reads() -> None:
    old = {"tau": 2.0, "slot_acceptance": [0.5], "block_size": 2, "prompts": 1,
           "new_tokens": 4, "verify_forwards": 2, "target_forwards": 3, "plain_forwards": 4,
           "speedup": 4 / 3, "lossless_checked": True}  # fmt: skip
    report = EvalReport.from_dict(old)
    assert report.draft_cost is None and report.net_speedup is None
    assert "with drafts" not in report.summary()
