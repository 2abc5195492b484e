"""Training data: `data.path` in any supported format → samples (`load_samples`), anchors,
labels, batches. Formats and their parsers: `trainer.data.formats`; chat/text tokenizing and its
cache: `trainer.data.chat`; `python -m trainer tokenize` prepares tokenized JSONL ahead of time.

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

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.data.chat import (
    DEFAULT_TEMPLATE,
    TemplateOptions,
    cached_samples,
    load_tokenizer,
    tokenize_file,
)
from trainer.data.formats import (
    DataFileError,
    DataReport,
    Sample,
    detect,
    read_tokenized,
    truncate,
    write_samples,
)
from trainer.settings.config import DataConfig, TrainConfigError

__all__ = ["Sample", "write_samples", "load_samples", "load_data"]
log = logging.getLogger("trainer")
IGNORE = -100


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


def load_samples(
    path: str | Path,
    *,
    max_len: int | None = None,
    tokenizer_dir: str | Path | None = None,
    template: TemplateOptions = DEFAULT_TEMPLATE,
    cache_dir: str | Path | None = None,
    emit: Callable[[str], None] | None = None,
) -> Sequence[Sample]:
    """`path` in whichever format it is (`formats.detect`) → samples cut to `max_len`.

    Chat and text files are tokenized with the tokenizer in `tokenizer_dir` (the target's
    folder), through the cache in `cache_dir` when given. Lines that do not parse are dropped;
    the report (samples, supervised tokens, truncated, dropped with file:line) goes to `emit`.
    A directory is a shard directory (`trainer.data.shards`, made by `trainer.generation.generate`), read
    memory-mapped, never loaded."""
    if Path(path).is_dir():
        from trainer.data.shards import ShardSamples

        return ShardSamples(path, max_len=max_len)
    samples, report = read_source(
        path, tokenizer_dir=tokenizer_dir, template=template, cache_dir=cache_dir
    )
    samples = truncate(samples, report, max_len)
    for line in report.lines():
        (emit or log.info)(line)
    if not samples:
        first = f"; first dropped line {report.dropped[0].where}: {report.dropped[0].why}"
        raise DataFileError(f"{path}: no usable sample{first if report.dropped else ''}")
    return samples


def read_source(
    path: str | Path,
    *,
    tokenizer_dir: str | Path | None,
    template: TemplateOptions,
    cache_dir: str | Path | None,
) -> tuple[list[Sample], DataReport]:
    """The one dispatch from what `path` is (`formats.detect`) to the reader of that format;
    another kind of source is one more `Format` there and one more branch here."""
    fmt = detect(path)
    if not fmt.needs_tokenizer:
        return read_tokenized(path)
    if not tokenizer_dir:
        raise DataFileError(f"{path}: {fmt.name} lines need the target's tokenizer (model.target)")
    if cache_dir is None:
        return tokenize_file(path, fmt, load_tokenizer(tokenizer_dir), template)
    return cached_samples(
        path, fmt, tokenizer_dir=tokenizer_dir, options=template, cache_dir=cache_dir
    )


def template_options(data: DataConfig) -> TemplateOptions:
    """How `[data]` asks for chats to be rendered (thinking, a default system prompt)."""
    return TemplateOptions(enable_thinking=data.enable_thinking, system_prompt=data.system_prompt)


def cache_dir_for(out_dir: str | Path) -> Path:
    """Tokenized chat/text data live next to the run folder (an archive of the checkpoints
    leaves them, and every run of the same data re-uses them)."""
    return Path(out_dir).resolve().parent / "data-cache"


def load_data(
    data: DataConfig,
    out_dir: str | Path,
    *,
    tokenizer_dir: str | None,
    emit: Callable[[str], None] | None = None,
) -> Sequence[Sample]:
    """The run's `data.path` as samples (see `load_samples`; chat and text tokenized with the
    target's tokenizer in `tokenizer_dir`), cached next to `out_dir`."""
    return load_samples(
        data.path,
        max_len=data.max_len,
        tokenizer_dir=tokenizer_dir,
        template=template_options(data),
        cache_dir=cache_dir_for(out_dir),
        emit=emit,
    )


def candidate_mask(loss_mask: Sequence[bool] | torch.Tensor) -> torch.Tensor:
    """Where a block may start: position p with p and p+1 both supervised → bool (…, S−1)."""
    mask = torch.as_tensor(loss_mask, dtype=torch.bool)
    return mask[..., :-1] & mask[..., 1:]


def anchor_candidates(loss_mask: Sequence[bool] | torch.Tensor) -> torch.Tensor:
    """One sequence's candidate anchors (`candidate_mask`) → (K,) long, ascending."""
    return candidate_mask(loss_mask).nonzero().flatten()


def draw_anchors(
    supervised: torch.Tensor, num_anchors: int, generators: Sequence[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's anchors: all its candidates when it has at most `num_anchors`, else
    `num_anchors` of them drawn by the row's generator (`randperm` over its K candidates, the
    first N), sorted; padded with invalid zeros → (Bsz, N) long, (Bsz, N) bool.

    The batch at once, not row by row: only the draw itself is per row (each sequence keeps its
    own random stream, so a batch's anchors do not depend on its other rows)."""
    cand = candidate_mask(supervised)  # (Bsz, S−1)
    bsz = cand.shape[0]
    counts = cand.sum(1)
    rows, cols = cand.nonzero(as_tuple=True)  # row-major: each row's candidates ascending
    width = max(int(counts.max()) if bsz else 0, 1)
    table = torch.zeros(bsz, width, dtype=torch.long)  # table[i, r]: row i's r-th candidate
    table[rows, cand.cumsum(1)[rows, cols] - 1] = cols
    picks = torch.arange(num_anchors).repeat(bsz, 1)  # ranks into each row's candidates
    valid = picks < counts.clamp(max=num_anchors)[:, None]
    drawn = [
        (i, torch.randperm(k, generator=gen)[:num_anchors])
        for i, (k, gen) in enumerate(zip(counts.tolist(), generators, strict=True))
        if k > num_anchors
    ]
    if drawn:
        picks[[i for i, _ in drawn]] = torch.stack([d for _, d in drawn])
    chosen = table.gather(1, picks.clamp(max=width - 1))
    past_end = supervised.shape[-1]  # invalid slots sort behind every real position
    anchors = torch.where(valid, chosen, past_end).sort(1).values
    return torch.where(valid, anchors, 0), valid


def block_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """labels[i, n, k] = input_ids[i, anchors[i, n] + k] for k ≥ 1 where that position exists
    and is supervised; IGNORE elsewhere (slot 0, invalid blocks, padding: `loss_mask` false
    there) → (Bsz, N, B) long. input_ids, loss_mask (Bsz, S); anchors, valid (Bsz, N)."""
    bsz, seq = input_ids.shape
    pos = anchors[:, :, None] + torch.arange(block_size)  # (Bsz, N, B)
    safe = pos.clamp(max=seq - 1).view(bsz, -1)
    keep = (pos < seq) & loss_mask.gather(1, safe).view(pos.shape) & valid[:, :, None]
    keep[:, :, 0] = False
    return torch.where(keep, input_ids.gather(1, safe).view(pos.shape), IGNORE)


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
    lengths = [len(s.input_ids) for s in samples]
    seq = bucket_length(max(lengths), bucket)
    # filled in numpy: a row from a Python list is ~4× faster there than through torch
    ids_np = np.full((len(samples), seq), pad_token_id, dtype=np.int64)
    supervised_np = np.zeros((len(samples), seq), dtype=np.bool_)  # false on the padding
    for i, (s, n) in enumerate(zip(samples, lengths, strict=True)):
        ids_np[i, :n] = s.input_ids
        supervised_np[i, :n] = s.loss_mask
    ids, supervised = torch.from_numpy(ids_np), torch.from_numpy(supervised_np)
    anchors, valid = draw_anchors(supervised, num_anchors, generators)
    labels = block_labels(ids, supervised, anchors, valid, block_size)
    return Batch(ids, torch.tensor(lengths, dtype=torch.long), anchors, valid, labels)


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
            [s for s in samples if anchor_candidates(s.loss_mask).numel()]
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
        return self.epochs_at(self.position)

    def epochs_at(self, position: DataPosition) -> float:
        """Passes over the data at `position`."""
        return position.epoch + position.index / len(self.samples)

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
    """The log line when the stream starts pass `epoch` (0-based) over the data: the advice
    once, at the first repeat; a short line at every later pass. Repeats alone are no harm (a
    few epochs over well-chosen prompts did no worse than one over more, other text:
    bench/results/eval-one-epoch/): the probe's two τ tell when they start to be."""
    if epoch > 1:
        return f"epoch {epoch + 1} begins ({num_samples:,} samples per epoch)"
    return (
        f"epoch {epoch + 1} begins: the drafter now sees repeated samples "
        f"({num_samples:,} samples per epoch; when the probe's training-prompt τ pulls away "
        "from its held-out τ, more data will help more than more epochs)"
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


# ---- prepare: chat or text JSONL → tokenized JSONL ahead of time ------------------------------


def prepare(
    chat_path: str | Path,
    tokenizer_dir: str | Path,
    out_path: str | Path,
    *,
    max_len: int | None = None,
    template: TemplateOptions = DEFAULT_TEMPLATE,
    emit: Callable[[str], None] = print,
) -> int:
    """Tokenize a chat or text JSONL with the target's tokenizer and chat template (local folder
    only) into tokenized JSONL; returns the number of samples. (Training on the chat file
    directly does the same, once, into a cache.)"""
    samples = load_samples(
        chat_path, max_len=max_len, tokenizer_dir=tokenizer_dir, template=template, emit=emit
    )
    write_samples(out_path, samples)
    return len(samples)


def split_holdout(
    samples: Sequence[Sample], holdout: int
) -> tuple[Sequence[Sample], Sequence[Sample]]:
    """(trained on, held out): the last `holdout` samples are kept out of training (slices: a
    shard view stays a view)."""
    if holdout >= len(samples):
        raise TrainConfigError(
            "data.holdout", f"{holdout} would leave none of the {len(samples)} samples to train on"
        )
    cut = len(samples) - holdout
    return samples[:cut], samples[cut:]
