"""lm_head + loss forward+backward over a 248K vocabulary with a frozen lm_head, in one run.

    python bench/bench_loss.py --out loss.json          # one H200: N = 16,384, D = 5,120, V = 248,320
    python bench/bench_loss.py --smoke --out /tmp/l.json  # tiny shapes on the CPU

Rows: `dflash_loss` CE + KL (the DFlash configuration) and CE alone; the naive loss (full fp32
logits; it may run out of memory, which is reported); Liger's `LigerFusedLinearCrossEntropyLoss`
and Apple's Cut Cross-Entropy `linear_cross_entropy` (CE only; "not installed" when absent).
The CE-only rows all compute the same number: γ is huge so every supervised slot weighs 1, and
slot 0 is ignored for the peers too. Columns: ms (median after warm-up, CUDA events), peak GiB
beyond the inputs, gradient relative difference to the naive fp32 reference of the same loss,
and the fraction of the FLOP floor (2·N·D·V per GEMM: 2 GEMMs for CE, 3 for CE + KL, frozen
lm_head) at the GEMM rate measured in the same run. Goal: ≤ 1 GiB extra, faster than Liger.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from common import (
    ANCHOR_TFLOPS,
    help_parser,
    is_oom,
    peak_gib,
    repo_on_path,
    report,
    time_ms,
)

repo_on_path()

from trainer.loss.dflash_loss import IGNORE_INDEX, dflash_loss  # noqa: E402

UNIFORM = 1e12  # γ so large that every slot weighs 1: plain mean CE over supervised rows
GAMMA, KL_WEIGHT = 7.0, 0.15


@dataclass(frozen=True)
class Shape:
    blocks: int
    block: int
    hidden: int
    vocab: int

    @property
    def rows(self) -> int:
        return self.blocks * self.block


REAL = Shape(blocks=1024, block=16, hidden=5120, vocab=248320)
SMOKE = Shape(blocks=8, block=4, hidden=32, vocab=256)


def make_inputs(shape: Shape, device: torch.device, dtype: torch.dtype):
    g = torch.Generator(device=device).manual_seed(0)
    d = shape.hidden
    hidden = torch.randn(shape.blocks, shape.block, d, generator=g, device=device).to(dtype)
    target = (hidden.float() + 0.3 * torch.randn(hidden.shape, generator=g, device=device)).to(
        dtype
    )
    weight = (torch.randn(shape.vocab, d, generator=g, device=device) / math.sqrt(d) * 4).to(dtype)
    labels = torch.randint(0, shape.vocab, (shape.blocks, shape.block), generator=g, device=device)
    labels[:, 0] = IGNORE_INDEX
    return hidden.requires_grad_(True), target, weight, labels


def naive_loss(hidden, weight, labels, *, gamma, target=None, kl_weight=0.0):
    """Full [rows, V] fp32 logits, the definition with library ops."""
    d = hidden.shape[-1]
    slot = torch.arange(labels.shape[1], device=labels.device)
    w = (torch.exp(-(slot - 1) / gamma) * (labels != IGNORE_INDEX)).reshape(-1)  # (R,)
    logq = (hidden.reshape(-1, d) @ weight.t()).float().log_softmax(-1)  # (R, V)
    ce_rows = F.nll_loss(logq, labels.reshape(-1).clamp_min(0), reduction="none")
    loss = (1 - kl_weight) * (w * ce_rows).sum() / w.sum()
    if target is not None and kl_weight > 0:
        logp = (target.reshape(-1, d) @ weight.t()).float().log_softmax(-1)
        kl_rows = F.kl_div(logq, logp, log_target=True, reduction="none").sum(-1)
        loss = loss + kl_weight * (w * kl_rows).sum() / w.sum()
    return loss


def peers(device: torch.device) -> dict[str, Callable | str]:
    """CE-only peer losses as `fn(hidden2d, weight, labels1d) -> loss`, or why they are absent."""
    found: dict[str, Callable | str] = {}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
        found["Liger FusedLinearCrossEntropy (CE)"] = lambda h, w, y: liger(w, h, y)
    except ImportError:
        found["Liger FusedLinearCrossEntropy (CE)"] = "not installed"
    try:
        from cut_cross_entropy import linear_cross_entropy

        found["Cut Cross-Entropy (CE)"] = lambda h, w, y: linear_cross_entropy(
            h, w, y, ignore_index=IGNORE_INDEX
        )
    except ImportError:
        found["Cut Cross-Entropy (CE)"] = "not installed"
    if device.type != "cuda":
        found = {k: (v if isinstance(v, str) else "skipped: needs CUDA") for k, v in found.items()}
    return found


def gemm_tflops(shape: Shape, device, dtype, args) -> float | None:
    """The bf16 GEMM rate of this card at the logits shape, measured here."""
    if device.type != "cuda":
        return None
    a = torch.randn(shape.rows, shape.hidden, device=device, dtype=dtype)
    w = torch.randn(shape.vocab, shape.hidden, device=device, dtype=dtype)
    ms = time_ms(lambda: a @ w.t(), device, warmup=args.warmup, reps=args.reps)
    return 2.0 * shape.rows * shape.hidden * shape.vocab / (ms * 1e-3) / 1e12


def main() -> None:
    parser = help_parser(__doc__)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--reps", type=int, default=5, help="timed runs: the median is reported")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    parser.add_argument("--no-naive", action="store_true", help="skip the full-logits rows")
    parser.add_argument(
        "--sweep", default="", help="extra chunk sizes for our rows, e.g. 256,512,1024"
    )
    args = parser.parse_args()

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    shape = SMOKE if args.smoke else REAL
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden, target, weight, labels = make_inputs(shape, device, dtype)
    flat_h = hidden.view(-1, shape.hidden)
    flat_y = labels.reshape(-1)
    tflops = gemm_tflops(shape, device, dtype, args)
    gemm_flop = 2.0 * shape.rows * shape.hidden * shape.vocab

    def grad_of(loss_fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        hidden.grad = None
        loss_fn().backward()
        grad = hidden.grad.detach().float().clone()
        hidden.grad = None
        return grad

    # name, loss fn, GEMMs, reference key
    def ce_kl() -> torch.Tensor:
        return dflash_loss(
            hidden, weight, labels, gamma=GAMMA, target_hidden=target, kl_weight=KL_WEIGHT
        ).loss

    def ce() -> torch.Tensor:
        return dflash_loss(hidden, weight, labels, gamma=UNIFORM).loss

    candidates: list[tuple[str, Callable | str, int, str]] = [
        ("dflash_loss CE + KL (ours)", ce_kl, 3, "ce+kl"),
        ("dflash_loss CE (ours)", ce, 2, "ce"),
    ]
    for rows_per_chunk in [int(x) for x in args.sweep.split(",") if x]:

        def ce_kl_at(n=rows_per_chunk) -> torch.Tensor:
            return dflash_loss(
                hidden,
                weight,
                labels,
                gamma=GAMMA,
                target_hidden=target,
                kl_weight=KL_WEIGHT,
                chunk_rows=n,
            ).loss

        def ce_at(n=rows_per_chunk) -> torch.Tensor:
            return dflash_loss(hidden, weight, labels, gamma=UNIFORM, chunk_rows=n).loss

        candidates += [
            (f"dflash_loss CE + KL (ours, chunk {rows_per_chunk})", ce_kl_at, 3, "ce+kl"),
            (f"dflash_loss CE (ours, chunk {rows_per_chunk})", ce_at, 2, "ce"),
        ]
    if not args.no_naive:
        candidates += [
            (
                "naive fp32 logits CE + KL",
                lambda: naive_loss(
                    hidden, weight, labels, gamma=GAMMA, target=target, kl_weight=KL_WEIGHT
                ),
                3,
                "ce+kl",
            ),
            (
                "naive fp32 logits CE",
                lambda: naive_loss(hidden, weight, labels, gamma=UNIFORM),
                2,
                "ce",
            ),
        ]
    for name, fn in peers(device).items():
        candidates.append(
            (
                name,
                fn if isinstance(fn, str) else (lambda fn=fn: fn(flat_h, weight, flat_y)),
                2,
                "ce",
            )
        )

    # References: the naive loss on fp32 copies of the inputs (fp32 logits, no bf16 rounding
    # anywhere) when it fits, else dflash_loss on those copies.
    refs: dict[str, torch.Tensor] = {}
    ref_source: dict[str, str] = {}
    w32, t32 = weight.float(), target.float()
    for key, gamma, kl in (("ce+kl", GAMMA, KL_WEIGHT), ("ce", UNIFORM, 0.0)):
        h32 = hidden.detach().float().requires_grad_(True)
        try:
            naive_loss(h32, w32, labels, gamma=gamma, target=t32, kl_weight=kl).backward()
            ref_source[key] = "naive, fp32 inputs"
        except Exception as exc:
            if not is_oom(exc):
                raise
            h32.grad = None
            torch.cuda.empty_cache()
            dflash_loss(
                h32, w32, labels, gamma=gamma, target_hidden=t32 if kl else None, kl_weight=kl
            ).loss.backward()
            ref_source[key] = "dflash_loss, fp32 inputs"
        refs[key] = h32.grad
    del w32, t32
    if device.type == "cuda":
        torch.cuda.empty_cache()

    rows: list[dict[str, Any]] = []
    for name, fn, gemms, ref_key in candidates:
        row: dict[str, Any] = {"implementation": name, "GEMMs": gemms}
        if isinstance(fn, str):
            row["note"] = fn
            rows.append(row)
            continue

        def step(fn=fn):
            hidden.grad = None
            fn().backward()

        try:
            row["ms"] = time_ms(step, device, warmup=args.warmup, reps=args.reps)
            row["peak extra GiB"] = peak_gib(step, device)
            got = grad_of(fn)
            want = refs[ref_key]
            row["grad rel diff"] = float((got - want).norm() / want.norm())
        except Exception as exc:
            if not is_oom(exc):
                raise
            row["note"] = "OOM"
            hidden.grad = None
            torch.cuda.empty_cache()
        if tflops and row.get("ms"):
            floor = gemms * gemm_flop / (tflops * 1e12) * 1e3
            row["floor ms"] = floor
            row["fraction of floor"] = floor / row["ms"]
        rows.append(row)

    summary = {
        "GEMM FLOP (2·N·D·V)": gemm_flop,
        "measured bf16 GEMM TFLOP/s": tflops,
        "anchor TFLOP/s": ANCHOR_TFLOPS,
        "reference": ref_source,
    }
    report(
        args.out,
        title=f"shape {asdict(shape)} dtype {dtype} on {device}, lm_head frozen",
        shape=asdict(shape),
        dtype=dtype,
        device=device,
        rows=rows,
        columns=[
            "implementation",
            "ms",
            "peak extra GiB",
            "grad rel diff",
            "GEMMs",
            "floor ms",
            "fraction of floor",
            "note",
        ],
        summary=summary,
    )


if __name__ == "__main__":
    main()
