"""The two roles of a training step: the target worker produces features, the drafter worker
trains on them.

`TargetWorker.produce(batch) -> Features` (`trainer.run.target_worker`) runs the frozen target;
`DrafterWorker.train_step(features, step)` runs the drafter, the loss and one optimizer step (over the batch's parts in
turn with `data.micro_batches`: `trainer.loss.micro_batches`). `Features` is everything that
crosses between them — the selected hidden states, the target's last hidden state (for the KL
term: the frozen lm_head is applied on the drafter's side, so no vocabulary-wide logits ever
travel), token ids, anchors, validity and labels — so that the roles can later live on different
ranks and exchange `Features` point to point. Here they run colocated in one process.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from trainer.base.errors import TrainerError
from trainer.data.dataset import uniform_noise
from trainer.loss.dflash_loss import LossNorms, LossOutput, dflash_loss, loss_norms
from trainer.loss.micro_batches import combine, part_rows
from trainer.model.drafter import Drafter, DrafterShape, shape_from_target
from trainer.model.target import Target
from trainer.run.target_worker import Features
from trainer.settings.config import LossConfig, OptimConfig, TrainConfig


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float
    ce: float
    kl: float
    cap: float
    slot_accuracy: list[float]  # per slot k ≥ 1 (NaN when a slot had no label)
    lr: float
    grad_norm: float
    tokens: int
    seconds: float


@dataclass(frozen=True)
class PendingStep:
    """A step whose kernels are queued; `result()` waits for them (the step's one device
    sync) and reads its figures."""

    step: int
    values: Tensor  # loss, ce, kl, cap, grad_norm
    slot_accuracy: Tensor  # slots k ≥ 1
    lr: float
    tokens: int
    start: float  # perf_counter when the step began

    def result(self) -> StepResult:
        loss, ce, kl, cap, grad_norm = self.values.tolist()
        return StepResult(
            step=self.step,
            loss=loss,
            ce=ce,
            kl=kl,
            cap=cap,
            slot_accuracy=self.slot_accuracy.tolist(),
            lr=self.lr,
            grad_norm=grad_norm,
            tokens=self.tokens,
            seconds=time.perf_counter() - self.start,
        )


def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Multiplier of the base lr at `step` (0-based): linear warmup, then cosine to min_lr_ratio."""
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    span = max(1, total_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / span)
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def target_hidden_for_blocks(last_hidden: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """The target's hidden state that predicts the token of slot k: position anchor+k−1.

    last_hidden (Bsz, S, H), anchors (Bsz, N) → (Bsz, N, B, H) (slot 0 reads anchor−1, clamped;
    it carries no loss)."""
    bsz, seq, h = last_hidden.shape
    pos = anchors[:, :, None] + torch.arange(block_size, device=anchors.device) - 1  # (Bsz, N, B)
    pos = pos.clamp(0, seq - 1).reshape(bsz, -1)
    return last_hidden.gather(1, pos[..., None].expand(-1, -1, h)).reshape(
        bsz, *anchors.shape[1:], block_size, h
    )


class DrafterWorker:
    """Owns the drafter, its optimizer and schedule; one call = one training step."""

    def __init__(
        self,
        drafter: Drafter,
        *,
        embed_weight: Tensor,
        lm_head_weight: Tensor,
        optim: OptimConfig,
        loss: LossConfig,
        total_steps: int,
        noise: float = 0.0,
        seed: int = 0,
        loss_chunk_rows: int | None = None,
        compile_layers: bool = False,
        micro_batches: int = 1,
    ) -> None:
        if compile_layers:
            drafter.compile_layers()
        self.compiled = compile_layers
        self.drafter = drafter
        self.module: torch.nn.Module = (
            drafter  # what the forward calls: the drafter or its DDP wrapper
        )
        self.embed_weight = embed_weight.detach()
        self.lm_head_weight = lm_head_weight.detach()
        self.loss_config = loss
        self.gamma = loss.resolved_gamma(drafter.shape.block_size)
        self.noise = noise
        self.loss_chunk_rows = loss_chunk_rows  # None: sized from the vocabulary by the loss
        self.seed = seed
        self.micro_batches = micro_batches
        self.optim_config = optim
        decay = [p for p in drafter.parameters() if p.dim() >= 2]
        no_decay = [p for p in drafter.parameters() if p.dim() < 2]
        device = next(drafter.parameters()).device
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": optim.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=optim.lr,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            fused=device.type == "cuda",
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_at(s, optim, total_steps)
        )
        self.device = device

    @classmethod
    def for_target(cls, target: Target, config: TrainConfig, device: torch.device) -> DrafterWorker:
        """A new drafter shaped after `target` on `device`, sharing its frozen embedding and
        lm_head (copied to `device` when the target lives elsewhere), trained per `config`.
        Seed the global generator first: it initialises the drafter's weights (those that
        `model.init_layers` does not take from the target)."""
        shape = shape_from_target(target.config, config.model, num_features=len(target.layers))
        layers = config.model.init_layers
        return cls.for_config(
            shape,
            config,
            device,
            embed_weight=target.embed_weight,
            lm_head_weight=target.lm_head_weight,
            starting_weights=target.starting_weights(layers) if layers else None,
        )

    @classmethod
    def for_config(
        cls,
        shape: DrafterShape,
        config: TrainConfig,
        device: torch.device,
        *,
        embed_weight: Tensor,
        lm_head_weight: Tensor,
        starting_weights: Mapping[str, Tensor] | None = None,
    ) -> DrafterWorker:
        """A new drafter of `shape` on `device` with the frozen embedding and lm_head (moved to
        `device`), its optimizer, schedule, noise and compile taken from `config`; its layers
        start from `starting_weights` when given (`Target.starting_weights`)."""
        drafter = Drafter(
            shape,
            attention_kernels=config.run.attention_kernels,
            recompute_layers=config.run.recompute_layers,
        ).to(device)
        if starting_weights is not None:
            drafter.start_from(starting_weights)
        return cls(
            drafter,
            embed_weight=embed_weight.to(device),
            lm_head_weight=lm_head_weight.to(device),
            optim=config.optim,
            loss=config.loss,
            total_steps=config.run.steps,
            noise=config.data.noise,
            seed=config.run.seed,
            compile_layers=config.run.compiles_on(device),
            micro_batches=config.data.micro_batches,
        )

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    def train_step(self, features: Features, step: int) -> StepResult:
        """Forward and backward over the batch (in `micro_batches` parts of whole sequences,
        gradients accumulated), then one optimizer step; waits for it."""
        return self.launch_step(features, step).result()

    def launch_step(self, features: Features, step: int) -> PendingStep:
        """`train_step` without the wait: the step's kernels are queued and the host is free
        (to draw the next batch, say) until `PendingStep.result()` reads the figures."""
        start = time.perf_counter()
        f = features
        hidden = f.hidden
        if self.noise > 0:
            hidden = hidden + uniform_noise(
                hidden.shape,
                scale=self.noise,
                seed=self.seed,
                step=step,
                device=hidden.device,
                dtype=hidden.dtype,
            )
        self.drafter.train()
        parts = part_rows(hidden.shape[0], self.micro_batches)
        b = self.drafter.shape.block_size
        # one part: the loss's own normalisers; several: the whole batch's, so that they add up
        norms = (
            None
            if len(parts) == 1
            else loss_norms(self._plan_labels(f).reshape(-1, b), self.gamma, hidden.dtype)
        )
        outputs = []
        for i, rows in enumerate(parts):
            with self._gradient_sync(last=i == len(parts) - 1):
                output = self._part_loss(hidden[rows], f, rows, norms)
                output.loss.backward()
            outputs.append(output)
        result = combine(outputs, [f.labels[rows] for rows in parts])
        clip = self.optim_config.grad_clip
        params = list(self.drafter.parameters())
        if clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            grad_norm = torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in params if p.grad is not None])
            )
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        values = torch.stack([result.loss.detach(), result.ce, result.kl, result.cap, grad_norm])
        return PendingStep(
            step=step,
            values=values,
            slot_accuracy=result.slot_accuracy[1:],
            lr=lr,
            tokens=f.num_tokens,
            start=start,
        )

    @staticmethod
    def _plan_labels(f: Features) -> Tensor:
        """The labels the loss plans from: the host's copy when there is one (no device sync)."""
        return f.labels if f.host_labels is None else f.host_labels

    def _part_loss(
        self, hidden: Tensor, f: Features, rows: slice, norms: LossNorms | None
    ) -> LossOutput:
        """The drafter's forward and the loss on the sequences `rows` of the batch."""
        b = self.drafter.shape.block_size
        with self._autocast():
            out = self.module(
                hidden, f.input_ids[rows], f.anchors[rows], f.valid[rows], self.embed_weight
            )  # (rows, N, B, H)
        target_hidden = None
        if self.loss_config.kl_weight > 0:
            target_hidden = target_hidden_for_blocks(f.last_hidden[rows], f.anchors[rows], b)
            target_hidden = target_hidden.reshape(-1, b, out.shape[-1]).to(out.dtype)
        return dflash_loss(
            out.reshape(-1, b, out.shape[-1]),
            self.lm_head_weight,
            self._plan_labels(f)[rows].reshape(-1, b),
            gamma=self.gamma,
            target_hidden=target_hidden,
            kl_weight=self.loss_config.kl_weight,
            cap_weight=self.loss_config.cap_weight,
            chunk_rows=self.loss_chunk_rows,
            norms=norms,
        )

    def _gradient_sync(self, *, last: bool) -> AbstractContextManager[None]:
        """DDP all-reduces the gradients after the batch's last part only."""
        if last or not isinstance(self.module, DistributedDataParallel):
            return nullcontext()
        return self.module.no_sync()

    def state_dict(self) -> dict:
        return {
            "drafter": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        missing, unexpected = self.drafter.load_state_dict(state["drafter"], strict=False)
        if missing or unexpected:  # e.g. a format-1 drafter: no q/k norm or o_proj bias
            raise TrainerError(
                f"the checkpoint's drafter has other tensors than this trainer builds (missing "
                f"{missing[:3]}, unexpected {unexpected[:3]}): it was trained by an earlier "
                "trainer, whose layers differ from the ones the engines serve",
                hint="Train from scratch into a new run folder (dflash deploy without --resume).",
            )
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
