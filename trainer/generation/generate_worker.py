"""One rank of `trainer.generation.generate`: its shards of the prompts, decoded and written atomically.

Rank r of W owns shards r, r+W, r+2W, …; a shard file that exists is complete (written to a
temporary name, then renamed: `trainer.data.shards.write_shard`), so a restarted rank skips it. The
sampling generator of a shard is seeded from (seed, shard), so a shard regenerated after a crash
is the one an uninterrupted run would have written.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.base.errors import TrainerError
from trainer.data import prompt_file
from trainer.data.dataset import _mix
from trainer.data.shards import Shard, finished_shards, shard_name, write_shard
from trainer.generation.decode import Sampling, decode_batch, end_tokens, length_batches
from trainer.settings.config import TrainConfig

log = logging.getLogger("trainer.generation.generate")
WAIT_POLL_S = 2.0


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0


def world_from_env() -> World:
    """torchrun's RANK / WORLD_SIZE / LOCAL_RANK; one process when unset."""
    env = os.environ
    return World(
        int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))
    )


def device_for(config: TrainConfig, world: World) -> torch.device:
    """This rank's GPU (its local rank) on CUDA; `run.device` otherwise."""
    name = config.run.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and world.size > 1:
        name = f"cuda:{world.local_rank}"
    return torch.device(name)


class Worker:
    def __init__(
        self,
        config: TrainConfig,
        settings: Any,
        scan: prompt_file.Scan,
        renderer: prompt_file.Renderer,
        out: Path,
        *,
        world: World,
        batch_size: int,
        strict: bool,
        log_every: float,
        engine: str = "auto",
    ) -> None:
        self.config, self.settings, self.scan, self.renderer = config, settings, scan, renderer
        self.out, self.world, self.batch_size = out, world, max(1, batch_size)
        self.strict, self.log_every, self.engine = strict, log_every, engine
        size = settings.shard_size
        self.num_shards = -(-len(scan.refs) // size)
        self.mine = list(range(world.rank, self.num_shards, world.size))
        self.sampling = Sampling(
            temperature=settings.temperature, top_p=settings.top_p, seed=settings.seed
        )
        self.tag = f"[rank {world.rank}/{world.size}] " if world.size > 1 else ""

    # ---- the model ------------------------------------------------------------------------

    def _load(self) -> None:
        from trainer.model.target import load_target

        if self.config.run.threads:
            torch.set_num_threads(self.config.run.threads)
        self.device = device_for(self.config, self.world)
        self.model = load_target(self.config.model.target, device=self.device).model
        # no tokenizer saved: token-id prompts only (a chat or text prompt stops the run)
        tokenizer = self.renderer.tokenizer if self.renderer.has_tokenizer else None
        self.eos = end_tokens(self.model, tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        if pad is None:
            pad = getattr(self.model.config, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else min(self.eos, default=0))
        self.vocab = int(self.model.config.vocab_size)
        self.decode_text = getattr(tokenizer, "decode", None)

    # ---- shards ---------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        done = finished_shards(self.out)
        todo = [i for i in self.mine if i not in done]
        log.info(
            "%s%d of %d shards are this rank's; %d finished already, %d to generate",
            self.tag, len(self.mine), self.num_shards, len(self.mine) - len(todo), len(todo),
        )  # fmt: skip
        if not todo:
            return {"rank": self.world.rank, "generated": 0}
        self._load()
        progress = Progress(self.tag, total=len(todo), every=self.log_every)
        for i in todo:
            for stale in self.out.glob(f"{shard_name(i)}.tmp-*"):
                stale.unlink(missing_ok=True)  # an interrupted write of this rank's shard
            meta, example = self.generate_shard(i)
            progress.shard_done(meta, example)
        progress.finish()
        return {"rank": self.world.rank, "generated": len(todo)}

    def _prompt(self, ref: prompt_file.PromptRef) -> list[int]:
        """Token ids of one prompt; ValueError saying why it cannot be used."""
        try:
            ids = self.renderer(*prompt_file.read(self.scan, ref))
        except (ValueError, TrainerError):
            raise
        except Exception as exc:  # a template that fails on this conversation
            raise ValueError(f"could not be rendered ({type(exc).__name__}: {exc})") from exc
        if not ids:
            raise ValueError("renders to no tokens")
        if len(ids) > self.settings.max_prompt_len:
            raise ValueError(
                f"{len(ids)} tokens, over max_prompt_len {self.settings.max_prompt_len}"
            )
        if max(ids) >= self.vocab:
            raise ValueError(f"token id {max(ids)} outside the target's vocabulary ({self.vocab})")
        return ids

    def generate_shard(self, index: int) -> tuple[dict[str, Any], str]:
        """Render, decode and write shard `index`; returns its header counts and an example."""
        size = self.settings.shard_size
        refs = self.scan.refs[index * size : (index + 1) * size]
        prompts: list[list[int]] = []
        skipped: list[str] = []
        for ref in refs:
            try:
                prompts.append(self._prompt(ref))
            except ValueError as exc:
                where = f"{self.scan.where(ref)}: {exc}"
                if self.strict:
                    raise prompt_file.PromptLineError(where) from exc
                log.warning("%sskipped %s", self.tag, where)
                skipped.append(where)
        prompts, answers = self._decode(index, prompts)
        samples, short, truncated = [], 0, 0
        for prompt, answer in zip(prompts, answers, strict=True):
            if len(answer) < 2:  # nothing a drafter could learn: no two supervised tokens
                short += 1
                continue
            truncated += answer[-1] not in self.eos
            samples.append((prompt + answer, [False] * len(prompt) + [True] * len(answer)))
        meta = {
            "prompts": len(refs),
            "skipped": skipped,
            "too_short": short,
            "truncated": truncated,
            "prompt_tokens": sum(len(s[0]) - sum(s[1]) for s in samples),
            "answer_tokens": sum(sum(s[1]) for s in samples),
        }
        write_shard(self.out / shard_name(index), samples, meta=meta)
        example = self._example(samples)
        return {**meta, "samples": len(samples)}, example

    def _decode(
        self, index: int, prompts: list[list[int]]
    ) -> tuple[list[list[int]], list[list[int]]]:
        """(prompts, answers) of shard `index`. With a sampled prefix, its tokens are moved to
        the end of the prompt (context, not supervised) and the answer is the greedy one after
        them; a prefix that ends the answer leaves it empty (counted as too short)."""
        gen = None
        if not self.sampling.greedy:
            gen = torch.Generator(device=self.device).manual_seed(_mix(self.settings.seed, index))
        prefix_len = self.settings.sampled_prefix
        if not prefix_len:
            return prompts, self._answers(prompts, self.sampling, gen, self.settings.max_new_tokens)
        prefixes = self._answers(prompts, self.sampling, gen, prefix_len)
        prompts = [p + x for p, x in zip(prompts, prefixes, strict=True)]
        live = [j for j, x in enumerate(prefixes) if len(x) == prefix_len and x[-1] not in self.eos]
        greedy = self._answers(
            [prompts[j] for j in live], Sampling(), None, self.settings.max_new_tokens - prefix_len
        )
        answers: list[list[int]] = [[] for _ in prompts]
        for j, answer in zip(live, greedy, strict=True):
            answers[j] = answer
        return prompts, answers

    def _answers(
        self,
        prompts: list[list[int]],
        sampling: Sampling,
        gen: torch.Generator | None,
        max_new_tokens: int,
    ) -> list[list[int]]:
        """The target's answers to `prompts`, decoded in batches of similar length."""
        answers: list[list[int]] = [[] for _ in prompts]
        for batch in length_batches([len(p) for p in prompts], self.batch_size):
            out = decode_batch(
                self.model,
                [prompts[j] for j in batch],
                max_new_tokens=max_new_tokens,
                eos_ids=self.eos,
                pad_id=self.pad_id,
                sampling=sampling,
                generator=gen,
                engine=self.engine,
            )
            for j, answer in zip(batch, out, strict=True):
                answers[j] = answer
        return answers

    def _example(self, samples: list[tuple[list[int], list[bool]]]) -> str:
        if not samples or self.decode_text is None:
            return ""
        ids, mask = samples[0]
        text = self.decode_text([t for t, m in zip(ids, mask, strict=True) if m])
        return text.replace("\n", "⏎")[:80]

    # ---- rank 0: the whole set ------------------------------------------------------------

    def wait_all(self) -> None:
        """Until every shard exists (the other ranks finish theirs; torchrun ends this one if a
        rank fails)."""
        last = time.monotonic()
        while len(finished_shards(self.out)) < self.num_shards:
            if time.monotonic() - last > 60:
                have = len(finished_shards(self.out))
                log.info("waiting for the other ranks: %d of %d shards", have, self.num_shards)
                last = time.monotonic()
            time.sleep(WAIT_POLL_S)

    def totals(self) -> dict[str, Any]:
        """Counts over every shard's header (this run's and earlier runs')."""
        keys = ("samples", "tokens", "prompts", "too_short", "truncated", "prompt_tokens",
                "answer_tokens")  # fmt: skip
        counts = dict.fromkeys(keys, 0)
        skipped: list[str] = []
        for path in finished_shards(self.out).values():
            header = Shard(path).header
            for k in keys:
                counts[k] += int(header.get(k, 0))
            skipped += header.get("skipped", [])
        counts["skipped"] = len(skipped)
        return {"counts": counts, "skipped_prompts": skipped[:1000]}


class Progress:
    """A progress line every `every` seconds: a bar, samples, answer tokens/s, ETA, an example."""

    def __init__(self, tag: str, *, total: int, every: float) -> None:
        self.tag, self.total, self.every = tag, total, every
        self.start = self.last = time.perf_counter()
        self.shards = self.samples = self.tokens = 0

    def shard_done(self, meta: dict[str, Any], example: str) -> None:
        self.shards += 1
        self.samples += meta["samples"]
        self.tokens += meta["answer_tokens"]
        now = time.perf_counter()
        if now - self.last >= self.every or self.shards == self.total:
            self.last = now
            log.info(self.line(now, example))

    def line(self, now: float, example: str) -> str:
        elapsed = max(now - self.start, 1e-9)
        frac = self.shards / self.total
        bar = "#" * int(20 * frac) + "." * (20 - int(20 * frac))
        eta = elapsed / self.shards * (self.total - self.shards)
        text = (
            f"{self.tag}generate [{bar}] {self.shards}/{self.total} shards | "
            f"{self.samples:,} samples | {self.tokens / elapsed:,.0f} tok/s | "
            f"ETA {_clock(eta)}"
        )
        return text + (f" | {example!r}" if example else "")

    def finish(self) -> None:
        elapsed = time.perf_counter() - self.start
        log.info(
            "%sgenerated %s samples, %s answer tokens in %s (%s tok/s)",
            self.tag, f"{self.samples:,}", f"{self.tokens:,}", _clock(elapsed),
            f"{self.tokens / max(elapsed, 1e-9):,.0f}",
        )  # fmt: skip


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
