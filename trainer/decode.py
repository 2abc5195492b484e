"""Batched, KV-cached decoding with a `transformers` causal LM: the target answers prompts.

`decode_batch` steps, in order:
1. left-pad the prompts to one length (attention mask 0 on the padding; position ids count real
   tokens only, so a padded row computes what it would alone);
2. prefill: one forward over the prompts into a `DynamicCache`, logits of the last position only;
3. per step: pick the next token of every live row (greedy argmax, or temperature + top-p
   sampling from a seeded generator), feed it with the grown attention mask;
4. a row that emits an end token or reaches `max_new_tokens` leaves the batch: its cache rows are
   dropped (`batch_select_indices`), so finished answers cost nothing more — unlike a plain
   `generate`, which keeps computing padding for them until the longest answer ends.
Batches are formed by the caller from prompts of similar length (`length_batches`), which keeps
the padding of step 1 small.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How the next token is chosen: greedy when `temperature` is 0."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be ≥ 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (longest first: memory peaks early)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def pick(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None
) -> torch.Tensor:
    """Next tokens from logits (b, V) → (b,) long."""
    if sampling.greedy:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)  # (b, V)
    if sampling.top_p < 1:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > sampling.top_p  # keep the smallest nucleus
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def decode_batch(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_ids: Collection[int],
    pad_id: int,
    sampling: Sampling = Sampling(),
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """The model's answer to each prompt (end token included when emitted), in input order."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    b, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        attn[i, width - len(p) :] = 1
    ids, attn = ids.to(device), attn.to(device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # (b, width)
    cache = DynamicCache()
    kv = {_cache_kwarg(model): cache}
    out = model(
        input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1, **kv
    )
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
    rows = torch.arange(b, device=device)  # original index of each live row
    nxt_pos = pos[:, -1] + 1  # (live,)
    tokens = torch.full((b, max_new_tokens), -1, dtype=torch.long, device=device)  # (b, N)
    logits = out.logits[:, -1]
    for step in range(max_new_tokens):
        tok = pick(logits, sampling, generator)  # (live,)
        tokens[rows, step] = tok  # stays on the device: one sync per step (the count below)
        if step + 1 == max_new_tokens:
            break
        done = torch.isin(tok, eos)
        finished = int(done.sum())
        if finished == len(rows):
            break
        if finished:
            keep = (~done).nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            rows, tok, attn, nxt_pos = rows[keep], tok[keep], attn[keep], nxt_pos[keep]
        attn = torch.cat([attn, attn.new_ones((len(rows), 1))], dim=-1)
        out = model(
            input_ids=tok[:, None],
            attention_mask=attn,
            position_ids=nxt_pos[:, None],
            use_cache=True,
            **kv,
        )
        nxt_pos = nxt_pos + 1
        logits = out.logits[:, -1]
    return [_answer(row, eos_ids) for row in tokens.tolist()]


def _answer(row: list[int], eos_ids: Collection[int]) -> list[int]:
    """A row of the token table up to its first end token (included); −1 marks unused steps."""
    for i, t in enumerate(row):
        if t < 0:
            return row[:i]
        if t in eos_ids:
            return row[: i + 1]
    return row


def _cache_kwarg(model: nn.Module) -> str:
    """`cache` in newer `transformers` (`past_key_values` is deprecated there), else the old name."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def end_tokens(model: nn.Module, tokenizer: object | None = None) -> set[int]:
    """The ids that end an answer: the generation config's `eos_token_id` (an int or a list),
    else the model config's, plus the tokenizer's EOS."""
    found: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, list | tuple):
            found.update(int(v) for v in value)
        if found:
            break
    tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if isinstance(tok_eos, int):
        found.add(tok_eos)
    return found
