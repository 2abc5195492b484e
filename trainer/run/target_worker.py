"""The target's side of a training step: `TargetWorker.produce(batch) -> Features` runs the
frozen target, and `Features` is everything that crosses to the drafter's side (the selected
hidden states, the last hidden state for the KL term, token ids, anchors, validity, labels:
never vocabulary-wide logits), in one process or point to point between ranks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from trainer.base.errors import TargetCompileFailed
from trainer.data.dataset import Batch
from trainer.model.attention import compile_errors_as_typed, fail_instead_of_eager_fallback
from trainer.model.linear_attention import has_linear_attention
from trainer.model.target import Target, TargetOutput
from trainer.settings.config import TrainConfig


def compile_note(*, drafter: bool, target: bool) -> str | None:
    """The log's line on what the first steps compile (None: nothing is compiled)."""
    parts = [
        *(["drafter layers (run.compile)"] if drafter else []),
        *(["the target's forward (run.compile_target)"] if target else []),
    ]
    if not parts:
        return None
    return (
        f"compiled: {' and '.join(parts)}; the first step of each new batch shape compiles "
        "them, minutes on a GPU; compiled kernels are cached on disk for the next run"
    )


@dataclass
class Features:
    hidden: Tensor  # (Bsz, S, n·H) selected target layers, concatenated
    last_hidden: Tensor  # (Bsz, S, H) the target's final normed hidden state
    input_ids: Tensor  # (Bsz, S) long
    anchors: Tensor  # (Bsz, N) long
    valid: Tensor  # (Bsz, N) bool
    labels: Tensor  # (Bsz, N, B) long
    num_tokens: int  # real (unpadded) tokens in the batch
    # the labels on the CPU when the batch came from there: the loss plans its chunks from them
    # without waiting for the device (None: it reads `labels`)
    host_labels: Tensor | None = None

    def tensors(self) -> dict[str, Tensor]:
        host = ("num_tokens", "host_labels")
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in host}

    def to(self, device: torch.device | str) -> Features:
        return Features(
            **{k: v.to(device) for k, v in self.tensors().items()},
            num_tokens=self.num_tokens,
            host_labels=self.host_labels,
        )


class TargetWorker:
    """Runs the frozen target over training batches.

    `compiled` runs the target's forward through `torch.compile` (`run.compile_target`): eager,
    every RMSNorm, RoPE, SwiGLU and residual add of the target is its own pass over the batch
    and its own kernel launch; compiled, they fuse around the matmuls. Only this worker's
    forward is compiled: the τ probe and evaluation call the target eagerly, at shapes that
    change every call. `options` go to `torch.compile` (the CPU tests pick a backend that needs
    no C++ compiler); past dynamo's recompile limit `produce` raises `CompileCacheFull`.
    """

    def __init__(self, target: Target, *, compiled: bool = False, **options: Any) -> None:
        self.target = target
        self.compiled = compiled
        self._forward: Callable[[Tensor], TargetOutput] = target.forward
        if compiled:
            fail_instead_of_eager_fallback()
            self._forward = torch.compile(target.forward, **options)

    @classmethod
    def for_run(cls, target: Target, config: TrainConfig) -> TargetWorker:
        """The worker a training run uses: compiled where `run.compile_target` says so (unset:
        not for a target with linear-attention layers, `trainer.model.linear_attention`)."""
        linear = has_linear_attention(target.config)
        return cls(
            target, compiled=config.run.compiles_target_on(target.device, linear_attention=linear)
        )

    def _target_forward(self, input_ids: Tensor) -> TargetOutput:
        dynamo = torch._dynamo.exc  # its compile errors: raised by the compiled forward only
        try:
            return self._forward(input_ids)
        except (dynamo.BackendCompilerFailed, dynamo.InternalTorchDynamoError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise TargetCompileFailed(f"The target's forward did not compile: {first}") from exc

    def produce(self, batch: Batch) -> Features:
        host = batch
        batch = batch.to(self.target.device)
        with torch.no_grad(), compile_errors_as_typed("The target's forward"):
            out = self._target_forward(batch.input_ids)
        return Features(
            hidden=out.features,
            last_hidden=out.last_hidden,
            input_ids=batch.input_ids,
            anchors=batch.anchors,
            valid=batch.valid,
            labels=batch.labels,
            num_tokens=host.num_tokens,
            host_labels=host.labels if host.labels.device.type == "cpu" else None,
        )
