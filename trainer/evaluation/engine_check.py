"""An engine's report (`trainer.evaluation.engine_report`) held against the project's decoding of the same
prompts: where an engine serves the drafter differently than it was trained and measured.

For each request, in this order:
1. the target's greedy output (`trainer.evaluation.speculative.greedy_outputs`, the engine's budget and
   stop tokens) against the engine's output: an engine that serves a drafter must return
   exactly what the target alone returns (lossless);
2. with a drafter, the project's greedy block speculative decoding
   (`trainer.evaluation.speculative.speculative_decode_many`) with the block the engine drafted — K + 1
   slots for its `num_speculative_tokens` K; the drafter was trained with B, and since the block
   attends to itself both ways another K proposes other tokens — and its accepted count per
   verify step against the engine's, step for step.
Both sides count a verify step's accepted drafts before the output is cut at the budget, so the
counts of a request agree exactly when the engine computes the drafter's function.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from trainer.evaluation.drafters import DFlashDrafter
from trainer.evaluation.engine_report import EngineRequest
from trainer.evaluation.speculative import (
    BATCH_TOKENS,
    greedy_outputs,
    prompt_batches,
    speculative_decode_many,
)
from trainer.model.target import Target


@dataclass(frozen=True)
class Parting:
    """Where a request's engine and project sequences first differ: at `at`, the engine has
    `engine`, the project `project` (None: that sequence ended there)."""

    at: int
    engine: int | None
    project: int | None


@dataclass(frozen=True)
class RequestCheck:
    index: int  # the request's line in the report, from 0
    output: Parting | None  # engine output vs the target's greedy output
    accepted: Parting | None  # engine vs project accepted counts, by verify step
    engine_accepted: list[int] | None
    project_accepted: list[int] | None


@dataclass(frozen=True)
class EngineComparison:
    requests: list[RequestCheck]
    block_size: int  # B, as trained
    num_speculative_tokens: int | None  # K the engine drafted; None: no drafter
    engine_tau: float | None
    project_tau: float | None

    @property
    def agree(self) -> bool:
        return all(r.output is None and r.accepted is None for r in self.requests)

    def summary(self) -> str:
        n = len(self.requests)
        same_out = sum(r.output is None for r in self.requests)
        lines = [f"outputs: {same_out}/{n} equal to the target's greedy decoding"]
        if self.num_speculative_tokens is not None:
            lines.append(self._acceptance_line())
        for r in self.requests:
            lines += _partings(r)
        lines.append("engine and project agree" if self.agree else "engine and project part")
        return "\n".join(lines)

    def _acceptance_line(self) -> str:
        k, b = self.num_speculative_tokens or 0, self.block_size
        checked = [r for r in self.requests if r.engine_accepted is not None]
        same = sum(r.accepted is None for r in checked)
        engine, project = self.engine_tau or float("nan"), self.project_tau or float("nan")
        line = (
            f"acceptance: {same}/{len(checked)} requests equal step for step | engine tau "
            f"{engine:.4f}, project tau {project:.4f} (ratio {engine / project:.4f}) | K = {k}"
        )
        if k != b - 1:
            line += (
                f": not the drafter as trained (B = {b}; the project decoded with a block of "
                f"{k + 1} as the engine did) — serve it with num_speculative_tokens = {b - 1}"
            )
        return line

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "agree": self.agree}


def _partings(r: RequestCheck) -> list[str]:
    out = []
    if r.output is not None:
        p = r.output
        out.append(
            f"request {r.index}: output parts at new token {p.at} "
            f"(engine {_token(p.engine)}, target's greedy {_token(p.project)})"
        )
    if r.accepted is not None:
        p = r.accepted
        out.append(
            f"request {r.index}: acceptance parts at verify step {p.at} "
            f"(engine accepted {_token(p.engine)}, project {_token(p.project)})"
        )
    return out


def _token(value: int | None) -> str:
    return "nothing more" if value is None else str(value)


def parting(engine: Sequence[int], project: Sequence[int]) -> Parting | None:
    """The first index where the two sequences differ (one ending counts), or None."""
    for i in range(max(len(engine), len(project))):
        e = engine[i] if i < len(engine) else None
        p = project[i] if i < len(project) else None
        if e != p:
            return Parting(i, e, p)
    return None


def check_engine(
    target: Target,
    drafter: DFlashDrafter,
    requests: Sequence[EngineRequest],
    *,
    expected: Sequence[list[int]] | None = None,
    batch_tokens: int = BATCH_TOKENS,
) -> EngineComparison:
    """Each request of an engine report against the project's decoding (steps in the module
    docstring); requests of one budget and stop tokens are decoded together. `expected`: the
    target's greedy outputs of the requests when already decoded (several reports of the same
    prompts are checked against one greedy decoding)."""
    prompts = [r.prompt for r in requests]
    served = [i for i, r in enumerate(requests) if r.accepted is not None]
    k = requests[served[0]].num_speculative_tokens if served else None

    def greedy(idx: list[int], n: int, eos: list[int]) -> list[list[int]]:
        chosen = [prompts[i] for i in idx]
        return greedy_outputs(target, chosen, n, eos=eos, batch_tokens=batch_tokens)

    def accepted(idx: list[int], n: int, eos: list[int]) -> list[list[int]]:
        assert k is not None
        return accepted_counts(
            target, drafter_at(drafter, k + 1), [prompts[i] for i in idx], n,
            eos=eos, batch_tokens=batch_tokens,
        )  # fmt: skip

    if expected is not None and len(expected) != len(requests):
        raise ValueError(f"{len(expected)} expected outputs for {len(requests)} requests")
    outputs = (
        dict(enumerate(expected))
        if expected is not None
        else _by_group(requests, range(len(requests)), greedy)
    )
    project = _by_group(requests, served, accepted) if served else {}
    checks = [
        RequestCheck(
            index=i,
            output=parting(r.output, outputs[i]),
            accepted=None if r.accepted is None else parting(r.accepted, project[i]),
            engine_accepted=r.accepted,
            project_accepted=project.get(i),
        )
        for i, r in enumerate(requests)
    ]
    return EngineComparison(
        checks,
        block_size=drafter.block_size,
        num_speculative_tokens=k,
        engine_tau=tau([requests[i].accepted or [] for i in served]) if served else None,
        project_tau=tau([project[i] for i in served]) if served else None,
    )


def drafter_at(drafter: DFlashDrafter, block: int) -> DFlashDrafter:
    """The same weights drafting a block of `block` slots (an engine's K + 1): the block size is
    no parameter shape, only how many slots one forward fills."""
    if block == drafter.block_size:
        return drafter
    module = copy.copy(drafter.drafter)  # shares the parameters
    module.shape = replace(module.shape, block_size=block)
    return DFlashDrafter(
        module, embed_weight=drafter.embed_weight, lm_head_weight=drafter.lm_head_weight
    )


def accepted_counts(
    target: Target,
    drafter: DFlashDrafter,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos: Sequence[int],
    batch_tokens: int = BATCH_TOKENS,
) -> list[list[int]]:
    """Each prompt's accepted drafts per verify step in the project's speculative decoding."""
    out: list[list[int]] = []
    for batch in prompt_batches(prompts, max_new_tokens + drafter.block_size, batch_tokens):
        chunk = [prompts[i] for i in batch]
        out += [
            d.accepted
            for d in speculative_decode_many(target, drafter, chunk, max_new_tokens, eos=eos)
        ]
    return out


Decode = Callable[[list[int], int, list[int]], list[list[int]]]


def _by_group(
    requests: Sequence[EngineRequest], indices: Iterable[int], decode: Decode
) -> dict[int, list[int]]:
    """`decode(indices, max_tokens, eos)` once per (budget, stop tokens) group → by index."""
    groups: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for i in indices:
        groups.setdefault((requests[i].max_tokens, requests[i].eos), []).append(i)
    found: dict[int, list[int]] = {}
    for (n, eos), idx in groups.items():
        found.update(zip(idx, decode(idx, n, list(eos)), strict=True))
    return found


def tau(accepted: Sequence[Sequence[int]]) -> float:
    """The mean acceptance length of these verify steps: 1 + accepted drafts per step."""
    steps = [a for req in accepted for a in req]
    return 1.0 + sum(steps) / len(steps) if steps else float("nan")
