"""The drafter's shape (`[model]` of the training settings): its layers, heads and MLP, or the
target's where a key is unset, and the rules that tie them to the target's (`kv_head_choices`).
Part of `TrainConfig` (`trainer.settings.config`), which reads and validates the whole file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.settings.typed_settings import TrainConfigError
from trainer.settings.typed_settings import positive as _positive


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The drafter and the target it is trained against."""

    target: str = ""  # local folder of the target (save_pretrained layout); never a hub id
    num_layers: int = 5  # drafter decoder layers
    intermediate_size: int | None = None  # the drafter's MLP width; None: the target's
    num_kv_heads: int | None = None  # the drafter's key/value heads; None: the target's
    num_heads: int | None = None  # the drafter's attention (query) heads; None: the target's
    head_dim: int | None = None  # the drafter's head dimension; None: the target's
    block_size: int = 16  # B: [x_p, MASK × (B−1)]
    mask_token_id: int | None = None  # None: the target config's pad_token_id, else vocab_size − 1
    target_layers: list[int] | None = None  # 0-based decoder layers; None: spread from 1 to L−3
    num_target_layers: int = 5  # how many layers are spread when target_layers is None
    # W of windowed layers: slot k at anchor a sees positions a + k − (W − 1) … a + k (as served)
    sliding_window: int | None = None
    sliding_layers: list[int] = field(default_factory=list)  # drafter layers using the window
    sliding_causal: bool = True  # windowed layers are causal inside the block (as served)
    # target layers whose weights start the drafter's layers, one per drafter layer (and the
    # target's final norm starts the drafter's); None: random weights
    init_layers: list[int] | None = None

    def __post_init__(self) -> None:
        _positive("model.num_layers", self.num_layers)
        if self.intermediate_size is not None:
            _positive("model.intermediate_size", self.intermediate_size)
        for key in ("num_kv_heads", "num_heads", "head_dim"):
            if getattr(self, key) is not None:
                _positive(f"model.{key}", getattr(self, key))
        starts = self.init_layers
        if starts is not None and (len(starts) != self.num_layers or min(starts) < 0):
            raise TrainConfigError(
                "model.init_layers",
                f"{starts}: one target layer index (≥ 0) per drafter layer "
                f"({self.num_layers}, model.num_layers), e.g. {list(range(self.num_layers))}",
            )
        if self.block_size < 2:
            raise TrainConfigError("model.block_size", f"must be ≥ 2, got {self.block_size}")
        _positive("model.num_target_layers", self.num_target_layers)
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise TrainConfigError("model.mask_token_id", "must be ≥ 0")
        if self.target_layers is not None:
            if not self.target_layers:
                raise TrainConfigError("model.target_layers", "must not be empty")
            if any(i < 0 for i in self.target_layers):
                raise TrainConfigError("model.target_layers", "layer indices are ≥ 0")
        if self.sliding_window is not None:
            _positive("model.sliding_window", self.sliding_window)
        bad = [i for i in self.sliding_layers if not 0 <= i < self.num_layers]
        if bad:
            raise TrainConfigError(
                "model.sliding_layers", f"{bad} outside 0…{self.num_layers - 1} (model.num_layers)"
            )
        if not self.sliding_causal:
            raise TrainConfigError(
                "model.sliding_causal",
                "false is not served: SGLang and vLLM run sliding-window layers causal inside "
                "the block; remove the key",
            )
        if self.sliding_layers and self.sliding_window is None:
            raise TrainConfigError(
                "model.sliding_window", "set it when model.sliding_layers is set"
            )

    def attention_heads(self, target_heads: int, target_kv_heads: int) -> tuple[int, int]:
        """The drafter's (query heads, key/value heads): `num_heads` and `num_kv_heads` where
        set, else the target's; key/value heads that do not divide the heads are refused with
        the choices, naming the key to change."""
        heads = self.num_heads or target_heads
        whose = "the drafter's" if self.num_heads else "the target's"
        if choices := self.kv_head_choices(heads):
            raise TrainConfigError(
                "model.num_kv_heads",
                f"{self.num_kv_heads} does not divide {whose} {heads} attention heads: pick one "
                f"of {', '.join(map(str, choices))}, or leave it unset (the target's)",
            )
        kv_heads = self.num_kv_heads or target_kv_heads
        if heads % kv_heads:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            raise TrainConfigError(
                "model.num_kv_heads",
                f"the target's {kv_heads} key/value heads do not divide model.num_heads = {heads}: "
                f"set model.num_kv_heads to one of {', '.join(map(str, divisors))}",
            )
        return heads, kv_heads

    def kv_head_choices(self, heads: int) -> list[int]:
        """The key/value head counts a drafter of `heads` attention heads may have, when
        `num_kv_heads` is set to another (empty when it is unset or one of them)."""
        if self.num_kv_heads is None or heads % self.num_kv_heads == 0:
            return []
        return [d for d in range(1, heads + 1) if heads % d == 0]
