"""Training data: tokenized JSONL, chat JSONL → tokenized (`prepare`), anchors, labels, batches.

Alignment (the off-by-one that public trainers get wrong), for a block anchored at position p:
- the block's tokens are `[x_p, MASK, …, MASK]` at positions p … p+B−1;
- slot k (k ≥ 1) predicts x_{p+k}: `labels[n, k] = input_ids[p + k]`; slot 0 carries no loss;
- the block sees context strictly before p (the target features of positions 0 … p−1);
- a label is −100 when p+k is past the sequence or not supervised (`loss_mask` false).
Anchors are positions p with `loss_mask[p]` and `loss_mask[p+1]`, so every block has at least one
supervised label. Determinism: the order of samples depends on (seed, epoch) and the anchors of a
sample on (seed, epoch, index), so a run resumed at (epoch, index) draws exactly the same batches.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.config import DataConfig, TrainConfigError

IGNORE = -100


@dataclass(frozen=True)
class Sample:
    input_ids: list[int]
    loss_mask: list[bool]


@dataclass
class Batch:
    input_ids: torch.Tensor  # (Bsz, S) long, right-padded to the bucket
    lengths: torch.Tensor  # (Bsz,) long, real lengths
    anchors: torch.Tensor  # (Bsz, N) long, sorted; 0 where not valid
    valid: torch.Tensor  # (Bsz, N) bool
    labels: torch.Tensor  # (Bsz, N, B) long, IGNORE where no loss

    def to(self, device: torch.device | str) -> Batch:
        return Batch(**{k: v.to(device, non_blocking=True) for k, v in vars(self).items()})

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def load_samples(path: str | Path, *, max_len: int | None = None) -> Sequence[Sample]:
    """Read tokenized JSONL; each line `{"input_ids": [...], "loss_mask": [...]}` (0/1 or bools).
    A directory is a shard directory (`trainer.shards`), read memory-mapped, never loaded."""
    if Path(path).is_dir():
        from trainer.shards import ShardSamples

        return ShardSamples(path, max_len=max_len)
    samples = []
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids, mask = row["input_ids"], row["loss_mask"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"{path}:{lineno}: expected {{'input_ids': [...], 'loss_mask': [...]}} ({exc})"
                ) from exc
            if len(ids) != len(mask):
                raise ValueError(f"{path}:{lineno}: input_ids and loss_mask differ in length")
            if max_len is not None:
                ids, mask = ids[:max_len], mask[:max_len]
            samples.append(Sample([int(i) for i in ids], [bool(m) for m in mask]))
    if not samples:
        raise ValueError(f"{path}: no samples")
    return samples


def write_samples(path: str | Path, samples: Sequence[Sample]) -> None:
    with open(path, "w") as fh:
        for s in samples:
            fh.write(
                json.dumps({"input_ids": s.input_ids, "loss_mask": [int(m) for m in s.loss_mask]})
            )
            fh.write("\n")


def anchor_candidates(loss_mask: Sequence[bool]) -> list[int]:
    """Positions p with p and p+1 both supervised."""
    return [p for p in range(len(loss_mask) - 1) if loss_mask[p] and loss_mask[p + 1]]


def sample_anchors(
    loss_mask: Sequence[bool], num_anchors: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_anchors` sorted anchors, padded with invalid ones → (N,) long, (N,) bool."""
    cand = torch.tensor(anchor_candidates(loss_mask), dtype=torch.long)
    if len(cand) > num_anchors:
        pick = torch.randperm(len(cand), generator=generator)[:num_anchors]
        cand = cand[pick].sort().values
    anchors = torch.zeros(num_anchors, dtype=torch.long)
    valid = torch.zeros(num_anchors, dtype=torch.bool)
    anchors[: len(cand)] = cand
    valid[: len(cand)] = True
    return anchors, valid


def block_labels(
    input_ids: Sequence[int],
    loss_mask: Sequence[bool],
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """labels[n, k] = input_ids[anchors[n] + k] for k ≥ 1 where that position exists and is
    supervised; IGNORE elsewhere (slot 0, invalid blocks) → (N, B) long."""
    ids = torch.tensor(list(input_ids), dtype=torch.long)  # (L,)
    sup = torch.tensor(list(loss_mask), dtype=torch.bool)  # (L,)
    length = len(ids)
    pos = anchors[:, None] + torch.arange(block_size)[None, :]  # (N, B)
    inside = pos < length
    safe = pos.clamp(max=max(length - 1, 0))
    keep = inside & sup[safe] & valid[:, None]
    keep[:, 0] = False
    return torch.where(keep, ids[safe], torch.full_like(safe, IGNORE))


def bucket_length(length: int, bucket: int) -> int:
    return max(bucket, math.ceil(length / bucket) * bucket)


def collate(
    samples: Sequence[Sample],
    *,
    block_size: int,
    num_anchors: int,
    bucket: int,
    pad_token_id: int,
    generators: Sequence[torch.Generator],
) -> Batch:
    """Pad to one bucketed length, draw anchors (one generator per sample), build labels."""
    seq = bucket_length(max(len(s.input_ids) for s in samples), bucket)
    ids = torch.full((len(samples), seq), pad_token_id, dtype=torch.long)
    anchors, valid, labels = [], [], []
    for i, (s, gen) in enumerate(zip(samples, generators, strict=True)):
        ids[i, : len(s.input_ids)] = torch.tensor(s.input_ids, dtype=torch.long)
        a, v = sample_anchors(s.loss_mask, num_anchors, gen)
        anchors.append(a)
        valid.append(v)
        labels.append(block_labels(s.input_ids, s.loss_mask, a, v, block_size))
    lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.long)
    return Batch(ids, lengths, torch.stack(anchors), torch.stack(valid), torch.stack(labels))


@dataclass(frozen=True)
class DataPosition:
    """Where the stream is: the next batch starts at sample `index` of epoch `epoch`'s order."""

    epoch: int = 0
    index: int = 0


class BatchStream:
    """Endless deterministic batches over the samples; `position` is saved with checkpoints."""

    def __init__(
        self,
        samples: Sequence[Sample],
        config: DataConfig,
        *,
        block_size: int,
        seed: int,
        position: DataPosition = DataPosition(),
    ) -> None:
        # a memory-mapped set is streamed as it is (its samples were written usable; one
        # without anchors would only add no blocks), never read whole here
        usable = (
            [s for s in samples if anchor_candidates(s.loss_mask)]
            if isinstance(samples, list)
            else samples
        )
        if not usable:
            raise TrainConfigError("data.path", "no sample has two consecutive supervised tokens")
        if len(usable) < config.batch_size:
            raise TrainConfigError(
                "data.batch_size", f"larger than the {len(usable)} usable samples"
            )
        self.samples = usable
        self.config = config
        self.block_size = block_size
        self.seed = seed
        self.position = position
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        """The epoch's sample order, drawn once per epoch (not per batch: millions of samples)."""
        if epoch not in self._orders:
            n = len(self.samples)
            gen = torch.Generator().manual_seed(_mix(self.seed, epoch))
            order = torch.randperm(n, generator=gen) if self.config.shuffle else torch.arange(n)
            self._orders = {epoch: order}
        return self._orders[epoch]

    @property
    def epochs(self) -> float:
        """Passes over the data so far (2.5: half-way through the third)."""
        return self.position.epoch + self.position.index / len(self.samples)

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()

    def next_batch(self) -> Batch:
        epoch, index = self.position.epoch, self.position.index
        bsz = self.config.batch_size
        if index + bsz > len(self.samples):  # drop the ragged tail: every batch has bsz samples
            epoch, index = epoch + 1, 0
        order = self._order(epoch)[index : index + bsz].tolist()
        gens = [
            torch.Generator().manual_seed(_mix(self.seed, epoch, index + j)) for j in range(bsz)
        ]
        batch = collate(
            [self.samples[i] for i in order],
            block_size=self.block_size,
            num_anchors=self.config.num_anchors,
            bucket=self.config.bucket,
            pad_token_id=self.config.pad_token_id,
            generators=gens,
        )
        self.position = DataPosition(epoch, index + bsz)
        return batch


def repeat_note(epoch: int, num_samples: int) -> str:
    """The log line when the stream starts pass `epoch` (0-based) over the data."""
    return (
        f"epoch {epoch + 1} begins: the drafter now sees repeated samples "
        f"({num_samples:,} samples per epoch; more data would help more than more epochs)"
    )


def _mix(*parts: int) -> int:
    """A 63-bit seed from several integers (stable across runs and platforms)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (p & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF


def uniform_noise(
    shape: Sequence[int],
    *,
    scale: float,
    seed: int,
    step: int,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Uniform noise in [−scale, scale], reproducible from (seed, step) so resume is exact."""
    gen = torch.Generator(device=device).manual_seed(_mix(seed, step, 7))
    noise = torch.rand(tuple(shape), generator=gen, device=device, dtype=torch.float32)
    return ((noise * 2 - 1) * scale).to(dtype)


# ---- prepare: chat JSONL → tokenized JSONL -------------------------------------------------


def tokenize_chat(
    tokenizer: Any, messages: list[dict[str, str]], *, max_len: int | None = None
) -> Sample:
    """Render `messages` with the tokenizer's chat template; supervise assistant turns only.

    Each assistant turn's span is found by rendering the prefix up to it (with the generation
    prompt) and the prefix including it; the template must render prefixes as prefixes."""

    def render(msgs: list[dict[str, str]], gen_prompt: bool) -> list[int]:
        out = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen_prompt)
        if hasattr(out, "keys") and "input_ids" in out:
            out = out["input_ids"]
        return list(out)

    full = render(messages, False)
    mask = [False] * len(full)
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        start = len(render(messages[:i], True))
        upto = render(messages[: i + 1], False)
        if full[: len(upto)] != upto:
            raise ValueError("the chat template does not render a conversation prefix as a prefix")
        for j in range(start, len(upto)):
            mask[j] = True
    if max_len is not None:
        full, mask = full[:max_len], mask[:max_len]
    return Sample(full, mask)


def prepare(
    chat_path: str | Path,
    tokenizer_dir: str | Path,
    out_path: str | Path,
    *,
    max_len: int | None = None,
) -> int:
    """Tokenize `{"messages": [{"role", "content"}, …]}` lines with the target's tokenizer and
    chat template (local folder only) into tokenized JSONL; returns the number of samples."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    samples = []
    with open(chat_path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                messages = json.loads(line)["messages"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"{chat_path}:{lineno}: expected {{'messages': [...]}} ({exc})"
                ) from exc
            samples.append(tokenize_chat(tokenizer, messages, max_len=max_len))
    write_samples(out_path, samples)
    return len(samples)


if __name__ == "__main__":  # python -m trainer.data CHAT.jsonl TOKENIZER_DIR OUT.jsonl [MAX_LEN]
    import sys

    args = sys.argv[1:]
    if len(args) not in (3, 4):
        sys.exit("usage: python -m trainer.data CHAT.jsonl TOKENIZER_DIR OUT.jsonl [MAX_LEN]")
    n = prepare(args[0], args[1], args[2], max_len=int(args[3]) if len(args) == 4 else None)
    print(f"wrote {n} samples to {args[2]}")
