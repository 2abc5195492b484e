"""Measure what a drafter is worth: greedy block speculative decoding with the frozen target.

    python -m trainer.evaluate --config trainer/configs/demo.toml --checkpoint runs/demo \\
        --prompts prompts.jsonl --max-new-tokens 64 [--json]

Training accuracy can be high while serving acceptance is near 1 (an off-by-one between mask,
positions and labels does exactly that), so the drafter is judged by decoding with it, the way
an inference engine does, one prompt at a time:

1. prefill: the target runs over the prompt (positions 0…P−1); its selected hidden states are the
   context features and its greedy prediction at P−1 is the first new token, at position p = P;
2. draft: the drafter fills the block `[x_p, MASK, …, MASK]` (positions p…p+B−1) in one forward of
   `Drafter.forward` with a single anchor p — the same mask as in training
   (`trainer.masks.dense_mask`: the block sees the features of positions < p, and itself); slot k
   proposes x_{p+k};
3. verify: the target runs over the sequence with the B−1 draft tokens appended (one forward) and
   predicts g_1…g_B for positions p+1…p+B; the longest prefix of drafts equal to the target's
   predictions is accepted (a tokens), plus the target's own g_{a+1} (the bonus token);
4. the bonus token becomes the next anchor and the features of the accepted positions the new
   context; repeat until `max_new_tokens` new tokens or EOS.

The target recomputes the whole prefix at each verify (no KV cache): simple and obviously
correct, and cheap at the sizes this runs on. Reported: τ, the mean acceptance length (tokens
per verify forward, bonus included, as found by the verify pass even where the output is then
cut at the token budget or EOS); per-slot acceptance (the fraction of verify passes whose draft
at slot k was accepted, so τ = 1 + Σ_k rate_k); the speed-up in target forwards against plain
greedy decoding (one forward per new token); and, when asked, a lossless check against the
target's own greedy output computed by plain decoding — a difference raises `LosslessViolation`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.config import TrainConfigError
from trainer.data import Sample, bucket_length
from trainer.errors import TrainerError
from trainer.model import Drafter
from trainer.target import Target

# The folder of a checkpoints folder that finished runs are moved into (by `dflash`'s fresh
# deploys): it holds runs only.
ARCHIVE = "archive"

log = logging.getLogger(__name__)


class LosslessViolation(TrainerError):
    """Speculative decoding produced a token the target's own greedy decoding does not."""

    hint = (
        "Speculative decoding must reproduce the target exactly: a bug in the verify step, or "
        "numerics that change the target's argmax between forward lengths (see the logit margin)."
    )

    def __init__(
        self, *, prompt: int, position: int, expected: int | None, got: int | None, margin: float
    ) -> None:
        super().__init__(
            f"prompt {prompt}: new token {position} is {got} with speculative decoding, "
            f"{expected} with plain greedy decoding (target top-2 logit margin there: {margin:.3g})"
        )
        self.prompt = prompt
        self.position = position
        self.expected = expected
        self.got = got


class PromptFileError(TrainerError, ValueError):
    """A prompt file line is not in one of the training JSONL formats."""

    hint = (
        'Each line: {"input_ids": [...], "loss_mask": [...]} (the prompt is the unsupervised '
        'prefix) or {"messages": [{"role": ..., "content": ...}, ...]}.'
    )


class BlockDrafter(Protocol):
    """What the evaluator calls to draft one block."""

    block_size: int

    def draft(self, features: Tensor, input_ids: Tensor, anchor: int) -> Tensor:
        """features (1, anchor, n·H): the target's features of positions < anchor; input_ids
        (1, anchor + 1): the sequence up to the anchor token → (B−1,) long, the proposals for
        positions anchor+1 … anchor+B−1."""
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

    @torch.no_grad()
    def block_hidden(self, features: Tensor, input_ids: Tensor, anchor: int) -> Tensor:
        """The drafter's final hidden states of the block at `anchor` → (B, H): one training
        forward (`Drafter.forward`) with a single valid anchor."""
        device = features.device
        seq = bucket_length(anchor + 1, self.bucket)
        feats = F.pad(features, (0, 0, 0, seq - features.shape[1]))  # (1, S, n·H)
        ids = F.pad(input_ids, (0, seq - input_ids.shape[1]))  # (1, S)
        anchors = torch.tensor([[anchor]], device=device)  # (1, 1)
        valid = torch.ones_like(anchors, dtype=torch.bool)
        was_training, backend = self.drafter.training, self.drafter.attention_backend
        self.drafter.eval()
        self.drafter.attention_backend = self.backend
        autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
        )
        try:
            with autocast:
                hidden = self.drafter(feats, ids, anchors, valid, self.embed_weight)  # (1,1,B,H)
        finally:
            self.drafter.train(was_training)
            self.drafter.attention_backend = backend
        return hidden[0, 0]

    def draft(self, features: Tensor, input_ids: Tensor, anchor: int) -> Tensor:
        hidden = self.block_hidden(features, input_ids, anchor)  # (B, H)
        logits = hidden[1:].float() @ self.lm_head_weight.float().T  # (B−1, V)
        return logits.argmax(-1)


# ---- decoding --------------------------------------------------------------------------------


def _logits(target: Target, last_hidden: Tensor) -> Tensor:
    """(…, H) → (…, V) fp32 through the frozen lm_head."""
    return last_hidden.float() @ target.lm_head_weight.float().T


def _eos_ids(target: Target, eos: Sequence[int] | None) -> set[int]:
    if eos is not None:
        return set(eos)
    value = getattr(target.config, "eos_token_id", None)
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


def _cut(tokens: list[int], max_new: int, eos: set[int]) -> tuple[list[int], bool]:
    """Tokens up to the budget and the first EOS (kept); True when decoding is finished."""
    for i, tok in enumerate(tokens[:max_new]):
        if tok in eos:
            return tokens[: i + 1], True
    return tokens[:max_new], len(tokens) >= max_new


@torch.no_grad()
def greedy_decode(
    target: Target, prompt: Sequence[int], max_new_tokens: int, *, eos: Sequence[int] | None = None
) -> list[int]:
    """The target's own greedy output: one forward over the whole sequence per new token."""
    stop = _eos_ids(target, eos)
    ids = torch.tensor([list(prompt)], device=target.device)  # (1, L)
    new: list[int] = []
    while True:
        out = target(ids)
        tok = int(_logits(target, out.last_hidden[0, -1]).argmax())
        new, done = _cut([*new, tok], max_new_tokens, stop)
        if done:
            return new
        ids = torch.cat([ids, ids.new_tensor([[tok]])], dim=1)


@dataclass(frozen=True)
class PromptResult:
    tokens: list[int]  # the new tokens
    accepted: list[int]  # per verify pass: draft tokens accepted (0 … B−1), bonus not counted
    target_forwards: int  # prefill + verify passes


@torch.no_grad()
def speculative_decode(
    target: Target,
    drafter: BlockDrafter,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    eos: Sequence[int] | None = None,
) -> PromptResult:
    """Greedy block speculative decoding of one prompt (steps in the module docstring)."""
    if not prompt:
        raise ValueError("empty prompt")
    stop = _eos_ids(target, eos)
    b = drafter.block_size
    ids = torch.tensor([list(prompt)], device=target.device)  # (1, P)
    out = target(ids)  # prefill
    forwards = 1
    first = int(_logits(target, out.last_hidden[0, -1]).argmax())
    new, done = _cut([first], max_new_tokens, stop)
    features = out.features  # (1, P, n·H): context of the anchor at position P
    accepted: list[int] = []
    while not done:
        anchor = ids.shape[1]  # position of the newest token, not yet seen by the target
        ids = torch.cat([ids, ids.new_tensor([[new[-1]]])], dim=1)  # (1, anchor + 1)
        draft = drafter.draft(features, ids, anchor).to(ids.device)  # (B−1,)
        out = target(torch.cat([ids, draft[None]], dim=1))  # verify: (1, anchor + B)
        forwards += 1
        preds = _logits(target, out.last_hidden[0, anchor:]).argmax(-1)  # (B,) g_1 … g_B
        match = (draft == preds[: b - 1]).long()
        a = int(match.cumprod(0).sum())  # longest matching prefix
        accepted.append(a)
        gained = [*draft[:a].tolist(), int(preds[a])]
        new, done = _cut([*new, *gained], max_new_tokens, stop)
        ids = torch.cat([ids, ids.new_tensor([gained[:-1]])], dim=1)  # accepted drafts
        features = out.features[:, : ids.shape[1]]  # features of every confirmed position
    return PromptResult(tokens=new, accepted=accepted, target_forwards=forwards)


# ---- the report ------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalReport:
    tau: float  # mean acceptance length: tokens per verify forward, bonus included
    slot_acceptance: list[float]  # slots 1 … B−1: fraction of verify passes accepting slot k
    block_size: int
    prompts: int
    new_tokens: int
    verify_forwards: int
    target_forwards: int  # speculative: prefill + verify passes
    plain_forwards: int  # plain greedy decoding: one per new token
    speedup: float  # plain_forwards / target_forwards
    lossless_checked: bool

    def summary(self) -> str:
        slots = " ".join(f"{100 * r:.0f}" for r in self.slot_acceptance)
        check = "lossless" if self.lossless_checked else "lossless not checked"
        return (
            f"tau {self.tau:.3f} | accept% by slot {slots} | {self.new_tokens} tokens, "
            f"{self.target_forwards} target forwards vs {self.plain_forwards} plain "
            f"(x{self.speedup:.2f}) | {self.prompts} prompts, B={self.block_size} | {check}"
        )


def evaluate(
    target: Target,
    drafter: BlockDrafter,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    check_lossless: bool = True,
    eos: Sequence[int] | None = None,
) -> EvalReport:
    """Speculative decoding over `prompts`; with `check_lossless`, also plain greedy decoding
    of each prompt, and `LosslessViolation` on the first differing token."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be ≥ 1")
    if not prompts:
        raise ValueError("no prompts")
    b = drafter.block_size
    results = []
    for i, prompt in enumerate(prompts):
        res = speculative_decode(target, drafter, prompt, max_new_tokens, eos=eos)
        if check_lossless:
            _check_lossless(target, i, prompt, res.tokens, max_new_tokens, eos)
        results.append(res)
    accepted = [a for r in results for a in r.accepted]
    verifies = len(accepted)
    new_tokens = sum(len(r.tokens) for r in results)
    forwards = sum(r.target_forwards for r in results)
    slots = [sum(a >= k for a in accepted) / max(verifies, 1) for k in range(1, b)]
    return EvalReport(
        tau=(sum(accepted) + verifies) / verifies if verifies else float("nan"),
        slot_acceptance=slots,
        block_size=b,
        prompts=len(prompts),
        new_tokens=new_tokens,
        verify_forwards=verifies,
        target_forwards=forwards,
        plain_forwards=new_tokens,
        speedup=new_tokens / forwards,
        lossless_checked=check_lossless,
    )


def _check_lossless(
    target: Target,
    index: int,
    prompt: Sequence[int],
    got: list[int],
    max_new_tokens: int,
    eos: Sequence[int] | None,
) -> None:
    want = greedy_decode(target, prompt, max_new_tokens, eos=eos)
    if got == want:
        return
    pos = next(
        (j for j, (w, g) in enumerate(zip(want, got, strict=False)) if w != g),
        min(len(want), len(got)),
    )
    with torch.no_grad():
        seq = torch.tensor([[*prompt, *want[:pos]]], device=target.device)
        top2 = _logits(target, target(seq).last_hidden[0, -1]).topk(2).values
    raise LosslessViolation(
        prompt=index,
        position=pos,
        expected=want[pos] if pos < len(want) else None,
        got=got[pos] if pos < len(got) else None,
        margin=float(top2[0] - top2[1]),
    )


# ---- during training --------------------------------------------------------------------------


def split_holdout(samples: list[Sample], holdout: int) -> tuple[list[Sample], list[Sample]]:
    """(trained on, held out): the last `holdout` samples are kept out of training."""
    if holdout >= len(samples):
        raise TrainConfigError(
            "data.holdout", f"{holdout} would leave none of the {len(samples)} samples to train on"
        )
    cut = len(samples) - holdout
    return samples[:cut], samples[cut:]


class TauProbe:
    """τ of the drafter being trained, on a few held-out prompts (no lossless check: the
    speed-up is counted, and plain decoding would cost more than the probe itself)."""

    def __init__(self, target: Target, prompts: list[list[int]], *, max_new_tokens: int) -> None:
        self.target = target
        self.prompts = prompts
        self.max_new_tokens = max_new_tokens

    @classmethod
    def from_config(cls, config: Any, target: Target, held_out: list[Sample]) -> TauProbe | None:
        """None when `eval.every` is 0; prompts from `eval.prompts`, else the held-out samples."""
        ev = config.eval
        if not ev.every:
            return None
        if ev.prompts:
            prompts = load_prompts(
                ev.prompts, tokenizer_dir=config.model.target, limit=ev.num_prompts
            )
        else:
            prompts = [p for p in map(prompt_of_sample, held_out) if p][: ev.num_prompts]
            if not prompts:
                raise TrainConfigError("data.holdout", "no held-out sample has a prompt prefix")
        return cls(target, prompts, max_new_tokens=ev.max_new_tokens)

    def __call__(self, drafter: Drafter) -> EvalReport:
        block = DFlashDrafter(
            drafter,
            embed_weight=self.target.embed_weight,
            lm_head_weight=self.target.lm_head_weight,
        )
        return evaluate(
            self.target,
            block,
            self.prompts,
            max_new_tokens=self.max_new_tokens,
            check_lossless=False,
        )


# ---- prompts ---------------------------------------------------------------------------------


def prompt_of_sample(sample: Sample) -> list[int]:
    """The unsupervised prefix of a tokenized sample: what the model was given, not trained on."""
    end = next((i for i, m in enumerate(sample.loss_mask) if m), len(sample.loss_mask))
    return sample.input_ids[:end]


def load_prompts(
    path: str | Path, *, tokenizer_dir: str | Path | None = None, limit: int | None = None
) -> list[list[int]]:
    """Prompts from the training JSONL formats: tokenized lines give their unsupervised prefix;
    chat lines give the conversation up to (without) the last assistant turn, rendered with the
    target's chat template and the generation prompt (needs `tokenizer_dir`)."""
    prompts: list[list[int]] = []
    tokenizer = None
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptFileError(f"{where}: not JSON ({exc})") from exc
            if isinstance(row, dict) and "input_ids" in row:
                mask = row.get("loss_mask", [0] * len(row["input_ids"]))
                if len(mask) != len(row["input_ids"]):
                    raise PromptFileError(f"{where}: input_ids and loss_mask differ in length")
                prompt = prompt_of_sample(
                    Sample([int(t) for t in row["input_ids"]], [bool(m) for m in mask])
                )
            elif isinstance(row, dict) and isinstance(row.get("messages"), list):
                if tokenizer is None:
                    tokenizer = _tokenizer(tokenizer_dir, where)
                prompt = _chat_prompt(tokenizer, row["messages"])
            else:
                raise PromptFileError(f"{where}: expected input_ids or messages")
            if not prompt:
                raise PromptFileError(f"{where}: empty prompt (the first token is supervised)")
            prompts.append(prompt)
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise PromptFileError(f"{path}: no prompts")
    return prompts


def _tokenizer(folder: str | Path | None, where: str) -> Any:
    if folder is None:
        raise PromptFileError(f"{where}: chat prompts need the target's tokenizer folder")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    if messages and messages[-1].get("role") == "assistant":
        messages = messages[:-1]
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    return [int(t) for t in out]


# ---- checkpoint → drafter, and the entry point ------------------------------------------------


def load_drafter(config: Any, checkpoint: str | Path, target: Target) -> tuple[Drafter, int]:
    """The drafter of a checkpoint folder (`step-…`) or of the newest verified one in a run
    folder; refuses one written with other `model.*` settings."""
    from trainer import checkpoint as ckpt
    from trainer.config import diff_settings
    from trainer.model import shape_from_target

    path = Path(checkpoint)
    if (path / ckpt.STATE).is_file():
        manifest, why = ckpt.verify(path)
        if manifest is None:
            raise ckpt.CheckpointMismatch(path, [why])
    else:
        found = ckpt.find_resumable(path)
        if found.path is None:
            raise TrainerError(
                f"{path}: no verified checkpoint",
                hint="Pass a step-XXXXXXXX folder or the run folder training wrote to.",
            )
        path, manifest = found.path, found.manifest
    assert manifest is not None
    wanted = {k: v for k, v in config.model_data_settings().items() if k.startswith("model.")}
    saved = {k: v for k, v in manifest.settings.items() if k.startswith("model.")}
    changed = [k for k in diff_settings(saved, wanted) if k != "model.target"]
    if changed:
        raise ckpt.CheckpointMismatch(path, changed)
    shape = shape_from_target(target.config, config.model, num_features=len(target.layers))
    drafter = Drafter(shape).to(target.device)
    state = ckpt.load_state(path, map_location=target.device)
    drafter.load_state_dict(state["worker"]["drafter"])
    return drafter.eval(), manifest.step


def trained_in(run_dir: Path) -> Path:
    """The folder the run was trained in (its `--out`), so the demo assets are the ones the
    training built, beside it. An archived run (`<out>/archive/<UTC time>/`, where a fresh
    deploy moves the previous run) was trained in `<out>`: assets resolved from the run folder
    itself would land in `archive/`, where only runs belong."""
    if run_dir.parent.name == ARCHIVE:
        return run_dir.parent.parent
    return run_dir


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m trainer.evaluate", description=__doc__.split("\n")[0]
    )
    p.add_argument("--config", required=True, help="the training TOML (standalone or deploy.toml)")
    p.add_argument("--checkpoint", required=True, help="a step-XXXXXXXX folder or a run folder")
    p.add_argument("--prompts", required=True, help="JSONL: tokenized samples or chat messages")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts only")
    p.add_argument("--no-lossless-check", action="store_true", help="skip plain greedy decoding")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> EvalReport:
    from trainer.config import load_config
    from trainer.target import load_target
    from trainer.trainer import resolve_demo, resolve_device

    config = load_config(args.config, args.overrides)
    ckpt_path = Path(args.checkpoint)
    run_dir = ckpt_path.parent if ckpt_path.name.startswith("step-") else ckpt_path
    config = resolve_demo(config, trained_in(run_dir))
    if config.run.threads:
        torch.set_num_threads(config.run.threads)
    target = load_target(
        config.model.target,
        device=resolve_device(config.run.device),
        layers=config.model.target_layers,
        num_layers=config.model.num_target_layers,
    )
    drafter, step = load_drafter(config, ckpt_path, target)
    prompts = load_prompts(args.prompts, tokenizer_dir=config.model.target, limit=args.limit)
    log.info("evaluating step %d on %d prompts", step, len(prompts))
    block = DFlashDrafter(
        drafter, embed_weight=target.embed_weight, lm_head_weight=target.lm_head_weight
    )
    return evaluate(
        target,
        block,
        prompts,
        max_new_tokens=args.max_new_tokens,
        check_lossless=not args.no_lossless_check,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr, force=True)
    try:
        report = run(args)
    except TrainerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(report)) if args.json else report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
