"""A seconds-long smoke test of the trainer's GPU path, run where the job will run.

    python -m trainer smoke           # a readable report
    python -m trainer smoke --json    # one JSON object (what `dflash doctor` reads)

It catches, before a multi-day run starts, the failures that only show at the place: a torch
without a working FlexAttention compile (eager flex materialises the full score matrix), a
broken Triton/compiler toolchain, a GPU without bf16, or numerics that drift. In order:

1. Random anchors/valid blocks at a small but realistic shape; the drafter's mask is built once
   (`build_draft_mask`: a compiled `create_block_mask` on CUDA).
2. One forward and backward of `draft_attention` (compiled FlexAttention on CUDA, bf16) feeding
   `dflash_loss` (the chunked lm_head loss with CE + KL + cap) — the two together, as in a step.
3. The same computation in float64 with the dense mask and plain softmax attention, and a
   float64 loss written out from full logits; loss and the q/k/v gradients are compared by
   relative error.
4. A second step is timed on its own (the first one includes compilation); peak memory is read.

On a machine without CUDA the CPU path runs instead (SDPA with the dense mask, float32, a
smaller shape): it still checks the numerics and reports `"cuda": false`. Whether that is a
failure is the caller's decision (it depends on how many GPUs the job expects).
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from trainer.loss.dflash_loss import IGNORE_INDEX, dflash_loss
from trainer.model.attention import build_draft_mask, draft_attention
from trainer.model.masks import batched_dense_mask


@dataclass(frozen=True, kw_only=True)
class Shape:
    """One smoke-test problem: batch, heads, head dim, context, blocks, block size, vocab."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int  # S, a multiple of 128 as the trainer buckets it
    blocks: int  # N per sequence
    block_size: int  # B
    vocab: int


CUDA_SHAPE = Shape(
    batch=2, heads=16, kv_heads=4, head_dim=128, context=1024, blocks=32, block_size=16, vocab=32768
)
CPU_SHAPE = Shape(
    batch=2, heads=4, kv_heads=2, head_dim=16, context=128, blocks=4, block_size=8, vocab=512
)
# Relative-error bounds against float64: bf16 inputs and bf16 logits on CUDA, fp32 on the CPU.
TOLERANCE = {"cuda": {"loss": 1e-2, "grad": 3e-2}, "cpu": {"loss": 1e-4, "grad": 1e-3}}
GAMMA, KL_WEIGHT, CAP_WEIGHT = 7.0, 0.15, 0.1


@dataclass(frozen=True, kw_only=True)
class Inputs:
    anchors: Tensor  # (Bsz, N) long, sorted per row
    valid: Tensor  # (Bsz, N) bool
    q: Tensor  # (Bsz, H, N·B, hd)
    k: Tensor  # (Bsz, Hkv, S + N·B, hd)
    v: Tensor  # (Bsz, Hkv, S + N·B, hd)
    weight: Tensor  # (V, H·hd) frozen lm_head
    target: Tensor  # (Bsz·N, B, H·hd) the target's hidden states (for KL)
    labels: Tensor  # (Bsz·N, B) long, IGNORE_INDEX where unsupervised


def make_inputs(shape: Shape, *, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Inputs:
    """Random inputs in float32 rounded to `dtype`, so the float64 reference sees the same values."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    s = shape
    q_len, kv_len, dim = (
        s.blocks * s.block_size,
        s.context + s.blocks * s.block_size,
        s.heads * s.head_dim,
    )
    anchors = torch.stack(
        [
            torch.randperm(s.context - 1, generator=g)[: s.blocks].sort().values + 1
            for _ in range(s.batch)
        ]
    )  # (Bsz, N): anchors in 1…S−1, so every block has some context
    valid = torch.rand(s.batch, s.blocks, generator=g) > 0.15
    valid[:, 0] = True

    def rnd(*size: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*size, generator=g) * scale).to(device=device, dtype=dtype)

    labels = torch.randint(0, s.vocab, (s.batch * s.blocks, s.block_size), generator=g)
    labels[torch.rand(labels.shape, generator=g) < 0.1] = IGNORE_INDEX
    labels[:, 0] = IGNORE_INDEX
    labels[~valid.reshape(-1)] = IGNORE_INDEX
    return Inputs(
        anchors=anchors.to(device),
        valid=valid.to(device),
        q=rnd(s.batch, s.heads, q_len, s.head_dim),
        k=rnd(s.batch, s.kv_heads, kv_len, s.head_dim),
        v=rnd(s.batch, s.kv_heads, kv_len, s.head_dim),
        weight=rnd(s.vocab, dim, scale=2.0 / math.sqrt(dim)),
        target=rnd(s.batch * s.blocks, s.block_size, dim, scale=float(s.head_dim) ** -0.5),
        labels=labels.to(device),
    )


def _to_hidden(out: Tensor, shape: Shape) -> Tensor:
    """(Bsz, H, N·B, hd) → (Bsz·N, B, H·hd): each block's slots with all heads concatenated."""
    bsz, heads, q_len, hd = out.shape
    return out.transpose(1, 2).reshape(bsz * shape.blocks, shape.block_size, heads * hd)


def step(inputs: Inputs, shape: Shape, mask: Any) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """The production path: draft_attention → dflash_loss, one backward. Returns loss, grads."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (inputs.q, inputs.k, inputs.v))
    out = draft_attention(q, k, v, mask)  # (Bsz, H, N·B, hd)
    loss = dflash_loss(
        _to_hidden(out, shape),
        inputs.weight,
        inputs.labels,
        gamma=GAMMA,
        target_hidden=inputs.target,
        kl_weight=KL_WEIGHT,
        cap_weight=CAP_WEIGHT,
    ).loss
    loss.backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return loss.detach(), (q.grad, k.grad, v.grad)


def reference_loss(hidden: Tensor, weight: Tensor, labels: Tensor, target: Tensor) -> Tensor:
    """The DFlash loss from full float64 logits (the definition in `trainer.loss.dflash_loss`), vectorised."""
    n, b, _ = hidden.shape
    logq = torch.log_softmax(hidden @ weight.t(), dim=-1)  # (N, B, V)
    logp = torch.log_softmax(target @ weight.t(), dim=-1)
    sup = labels != IGNORE_INDEX
    sup[:, 0] = False
    logq_y = logq.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)  # (N, B)
    slot = torch.arange(b, device=hidden.device, dtype=hidden.dtype)
    w = torch.exp(-(slot - 1) / GAMMA) * sup  # (N, B)
    total = w.sum()
    ce = -(w * logq_y).sum() / total
    kl = (w * (logp.exp() * (logp - logq)).sum(-1)).sum() / total
    pi = logq_y.exp() * sup  # an ignored slot breaks the chain
    chains = torch.cumprod(pi[:, 1:], dim=1).sum(1) / (b - 1)  # (N,)
    counted = sup[:, 1]
    cap = -chains[counted].mean() if bool(counted.any()) else hidden.new_zeros(())
    return (1 - KL_WEIGHT) * ce + KL_WEIGHT * kl + CAP_WEIGHT * cap


def reference_step(inputs: Inputs, shape: Shape) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """Float64 on the same device: dense mask, explicit softmax attention, the loss above."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (inputs.q, inputs.k, inputs.v))
    dense = batched_dense_mask(inputs.anchors, shape.context, shape.block_size, valid=inputs.valid)[
        :, None
    ]  # (Bsz, 1, Q, K)
    groups = shape.heads // shape.kv_heads
    kk, vv = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ kk.transpose(-1, -2)) / math.sqrt(shape.head_dim)  # (Bsz, H, Q, K)
    scores = scores.masked_fill(~dense, float("-inf"))
    seen = dense.any(-1, keepdim=True)  # rows of invalid blocks see nothing: output 0
    probs = torch.softmax(scores.masked_fill(~seen, 0.0), dim=-1) * seen
    out = probs @ vv  # (Bsz, H, Q, hd)
    loss = reference_loss(
        _to_hidden(out, shape), inputs.weight.double(), inputs.labels, inputs.target.double()
    )
    loss.backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return loss.detach(), (q.grad, k.grad, v.grad)


def rel_error(got: Tensor, want: Tensor) -> float:
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def run(*, force_cpu: bool = False) -> dict[str, Any]:
    """Run the smoke test; returns the report (never raises for a failed check)."""
    cuda = torch.cuda.is_available()
    use_cuda = cuda and not force_cpu
    device = torch.device("cuda" if use_cuda else "cpu")
    kind = "cuda" if use_cuda else "cpu"
    shape = CUDA_SHAPE if use_cuda else CPU_SHAPE
    dtype = torch.bfloat16 if use_cuda else torch.float32
    report: dict[str, Any] = {
        "ok": False,
        "cuda": cuda,
        "device": torch.cuda.get_device_name(0) if use_cuda else "cpu",
        "path": "compiled FlexAttention, bf16" if use_cuda else "SDPA with the dense mask, fp32",
        "torch": torch.__version__,
        "shape": asdict(shape),
    }
    try:
        inputs = make_inputs(shape, device=device, dtype=dtype)
        if use_cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        mask = build_draft_mask(
            inputs.anchors,
            inputs.valid,
            shape.context,
            shape.block_size,
            num_heads=shape.heads,
        )
        loss, grads = step(inputs, shape, mask)
        _sync(use_cuda)
        t1 = time.perf_counter()
        step(inputs, shape, mask)
        _sync(use_cuda)
        t2 = time.perf_counter()
        ref_loss, ref_grads = reference_step(inputs, shape)
        errors = {
            "loss": rel_error(loss, ref_loss),
            **{
                f"grad_{n}": rel_error(g, r)
                for n, g, r in zip("qkv", grads, ref_grads, strict=True)
            },
        }
        bounds = TOLERANCE[kind]
        failed = [
            name
            for name, err in errors.items()
            if not err <= bounds["loss" if name == "loss" else "grad"]
        ]
        report.update(
            ok=not failed,
            backend=mask.backend,
            loss=float(loss),
            reference_loss=float(ref_loss),
            rel_errors=errors,
            bounds=bounds,
            failed=failed,
            first_step_s=round(t1 - t0, 3),
            step_s=round(t2 - t1, 4),
            peak_mib=round(torch.cuda.max_memory_allocated() / 2**20, 1) if use_cuda else None,
        )
        if failed:
            report["error"] = "relative error above the bound for " + ", ".join(failed)
    except Exception as exc:  # reported, not raised: the caller reads one JSON object
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc(limit=8)
    return report


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer smoke", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--cpu", action="store_true", help="run the CPU path even with CUDA")
    args = parser.parse_args(argv)
    report = run(force_cpu=args.cpu)
    if args.json:
        print(json.dumps(report))
    else:
        print(_human(report))
    return 0 if report["ok"] else 1


def _human(report: dict[str, Any]) -> str:
    lines = [f"device: {report['device']} ({report['path']}), torch {report['torch']}"]
    if "rel_errors" in report:
        errs = ", ".join(f"{k} {v:.1e}" for k, v in report["rel_errors"].items())
        lines.append(f"relative errors vs float64: {errs}")
        lines.append(
            f"first step {report['first_step_s']} s (with compile), then {report['step_s']} s"
        )
        if report["peak_mib"] is not None:
            lines.append(f"peak memory {report['peak_mib']} MiB")
    if report.get("error"):
        lines.append(f"FAILED: {report['error']}")
    else:
        lines.append("ok")
    return "\n".join(lines)
