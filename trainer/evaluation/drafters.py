"""What drafts a block for speculative decoding: the `BlockDrafter` interface the evaluator
calls, and the trained drafter behind it (`DFlashDrafter`: one training forward per block, or
one forward for the blocks of several sequences).

Any drafter can be judged (`trainer.evaluation.report.evaluate`): prompt lookup (`trainer.evaluation.prompt_lookup`)
proposes from the text itself and may propose fewer than B−1 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.data.dataset import bucket_length
from trainer.model.drafter import Drafter


class DraftRequest(NamedTuple):
    """One block to draft: the arguments of `BlockDrafter.draft`."""

    features: Tensor  # (1, anchor, n·H)
    input_ids: Tensor  # (1, anchor + 1)
    anchor: int


class BlockDrafter(Protocol):
    """What the evaluator calls to draft one block (a drafter may also offer
    `draft_many(requests) -> list[Tensor]`, the blocks of several sequences at once)."""

    block_size: int

    def draft(self, features: Tensor, input_ids: Tensor, anchor: int) -> Tensor:
        """features (1, anchor, n·H): the target's features of positions < anchor; input_ids
        (1, anchor + 1): the sequence up to the anchor token → (k,) long with k ≤ B−1, the
        proposals for positions anchor+1 … anchor+k (a trained drafter always proposes B−1;
        prompt lookup proposes none when nothing matches)."""
        ...


class DFlashDrafter:
    """A trained `Drafter` behind the `BlockDrafter` interface: one forward with one anchor.

    The context is padded to a multiple of `bucket` (unseen: the mask stops at the anchor).
    Attention runs on the SDPA backend by default: one block's dense mask is B × (S + B), tiny,
    and it keeps the compiled flex kernels of a training run in the same process from
    recompiling for every context length; both backends implement `dense_mask` exactly.
    """

    def __init__(
        self,
        drafter: Drafter,
        *,
        embed_weight: Tensor,
        lm_head_weight: Tensor,
        bucket: int = 64,
        backend: str = "sdpa",
    ) -> None:
        self.drafter = drafter
        self.embed_weight = embed_weight.detach()
        self.lm_head_weight = lm_head_weight.detach()
        self.block_size = drafter.shape.block_size
        self.bucket = bucket
        self.backend = backend

    def block_hidden(self, features: Tensor, input_ids: Tensor, anchor: int) -> Tensor:
        """The drafter's final hidden states of the block at `anchor` → (B, H): one training
        forward (`Drafter.forward`) with a single valid anchor."""
        return self.blocks_hidden(features, input_ids, [anchor])[0]

    def blocks_hidden(self, features: Tensor, input_ids: Tensor, anchors: list[int]) -> Tensor:
        """One block per anchor in one forward → (N, B, H); features (1, ≥ last anchor, n·H)
        and input_ids (1, ≥ last anchor + 1). Each block sees the features before its own
        anchor only (the training mask), so the blocks are those of separate `draft` calls."""
        last = max(anchors)
        seq = bucket_length(last + 1, self.bucket)
        feats = F.pad(features[:, :last], (0, 0, 0, seq - last))  # (1, S, n·H)
        ids = F.pad(input_ids[:, : last + 1], (0, seq - last - 1))  # (1, S)
        starts = torch.tensor([anchors], device=features.device)  # (1, N)
        return self._forward(feats, ids, starts)[0]

    def rows_hidden(self, requests: Sequence[DraftRequest]) -> Tensor:
        """One block per request, each of its own sequence, in one forward → (n, B, H): the
        sequences right-padded to one length, each block seeing its own features only."""
        last = max(r.anchor for r in requests)
        seq = bucket_length(last + 1, self.bucket)
        feats = torch.cat(
            [F.pad(r.features[:, : r.anchor], (0, 0, 0, seq - r.anchor)) for r in requests]
        )  # (n, S, n·H)
        ids = torch.cat(
            [F.pad(r.input_ids[:, : r.anchor + 1], (0, seq - r.anchor - 1)) for r in requests]
        )  # (n, S)
        starts = torch.tensor([[r.anchor] for r in requests], device=feats.device)  # (n, 1)
        return self._forward(feats, ids, starts)[:, 0]

    @torch.no_grad()
    def _forward(self, feats: Tensor, ids: Tensor, starts: Tensor) -> Tensor:
        """`Drafter.forward` in eval mode on this drafter's attention backend → (n, N, B, H)."""
        valid = torch.ones_like(starts, dtype=torch.bool)
        was_training, backend = self.drafter.training, self.drafter.attention_backend
        self.drafter.eval()
        self.drafter.attention_backend = self.backend
        autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if feats.device.type == "cuda"
            else nullcontext()
        )
        try:
            with autocast:
                return self.drafter(feats, ids, starts, valid, self.embed_weight)
        finally:
            self.drafter.train(was_training)
            self.drafter.attention_backend = backend

    def weights_read(self) -> int:
        """Parameters one draft reads: the drafter's own and the (borrowed) lm_head its block's
        logits need whole; of the embedding, a few rows (`trainer.evaluation.draft_cost`)."""
        own = sum(p.numel() for p in self.drafter.parameters())
        return own + self.lm_head_weight.numel()

    def draft(self, features: Tensor, input_ids: Tensor, anchor: int) -> Tensor:
        return self.draft_many([DraftRequest(features, input_ids, anchor)])[0]

    def draft_many(self, requests: Sequence[DraftRequest]) -> list[Tensor]:
        """The B−1 proposals of each request, from one forward."""
        hidden = self.rows_hidden(requests)  # (n, B, H)
        logits = hidden[:, 1:].float() @ self.lm_head_weight.float().T  # (n, B−1, V)
        return list(logits.argmax(-1).unbind(0))


def draft_many(drafter: BlockDrafter, requests: Sequence[DraftRequest]) -> list[Tensor]:
    """The drafter's blocks for `requests`: at once where it can, else one `draft` each."""
    many = getattr(drafter, "draft_many", None)
    if many is not None:
        return list(many(requests))
    return [drafter.draft(r.features, r.input_ids, r.anchor) for r in requests]
