"""The default split of a node: how many of its G GPUs (ranks) run the frozen target.

One rule for everything that needs a default: the trainer when `DFLASH_TARGET_GPUS` is unset,
`dflash init` when it writes `[job] target_gpus`, and `trainer.plan`'s report (beside the best
split it measured). Plain arithmetic without torch, so that `dflash_ops` can import it.

Why half: a split of T targets and D = G − T drafters trains at min(T·r_target, D·r_drafter)
(`trainer.plan.predict`), so the best T is near G·r_d/(r_t + r_d). The two rates measured on
H200s with a Qwen3-8B-shaped target are close (bench/results/split/), which puts the best T a
little under G/2: ⌊G/2⌋ (the target, the faster side, gets the smaller half of an odd G) is the
best or near it at those rates, where the ≈ 0.6·G it replaced was far off
(tests/trainer/test_plan.py checks both). `dflash plan` measures the best split for a model.
"""

from __future__ import annotations


def default_target_gpus(gpus: int) -> int:
    """Target GPUs (ranks) out of `gpus`: ⌊G/2⌋, so at least one of each role from G = 2 on;
    0 (target and drafter colocated on one device) for 0 or 1 GPU."""
    return gpus // 2 if gpus >= 2 else 0
