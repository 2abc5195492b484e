"""Batched, KV-cached decoding with a `transformers` causal LM: the target answers prompts.

`decode_batch` steps, in order:
1. left-pad the prompts to one length (attention mask 0 on the padding; position ids count real
   tokens only, so a padded row computes what it would alone);
2. prefill: one forward over the prompts into a `DynamicCache`, logits of the last position only;
3. per step: pick the next token of every live row (greedy argmax, or temperature + top-p
   sampling from a seeded generator), feed it with the grown attention mask;
4. a row that emits an end token or reaches `max_new_tokens` leaves the batch: its cache rows
   (keys and values, and the recurrent states of a hybrid model's linear-attention layers) are
   dropped (`reorder_cache` with the rows kept), so finished answers cost nothing more — unlike
   a plain `generate`, which keeps computing padding for them until the longest answer ends.
Batches are formed by the caller from prompts of similar length (`length_batches`), which keeps
the padding of step 1 small.

Two engines run these steps (`engine=`):
- `dynamic` — a `DynamicCache` that grows by one column per step, finished rows dropped: what
  the steps above describe; any model `transformers` can decode runs on it (its attention on
  the backends that need no plan per shape: every step is a new shape);
- `static` — a `StaticCache` of `prompt + max_new_tokens` columns (rounded up to whole
  `COLUMN_BLOCK`s when its masks are cut, below), the attention mask kept as a
  (rows, columns) table in which each step opens one column, every row computed to the end (a
  finished row's tokens after its end token are cut off): the steps of one mask width have the
  same shapes and the same buffers, so on CUDA the step is recorded once per width as a CUDA
  graph and replayed — a small or medium target decodes at the GPU's speed instead of Python's.
  With `sdpa` attention a step attends through `trainer.generation.decode_attention`: each key/value head
  read once for the query heads sharing it, and only the columns written so far (a mask cut at
  the next multiple of `COLUMN_BLOCK`); with `eager`, every mask is the whole table (one
  width). It needs full attention (no sliding window) in `sdpa` or `eager`; `auto` picks it on
  CUDA where it applies.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainer.generation.decode_attention import COLUMN_BLOCK, grouped_decoding
from trainer.model.fidelity import decoder_config

log = logging.getLogger("trainer.generation.decode")


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


ENGINES = ("auto", "static", "dynamic")
CHECK_DONE_EVERY = 8  # static engine: steps between looks at "has every row ended?" (a sync)
EAGER_STEPS = 2  # static engine on CUDA: steps of a mask width run before it is recorded


def decode_batch(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_ids: Collection[int],
    pad_id: int,
    sampling: Sampling = Sampling(),
    generator: torch.Generator | None = None,
    engine: str = "auto",
) -> list[list[int]]:
    """The model's answer to each prompt (end token included when emitted), in input order."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    why_not = static_unsupported(model)
    if engine == "static" and why_not:
        raise ValueError(f"the static decoding engine cannot run this model: {why_not}")
    device = next(model.parameters()).device
    kwargs: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id, sampling=sampling,
        generator=generator,
    )  # fmt: skip
    if engine == "dynamic" or (engine == "auto" and (device.type != "cuda" or why_not)):
        return _decode_dynamic(model, prompts, **kwargs)
    if engine == "static":
        return _decode_static(model, prompts, **kwargs)
    state = generator.get_state() if generator is not None else None
    try:
        return _decode_static(model, prompts, **kwargs)
    except (RuntimeError, NotImplementedError) as exc:  # a model the graph capture cannot take
        log.warning("static decoding failed (%s); decoding with the dynamic engine", exc)
        if generator is not None and state is not None:
            generator.set_state(state)  # the same draws as if static had never run
        return _decode_dynamic(model, prompts, **kwargs)


def static_unsupported(model: nn.Module) -> str | None:
    """Why the static engine cannot decode `model` (None: it can). Its one mask serves every
    layer, so every layer must attend to all earlier tokens; the mask is handed to the attention
    as a 4-D table, which `sdpa` (a boolean table) and `eager` (an additive one) take."""
    config: Any = getattr(model, "config", None)
    text = decoder_config(config)
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"its layers are not all full attention ({', '.join(sorted(kinds))})"
    impl = _attention(model)
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r} (sdpa or eager needed)"
    return None


@torch.no_grad()
def _decode_static(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_ids: Collection[int],
    pad_id: int,
    sampling: Sampling,
    generator: torch.Generator | None,
) -> list[list[int]]:
    """The static engine. With `sdpa` attention (`grouped_decoding`) a step's mask ends at the
    first multiple of `COLUMN_BLOCK` past its column (the attention reads no further), else at
    the cache's end."""
    from transformers import StaticCache

    as_mask = _mask_format(model)  # read before the attention is switched
    with grouped_decoding(model) as cut_masks:
        device = next(model.parameters()).device
        ids, attn, pos = _left_padded(prompts, pad_id, device)
        b, width = ids.shape
        block = COLUMN_BLOCK if cut_masks else 1
        columns = -(-(width + max_new_tokens) // block) * block  # rounded up to whole blocks
        config: Any = model.config
        cache = StaticCache(config=config, max_cache_len=columns)
        kv = {_cache_kwarg(model): cache}
        # (b, columns): which cached columns a row may attend to; each step opens one more
        open_ = torch.zeros((b, columns), dtype=torch.bool, device=device)
        open_[:, :width] = attn.bool()
        causal = torch.ones((width, columns), dtype=torch.bool, device=device).tril()
        prefill_mask = open_[:, None, None, :] & causal  # (b, 1, width, columns)
        # a padding position sees itself: no row of the table is empty (an empty row's softmax
        # is NaN, and a NaN key or value poisons every row that masks it out)
        prefill_mask |= torch.eye(width, columns, dtype=torch.bool, device=device)
        out = model(
            input_ids=ids, attention_mask=as_mask(prefill_mask), position_ids=pos,
            use_cache=True, logits_to_keep=1, **kv,
        )  # fmt: skip
        step_ids = torch.zeros((b, 1), dtype=torch.long, device=device)
        step_pos = pos[:, -1:] + 1  # (b, 1)
        column = torch.full((1,), width, dtype=torch.long, device=device)  # the next free column

        def step(end: int) -> torch.Tensor:
            """One token per row at `column`, attending to columns < `end`; the same buffers
            every call (a graph can replay it)."""
            open_.index_fill_(1, column, True)
            logits = model(
                input_ids=step_ids, attention_mask=as_mask(open_[:, None, None, :end]),
                position_ids=step_pos, use_cache=True, **kv,
            ).logits[:, -1]  # fmt: skip
            step_pos.add_(1)
            column.add_(1)
            return logits

        run_step = _Replay(step, device)
        eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        tokens = torch.full((b, max_new_tokens), -1, dtype=torch.long, device=device)
        logits = out.logits[:, -1]
        for i in range(max_new_tokens):
            tok = pick(logits, sampling, generator)
            tokens[:, i] = tok
            done |= torch.isin(tok, eos)
            if i + 1 == max_new_tokens or (i % CHECK_DONE_EVERY == 0 and bool(done.all())):
                break
            step_ids.copy_(tok[:, None])
            end = min(columns, (width + i) // block * block + block)  # past the column it writes
            logits = run_step(end if cut_masks else columns)
        return [_answer(row, eos_ids) for row in tokens.tolist()]


class _Replay:
    """Calls `step(end)`: per `end`, eagerly for its first `EAGER_STEPS` calls (on CUDA on a
    side stream, which also warms what a capture needs, such as a kernel plan for the new
    shape), then recorded once as a CUDA graph and replayed. The graphs share one memory pool:
    they never run at once. On the CPU every call is eager."""

    def __init__(self, step: Callable[[int], torch.Tensor], device: torch.device) -> None:
        self.step, self.device = step, device
        self.calls: dict[int, int] = {}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None

    def __call__(self, end: int) -> torch.Tensor:
        self.calls[end] = self.calls.get(end, 0) + 1
        if self.device.type != "cuda":
            return self.step(end)
        if self.calls[end] <= EAGER_STEPS:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                logits = self.step(end)
            torch.cuda.current_stream(self.device).wait_stream(side)
            return logits
        if end not in self.graphs:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):  # recorded, not run: replayed below
                output = self.step(end)
            self.pool = graph.pool() if self.pool is None else self.pool
            self.graphs[end] = (graph, output)
        graph, output = self.graphs[end]
        graph.replay()
        return output


def _mask_format(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A boolean (True: attend) table as the model's attention takes it: as is for `sdpa`, as
    0 / the dtype's lowest value to add to the scores for `eager`."""
    if _attention(model) == "sdpa":
        return lambda table: table
    dtype = next(model.parameters()).dtype
    low = torch.finfo(dtype).min
    return lambda table: torch.where(table, 0.0, low).to(dtype)


def _attention(model: nn.Module) -> str:
    """The model's attention implementation (`sdpa` when its config does not say)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"


def _left_padded(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, position ids), each (b, width) long: prompts right-aligned after
    `pad_id`s; positions count real tokens only, so a padded row computes what it would alone."""
    b, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        attn[i, width - len(p) :] = 1
    ids, attn = ids.to(device), attn.to(device)
    return ids, attn, (attn.cumsum(-1) - 1).clamp(min=0)


# every attention backend of `scaled_dot_product_attention` but cuDNN's, which builds an
# execution plan per new shape: tens of milliseconds of CPU on each step of a growing cache
NO_PLAN_PER_SHAPE = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


@torch.no_grad()
def _decode_dynamic(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_ids: Collection[int],
    pad_id: int,
    sampling: Sampling,
    generator: torch.Generator | None,
) -> list[list[int]]:
    """The dynamic engine: each step's keys are one column longer, a shape never seen before,
    so attention runs on the backends that need no per-shape plan (`NO_PLAN_PER_SHAPE`; on an
    H200, 55 → 12 ms a step for the evaluation benchmark's target)."""
    with sdpa_kernel(list(NO_PLAN_PER_SHAPE)):
        device = next(model.parameters()).device
        b = len(prompts)
        ids, attn, pos = _left_padded(prompts, pad_id, device)
        cache = _dynamic_cache(model)
        kv = {_cache_kwarg(model): cache}
        out = model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1,
            **kv,
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
                cache.reorder_cache(keep)  # every layer's rows: keys, values, recurrent states
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


def _dynamic_cache(model: nn.Module) -> Any:
    """A `DynamicCache` laid out from the model's config where `transformers` takes one: a
    hybrid model (linear-attention layers with conv and recurrent states beside full attention,
    as Qwen3.5) needs a cache layer of the right kind per layer."""
    from transformers import DynamicCache

    if "config" in inspect.signature(DynamicCache.__init__).parameters:
        config: Any = model.config
        return DynamicCache(config=config)
    return DynamicCache()


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
