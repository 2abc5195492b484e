"""The τ probe of a training run: does what the drafter learns carry over to unseen prompts?

Every `eval.every` steps the drafter being trained decodes (greedy speculative decoding, see
`trainer.evaluation.evaluate`) three things, with no lossless check (plain decoding would cost more than
the probe itself):

1. the held-out prompts (`eval.prompts`, else the `data.holdout` samples): τ, the figure that
   matters;
2. a few prompts of the training samples, spread evenly over them (`eval.train_prompts`): when
   the data are the target's own outputs, decoding these replays contexts the drafter was trained
   on, so their τ follows the training accuracy;
3. once per run (the target is frozen): the baseline (`eval.baseline`, prompt lookup) on the
   held-out prompts, the floor the drafter must clear.

The drafter memorises its training data — the case the probe exists to catch — when
training-prompt τ > `eval.memorise_ratio` × held-out τ while held-out τ stays below the
baseline's τ + `eval.memorise_margin` (without a baseline: the first condition alone). The
trainer logs a warning then, and the metrics rows carry it for `dflash status`. The probe draws
no random numbers, so resume stays exact.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from trainer.data.chat import TemplateOptions
from trainer.data.dataset import Sample
from trainer.data.eval_prompts import load_prompts, prompt_of_sample
from trainer.evaluation.drafters import BlockDrafter, DFlashDrafter
from trainer.evaluation.prompt_lookup import baseline_drafter
from trainer.evaluation.report import EvalReport, evaluate
from trainer.model.drafter import Drafter
from trainer.model.target import Target
from trainer.settings.config import EvalConfig, TrainConfigError

MEMORISING = "the drafter memorises its training data: more data or fewer epochs"


@dataclass(frozen=True, kw_only=True)
class MemorisationRule:
    """When a probe says "memorising" (see the module docstring); ratio 0: never."""

    ratio: float = 1.25
    margin: float = 0.5

    def holds(self, held_out: float, train: float | None, baseline: float | None) -> bool:
        if not self.ratio or train is None or train <= self.ratio * held_out:
            return False
        return baseline is None or held_out < baseline + self.margin


@dataclass(frozen=True)
class ProbeReport:
    step: int
    held_out: EvalReport
    train: EvalReport | None  # None: eval.train_prompts = 0
    baseline: EvalReport | None  # None: eval.baseline = "none"
    memorising: bool

    @property
    def warning(self) -> str | None:
        if not self.memorising:
            return None
        assert self.train is not None
        figures = f"tau {self.train.tau:.2f} on training prompts, {self.held_out.tau:.2f} held out"
        if self.baseline is not None:
            figures += f", prompt lookup {self.baseline.tau:.2f}"
        return f"{MEMORISING} ({figures})"

    def log_fields(self) -> str:
        """` | tau 1.52 (95% 1.31–1.80; train 5.88, lookup 1.42)` for the step's log line: the
        interval because a probe's few prompts make a coarse gauge of what new prompts get."""
        extra = []
        if self.train is not None:
            extra.append(f"train {self.train.tau:.2f}")
        if self.baseline is not None:
            extra.append(f"lookup {self.baseline.tau:.2f}")
        figures = ", ".join(extra)
        if self.held_out.tau_interval is not None:
            lo, hi = self.held_out.tau_interval
            figures = f"95% {lo:.2f}–{hi:.2f}" + (f"; {figures}" if figures else "")
        return f" | tau {self.held_out.tau:.2f}" + (f" ({figures})" if figures else "")

    def to_json(self) -> str:
        """The whole report as JSON: how a split run's target rank hands it to the drafters."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str) -> ProbeReport:
        d = json.loads(raw)

        def report(r: dict | None) -> EvalReport | None:
            return None if r is None else EvalReport.from_dict(r)

        held = report(d["held_out"])
        assert held is not None
        return cls(d["step"], held, report(d["train"]), report(d["baseline"]), d["memorising"])

    def row(self) -> dict[str, Any]:
        """The `probe` entry of the metrics rows (the latest probe, repeated on later rows)."""
        return {
            "step": self.step,
            "tau": self.held_out.tau,
            "tau_interval": self.held_out.tau_interval,
            "tau_train": None if self.train is None else self.train.tau,
            "tau_prompt_lookup": None if self.baseline is None else self.baseline.tau,
            "memorising": self.memorising,
            "warning": self.warning,
        }


def spread(samples: Sequence[Sample], count: int) -> list[list[int]]:
    """The prompts of up to `count` samples picked evenly across `samples` (no random numbers)."""
    if count <= 0 or not samples:
        return []
    n, k = len(samples), min(count, len(samples))
    return [p for p in (prompt_of_sample(samples[i * n // k]) for i in range(k)) if p]


class TauProbe:
    """τ of the drafter being trained on held-out and training prompts, beside a baseline."""

    def __init__(
        self,
        target: Target,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        train_prompts: list[list[int]] | None = None,
        baseline: BlockDrafter | None = None,
        rule: MemorisationRule | None = None,
    ) -> None:
        self.target = target
        self.prompts = prompts
        self.max_new_tokens = max_new_tokens
        self.train_prompts = train_prompts or []
        self.baseline = baseline
        self.rule = rule or MemorisationRule()
        self._baseline_report: EvalReport | None = None

    @classmethod
    def of(
        cls,
        ev: EvalConfig,
        target: Target,
        held_out: Sequence[Sample],
        trained: Sequence[Sample] = (),
        *,
        tokenizer_dir: str,
        template: TemplateOptions,
        block_size: int,
    ) -> TauProbe | None:
        """The probe `[eval]` asks for (None when `eval.every` is 0): prompts from
        `eval.prompts` (rendered as `[data]` renders chats), else the held-out samples; training
        prompts spread over `trained`; the baseline at the drafter's `block_size`."""
        if not ev.every:
            return None
        if ev.prompts:
            prompts = load_prompts(
                ev.prompts, tokenizer_dir=tokenizer_dir, limit=ev.num_prompts, template=template
            )
        else:
            prompts = [p for p in map(prompt_of_sample, held_out) if p][: ev.num_prompts]
            if not prompts:
                raise TrainConfigError("data.holdout", "no held-out sample has a prompt prefix")
        base = baseline_drafter(
            ev.baseline, block_size, max_n=ev.lookup_max_n, min_n=ev.lookup_min_n
        )
        return cls(
            target,
            prompts,
            max_new_tokens=ev.max_new_tokens,
            train_prompts=spread(trained, ev.train_prompts),
            baseline=base,
            rule=MemorisationRule(ratio=ev.memorise_ratio, margin=ev.memorise_margin),
        )

    def _tau(self, drafter: BlockDrafter, prompts: list[list[int]]) -> EvalReport:
        return evaluate(
            self.target, drafter, prompts, max_new_tokens=self.max_new_tokens, check_lossless=False
        )

    def __call__(self, drafter: Drafter, *, step: int = 0) -> ProbeReport:
        block = DFlashDrafter(
            drafter,
            embed_weight=self.target.embed_weight,
            lm_head_weight=self.target.lm_head_weight,
        )
        held = self._tau(block, self.prompts)
        train = self._tau(block, self.train_prompts) if self.train_prompts else None
        if self.baseline is not None and self._baseline_report is None:
            self._baseline_report = self._tau(self.baseline, self.prompts)
        base = self._baseline_report
        memorising = self.rule.holds(
            held.tau, None if train is None else train.tau, None if base is None else base.tau
        )
        return ProbeReport(step, held, train, base, memorising)
