"""Typed training settings: TOML file + `--set key=value` overrides → one validated `TrainConfig`.

The same tables are read from a standalone TOML (`[model]`, `[data]`, …) or from the `[train]`
table of `deploy.toml` (`[train.model]`, …). Every failure names the dotted key to change.
`model_data_hash` fingerprints the settings a checkpoint depends on, so that resuming a run with a
different model or data layout is refused (see `trainer.model.checkpoint`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.settings.model_config import ModelConfig
from trainer.settings.typed_settings import TrainConfigError
from trainer.settings.typed_settings import (
    diff_settings as diff_settings,  # where callers look for it
)
from trainer.settings.typed_settings import flatten as _flatten
from trainer.settings.typed_settings import positive as _positive

# `run.attention_kernels`: the FlexAttention kernel presets (`trainer.model.attention.kernel_options`)
ATTENTION_KERNELS = ("auto", "large", "small", "flash")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Tokenized samples, how anchors are drawn, and how batches are shaped."""

    path: str = ""  # JSONL of chats ("messages"), text ("text") or tokens ("input_ids")
    batch_size: int = 1  # sequences per step
    micro_batches: int = 1  # the batch trained in this many parts, one optimizer step
    max_len: int = 4096  # longer samples are truncated
    num_anchors: int = 256  # blocks per sequence (padded with invalid blocks)
    bucket: int = 128  # sequence lengths are padded up to a multiple of this
    noise: float = 0.0  # uniform noise in [−noise, noise] added to the target features
    shuffle: bool = True
    pad_token_id: int = 0
    holdout: int = 0  # the last N samples are not trained on (the default eval prompts)
    enable_thinking: bool | None = None  # chat template option; None: the template's default
    system_prompt: str = ""  # chat data: the system message of conversations without one

    def __post_init__(self) -> None:
        _positive("data.batch_size", self.batch_size)
        _positive("data.micro_batches", self.micro_batches)
        if self.micro_batches > self.batch_size:
            raise TrainConfigError(
                "data.micro_batches",
                f"{self.micro_batches} parts of a batch of {self.batch_size} sequences: a part "
                "is one sequence or more; lower it or raise data.batch_size",
            )
        _positive("data.max_len", self.max_len)
        _positive("data.num_anchors", self.num_anchors)
        _positive("data.bucket", self.bucket)
        if self.noise < 0:
            raise TrainConfigError("data.noise", f"must be ≥ 0, got {self.noise}")
        if self.holdout < 0:
            raise TrainConfigError("data.holdout", "must be ≥ 0")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay to `min_lr_ratio · lr`."""

    lr: float = 6e-4
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise TrainConfigError("optim.lr", f"must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise TrainConfigError("optim.warmup_steps", "must be ≥ 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise TrainConfigError("optim.min_lr_ratio", "must be in [0, 1]")
        if self.grad_clip < 0:
            raise TrainConfigError("optim.grad_clip", "must be ≥ 0 (0 disables)")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise TrainConfigError(f"optim.{key}", "must be in [0, 1)")


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """Weights of the DFlash loss terms (see `trainer.loss.dflash_loss.dflash_loss`)."""

    gamma: float | None = (
        None  # slot decay; None: 7 for B = 16, 10 for B = 10 (the seed), else B·7/16
    )
    kl_weight: float = 0.15  # share of the KL term toward the target's own distribution
    cap_weight: float = 0.0  # weight of the cumulative-acceptance term

    def __post_init__(self) -> None:
        if self.gamma is not None and self.gamma <= 0:
            raise TrainConfigError("loss.gamma", f"must be > 0, got {self.gamma}")
        if not 0 <= self.kl_weight <= 1:
            raise TrainConfigError("loss.kl_weight", "must be in [0, 1]")
        if self.cap_weight < 0:
            raise TrainConfigError("loss.cap_weight", "must be ≥ 0")

    def resolved_gamma(self, block_size: int) -> float:
        """γ for this block size: the explicit value, else the published/seed default."""
        if self.gamma is not None:
            return float(self.gamma)
        return {16: 7.0, 10: 10.0}.get(block_size, block_size * 7.0 / 16.0)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Length of the run, logging, checkpoints, device."""

    steps: int = 1000
    seed: int = 0
    log_every: int = 1
    checkpoint_every: int = 500  # 0: only at the end
    keep_last: int = 3
    device: str = "auto"  # "auto" (cuda if available), "cpu", "cuda", "cuda:N"
    threads: int = 0  # torch CPU threads; 0 leaves torch's default
    compile: bool | None = None  # compile the drafter's layers; None: on CUDA only
    # compile the target's training forward; None: on CUDA, but for linear-attention targets
    compile_target: bool | None = None
    # FlexAttention kernels: "auto" (tiles by the GPU's shared memory), "large", "small" (~100 KiB
    # GPUs), "flash" (the CuTe-DSL backend of flash-attn-4, Hopper and newer, when installed)
    attention_kernels: str = "auto"
    # keep each drafter layer's inputs only and run the layer again in the backward: its
    # activations live one layer at a time, for one more forward of the layers
    recompute_layers: bool = False
    tensorboard: bool = True  # event files in <out>/tensorboard (when tensorboard is installed)
    extend: bool = False  # resume even though the lr schedule changed (e.g. run.steps raised)
    profile_steps: int = 0  # record this many steps with torch.profiler into <out>/profile; 0: off
    profile_start: int = 20  # … the steps after this one (past the first steps' compiles)

    def compiles_on(self, device: Any) -> bool:
        """Whether the drafter's layers are compiled on `device` (a torch.device)."""
        return device.type == "cuda" if self.compile is None else self.compile

    def compiles_target_on(self, device: Any, *, linear_attention: bool = False) -> bool:
        """Whether the target's training forward is compiled on `device` (a torch.device).
        Unset: on CUDA, except for a target with linear-attention layers, whose reference
        implementation compiles to a graph unrolled over its sequence (`trainer.model.linear_attention`).
        """
        if self.compile_target is not None:
            return self.compile_target
        return device.type == "cuda" and not linear_attention

    def __post_init__(self) -> None:
        _positive("run.steps", self.steps)
        _positive("run.log_every", self.log_every)
        if self.checkpoint_every < 0:
            raise TrainConfigError("run.checkpoint_every", "must be ≥ 0")
        _positive("run.keep_last", self.keep_last)
        if self.threads < 0:
            raise TrainConfigError("run.threads", "must be ≥ 0")
        for key in ("profile_steps", "profile_start"):
            if getattr(self, key) < 0:
                raise TrainConfigError(f"run.{key}", "must be ≥ 0")
        if self.attention_kernels not in ATTENTION_KERNELS:
            raise TrainConfigError(
                "run.attention_kernels",
                f"'{self.attention_kernels}' is not {', '.join(ATTENTION_KERNELS[:-1])} or "
                f"{ATTENTION_KERNELS[-1]}",
            )
        if self.device != "auto" and not (
            self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")
        ):
            raise TrainConfigError(
                "run.device", f"'{self.device}' is not auto, cpu, cuda or cuda:N"
            )


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """τ measured by speculative decoding during training (see `trainer.evaluation.evaluate`)."""

    every: int = 0  # evaluate every N steps; 0: never
    prompts: str = ""  # JSONL of prompts (training formats); "": the data.holdout samples
    num_prompts: int = 8  # the first N prompts are used
    max_new_tokens: int = 32
    train_prompts: int = 8  # also τ on N prompts of the training samples; 0: not measured
    baseline: str = "prompt-lookup"  # τ of this drafter on the held-out prompts too; or "none"
    lookup_max_n: int = 4  # prompt lookup tries n-grams from max_n down to min_n
    lookup_min_n: int = 1
    memorise_ratio: float = 1.25  # warn when training-prompt τ > ratio × held-out τ; 0: never
    memorise_margin: float = 0.5  # … and held-out τ < prompt lookup's τ + margin

    def __post_init__(self) -> None:
        if self.every < 0:
            raise TrainConfigError("eval.every", "must be ≥ 0 (0 disables)")
        _positive("eval.num_prompts", self.num_prompts)
        _positive("eval.max_new_tokens", self.max_new_tokens)
        if self.train_prompts < 0:
            raise TrainConfigError("eval.train_prompts", "must be ≥ 0 (0: not measured)")
        if self.baseline not in ("prompt-lookup", "none"):
            raise TrainConfigError(
                "eval.baseline", f'\'{self.baseline}\' is not "prompt-lookup" or "none"'
            )
        if not 1 <= self.lookup_min_n <= self.lookup_max_n:
            raise TrainConfigError("eval.lookup_min_n", "need 1 ≤ lookup_min_n ≤ lookup_max_n")
        if self.memorise_ratio != 0 and self.memorise_ratio <= 1:
            raise TrainConfigError("eval.memorise_ratio", "must be > 1 (0: never warn)")
        if self.memorise_margin < 0:
            raise TrainConfigError("eval.memorise_margin", "must be ≥ 0")


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """`enabled = true`: build a tiny random target and data it generated itself, then train on it.

    The assets go to `folder` (default `<out>/../demo-assets`) and are reused when complete; the
    run's `model.target` and `data.path` then point at them.
    """

    enabled: bool = False
    folder: str = ""
    seed: int = 0
    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 6
    # heads 32 wide (hidden 64 / 2 heads): the narrowest that vLLM's CPU attention takes (32, 64,
    # 80, …; `make serve-test` serves the demo with it), at the attention cost of 4 × 16
    num_heads: int = 2
    num_kv_heads: int = 1
    intermediate_size: int = 128
    init_std: float = (
        0.06  # a bit above the usual 0.02: greedy output with context-dependent cycles
    )
    num_samples: int = 256
    prompt_len: int = 8
    gen_len: int = 56

    def __post_init__(self) -> None:
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            _positive(f"demo.{key}", getattr(self, key))
        for key in ("intermediate_size", "num_samples", "prompt_len", "gen_len"):
            _positive(f"demo.{key}", getattr(self, key))
        if self.hidden_size % self.num_heads:
            raise TrainConfigError("demo.hidden_size", "must be a multiple of demo.num_heads")
        if self.num_heads % self.num_kv_heads:
            raise TrainConfigError("demo.num_kv_heads", "must divide demo.num_heads")


@dataclass(frozen=True, kw_only=True)
class SplitConfig:
    """How the ranks of a target/drafter split wait for each other (`trainer.split.distributed`,
    `trainer.split.exchange`); a single-process run ignores it."""

    timeout_s: float = 1800.0  # any single wait, and the process groups' timeout
    heartbeat_timeout_s: float = 60.0  # a peer whose heartbeat stands still this long has failed
    max_in_flight: int = 2  # batches a target rank produced that no drafter has taken yet

    def __post_init__(self) -> None:
        for key in ("timeout_s", "heartbeat_timeout_s"):
            if getattr(self, key) <= 0:
                raise TrainConfigError(f"split.{key}", f"must be > 0, got {getattr(self, key)}")
        _positive("split.max_in_flight", self.max_in_flight)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    run: RunConfig = field(default_factory=RunConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    split: SplitConfig = field(default_factory=SplitConfig)

    def __post_init__(self) -> None:
        if not self.demo.enabled:
            if not self.model.target:
                raise TrainConfigError("model.target", "set the target's local folder")
            if not self.data.path:
                raise TrainConfigError(
                    "data.path", "set the training data file (chat, text or tokenized JSONL)"
                )
        if self.data.max_len <= self.model.block_size:
            raise TrainConfigError("data.max_len", "must exceed model.block_size")
        if self.eval.every and not self.eval.prompts and not self.data.holdout:
            raise TrainConfigError("eval.prompts", "set it, or data.holdout, when eval.every > 0")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def model_data_settings(self) -> dict[str, Any]:
        """The settings a checkpoint is tied to (flat dotted keys). Paths are kept by name only
        so that moving the run folder does not invalidate it."""
        flat = _flatten(
            {"model": dataclasses.asdict(self.model), "data": dataclasses.asdict(self.data)}
        )
        for key in ("model.target", "data.path"):
            flat[key] = Path(str(flat[key])).name
        for key, default in _ADDED_LATER.items():  # checkpoints written before them still match
            if flat.get(key) == default:
                del flat[key]
        for key in _STARTING_WEIGHTS:  # a checkpoint's weights replace them on resume
            flat.pop(key, None)
        for key in _HOW_NOT_WHAT:  # the same step computed otherwise: free on resume
            flat.pop(key, None)
        return flat

    def schedule_settings(self) -> dict[str, Any]:
        """The settings the learning rate of every step depends on (warmup + cosine over
        `run.steps`): changing one on resume changes the lr from the next step on."""
        o = self.optim
        return {
            "run.steps": self.run.steps,
            "optim.lr": o.lr,
            "optim.warmup_steps": o.warmup_steps,
            "optim.min_lr_ratio": o.min_lr_ratio,
        }

    def flat(self) -> dict[str, Any]:
        """Every setting as flat dotted keys."""
        return _flatten(self.to_dict())

    def model_data_hash(self) -> str:
        blob = json.dumps(self.model_data_settings(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# Model/data keys added after checkpoints were written without them: left out of the settings a
# checkpoint is tied to while they keep their default, so those checkpoints still resume.
_ADDED_LATER: dict[str, Any] = {
    "data.enable_thinking": None,
    "data.system_prompt": "",
    "model.intermediate_size": None,
    "model.num_kv_heads": None,
    "model.num_heads": None,
    "model.head_dim": None,
}
# Keys that only choose the weights of step 0: a resumed run may change them.
_STARTING_WEIGHTS = ("model.init_layers",)
# Keys that change how a step is computed, not the step: a resumed run may change them (e.g.
# more parts after running out of memory).
_HOW_NOT_WHAT = ("data.micro_batches",)

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "loss": LossConfig,
    "run": RunConfig,
    "demo": DemoConfig,
    "eval": EvalConfig,
    "split": SplitConfig,
}
