"""The split of a node: how many of its G GPUs (ranks) run the frozen target, T of them, with
D = G − T training the drafter. Plain arithmetic, without torch.

A split trains no faster than its slower side: min(T·r_target, D·r_drafter) tokens/s, r being
one rank's rate (`predict_splits`). The best split of given rates is the fastest of those
(`best_split`); the rates are either measured (`trainer.commands.plan`) or, before anything is measured,
taken as the inverse of each role's model FLOPs per token (`target_gpus_for_work`, with the
FLOPs of `trainer.split.split_shapes`): the default the trainer runs when `DFLASH_TARGET_GPUS` is
unset, and `trainer.commands.plan` marks beside the best split it measured.

Where no model is known (no training config: `roles_from_env` alone) the default is ⌊G/2⌋
(`default_target_gpus`): the best split when the two roles cost the same per token, the case
the two are closest to on a Qwen3-8B-shaped target (bench/results/split/). A target whose
forward costs several times the drafter's step (a Qwen3.6-27B-shaped one,
bench/results/seed-size/) wants far more target ranks than that.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Split:
    targets: int
    drafters: int
    tokens_per_s: float
    bound_by: str  # "target" | "drafter"


def predict_splits(r_target: float, r_drafter: float, gpus: int) -> list[Split]:
    """Every split T + D = gpus with T, D ≥ 1, predicted tokens/s = min(T·r_t, D·r_d)."""
    out = []
    for t in range(1, gpus):
        d = gpus - t
        tt, dd = t * r_target, d * r_drafter
        out.append(
            Split(
                targets=t,
                drafters=d,
                tokens_per_s=min(tt, dd),
                bound_by="target" if tt < dd else "drafter",
            )
        )
    return out


def best_split(splits: list[Split]) -> Split | None:
    """The fastest split; of equally fast ones the one with the fewest targets: each target rank
    loads its own copy of the whole target (start-up time, host memory), and for two roles of
    equal cost on an odd G this is ⌊G/2⌋, the no-model default."""
    return max(splits, key=lambda s: s.tokens_per_s) if splits else None  # max keeps the first


def default_target_gpus(gpus: int) -> int:
    """Target GPUs (ranks) out of `gpus` where no model is known: ⌊G/2⌋, so at least one of each
    role from G = 2 on; 0 (target and drafter colocated on one device) for 0 or 1 GPU."""
    return gpus // 2 if gpus >= 2 else 0


def target_gpus_for_work(gpus: int, target_flops: float, drafter_flops: float) -> int:
    """Target GPUs (ranks) out of `gpus` from each role's work per token (any one unit, e.g.
    model FLOPs per context token): the best split of rates ∝ 1/work; 0 for 0 or 1 GPU."""
    if target_flops <= 0 or drafter_flops <= 0:
        raise ValueError(f"work per token must be > 0, got {target_flops}, {drafter_flops}")
    best = best_split(predict_splits(1.0 / target_flops, 1.0 / drafter_flops, gpus))
    return best.targets if best else default_target_gpus(gpus)
