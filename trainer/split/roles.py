"""Which rank does what in a split run: `Roles` from torchrun's environment and
`DFLASH_TARGET_GPUS` (target ranks first), and the default split when that is unset."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from trainer.base.errors import TrainerError
from trainer.settings.config import TrainConfig
from trainer.split.split_rule import default_target_gpus

log = logging.getLogger("trainer")

TARGET, DRAFTER = "target", "drafter"


class DistributedSetupError(TrainerError):
    """The torchrun environment or the role split is not usable."""

    hint = "Set DFLASH_TARGET_GPUS to a number of target ranks between 1 and WORLD_SIZE − 1."


@dataclass(frozen=True, kw_only=True)
class Roles:
    """Who this process is in the split: ranks 0…T−1 targets, T…W−1 drafters."""

    rank: int
    world_size: int
    local_rank: int
    num_targets: int

    def __post_init__(self) -> None:
        if not 1 <= self.num_targets <= self.world_size - 1:
            raise DistributedSetupError(
                f"DFLASH_TARGET_GPUS={self.num_targets} with WORLD_SIZE={self.world_size}: "
                "need at least one target and one drafter rank"
            )

    @property
    def num_drafters(self) -> int:
        return self.world_size - self.num_targets

    @property
    def role(self) -> str:
        return self.role_of(self.rank)

    def role_of(self, rank: int) -> str:
        return TARGET if rank < self.num_targets else DRAFTER

    @property
    def index(self) -> int:
        """Index within the role (target t, drafter d)."""
        return self.rank if self.role == TARGET else self.rank - self.num_targets

    @property
    def target_ranks(self) -> list[int]:
        return list(range(self.num_targets))

    @property
    def drafter_ranks(self) -> list[int]:
        return list(range(self.num_targets, self.world_size))

    def describe(self, rank: int | None = None) -> str:
        """`rank 2 (drafter 1 of 2)`."""
        rank = self.rank if rank is None else rank
        if self.role_of(rank) == TARGET:
            return f"rank {rank} (target {rank} of {self.num_targets})"
        return f"rank {rank} (drafter {rank - self.num_targets} of {self.num_drafters})"


def roles_from_env(
    env: Mapping[str, str] | None = None, *, config: TrainConfig | None = None
) -> Roles | None:
    """The roles of this process under torchrun, or None for a single process (colocated).
    Without `DFLASH_TARGET_GPUS`: the default split of `config`'s model shapes (every rank
    computes the same), ⌊G/2⌋ where no config is given."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    rank = int(env["RANK"])
    raw = env.get("DFLASH_TARGET_GPUS", "")
    if not raw.strip():
        targets = default_split(config, world, announce=rank == 0)
    else:
        try:
            targets = int(raw)
        except ValueError as exc:
            raise DistributedSetupError(f"DFLASH_TARGET_GPUS={raw!r} is not an integer") from exc
    return Roles(
        rank=rank,
        world_size=world,
        local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
        num_targets=targets,
    )


def default_split(config: TrainConfig | None, world: int, *, announce: bool) -> int:
    """Target ranks of `world` when `DFLASH_TARGET_GPUS` is unset: from the roles' model FLOPs
    per token at `config`'s shapes (`trainer.split.split_shapes`), said once when `announce`; with
    no config (no model known) ⌊G/2⌋ (`trainer.split.split_rule.default_target_gpus`)."""
    if config is None:
        return default_target_gpus(world)
    from trainer.split.split_shapes import role_work

    work = role_work(config)
    if announce:
        log.info(f"{work.describe(world)}; DFLASH_TARGET_GPUS ([job] target_gpus) sets another")
    return work.target_gpus(world)
