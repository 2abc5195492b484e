"""The drafter's attention at the seed's shape, side by side in one run.

    python bench/bench_attention.py --out attention.json          # one H200: the real shape
    python bench/bench_attention.py --smoke --out /tmp/att.json   # tiny shapes on the CPU

Rows: `draft_attention` (flex backend, as the trainer calls it), raw `torch.compile(
flex_attention)` over a hand-built BlockMask (compiled `create_block_mask`), SDPA with the dense
bool mask, and eager FlexAttention (refused by the dense-budget guard: the row reports the GiB
it would need). Columns: fwd+bwd ms (median after warm-up, CUDA events), peak GiB beyond the
inputs, and the BlockMask build time. Goal: ours within 1.05× of raw flex, mask build ≤ 5 ms; the
small-shared-memory kernels (forced) within 1.3× of ours.
"""

from __future__ import annotations

import argparse
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
    sync,
    time_ms,
)

repo_on_path()

from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402

from trainer.base.errors import DenseAttentionTooLarge  # noqa: E402
from trainer.model.attention import build_draft_mask, draft_attention, flex_kernels  # noqa: E402
from trainer.model.masks import batched_dense_mask  # noqa: E402


@dataclass(frozen=True)
class Shape:
    batch: int
    blocks: int
    block: int
    context: int
    heads: int
    head_dim: int

    @property
    def q_len(self) -> int:
        return self.blocks * self.block

    @property
    def kv_len(self) -> int:
        return self.context + self.q_len


SEED = Shape(batch=1, blocks=2048, block=16, context=49152, heads=32, head_dim=128)
SMOKE = Shape(batch=1, blocks=4, block=4, context=128, heads=2, head_dim=16)


def raw_mask_mod(anchors: torch.Tensor, context: int, block: int):
    """The same mask written by hand, all blocks valid: context before the anchor, own block."""

    def mask_mod(b, h, q_idx, kv_idx):
        n = q_idx // block
        return (kv_idx < anchors[b, n]) | ((kv_idx >= context) & ((kv_idx - context) // block == n))

    return mask_mod


def make_inputs(shape: Shape, device: torch.device, dtype: torch.dtype):
    g = torch.Generator(device=device).manual_seed(0)
    anchors = torch.randint(
        1, shape.context, (shape.batch, shape.blocks), generator=g, device=device
    )
    anchors = torch.sort(anchors, dim=1).values
    valid = torch.ones_like(anchors, dtype=torch.bool)
    size_q = (shape.batch, shape.heads, shape.q_len, shape.head_dim)
    size_kv = (shape.batch, shape.heads, shape.kv_len, shape.head_dim)
    q = torch.randn(size_q, generator=g, device=device, dtype=dtype).requires_grad_(True)
    k = torch.randn(size_kv, generator=g, device=device, dtype=dtype).requires_grad_(True)
    v = torch.randn(size_kv, generator=g, device=device, dtype=dtype).requires_grad_(True)
    grad = torch.randn(size_q, generator=g, device=device, dtype=dtype)
    return anchors, valid, (q, k, v), grad


def fwd_bwd(attend, leaves, grad):
    def clear():
        for t in leaves:
            t.grad = None

    def step():
        clear()
        attend(*leaves).backward(grad)

    step.clear = clear
    return step


def measure(name: str, step, device, args, **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"implementation": name, **extra}
    try:
        row["fwd+bwd ms"] = time_ms(step, device, warmup=args.warmup, reps=args.reps)
        step.clear()  # gradients of the inputs count towards the peak
        row["peak GiB"] = peak_gib(step, device)
    except Exception as exc:  # an OOM (or a backend that cannot run here) is a result
        if not is_oom(exc) and device.type == "cuda":
            raise
        row["note"] = "OOM" if is_oom(exc) else f"failed: {type(exc).__name__}"
    return row


def build_ms(build, device, args) -> float:
    return time_ms(build, device, warmup=args.warmup, reps=args.reps)


def flash_row(attention, block_mask, leaves, grad, device, args) -> dict[str, Any]:
    """Raw compiled flex over the same BlockMask with FlexAttention's CuTe-DSL backend
    (flash-attn-4): the row says why when this torch or flash-attn cannot run it."""
    name = "raw torch.compile(flex_attention), BACKEND='FLASH'"
    options = {"BACKEND": "FLASH"}
    step = fwd_bwd(
        lambda q, k, v: attention(q, k, v, block_mask=block_mask, kernel_options=options),
        leaves,
        grad,
    )
    try:
        row = measure(name, step, device, args)
        row["note"] = agreement(attention, block_mask, options, leaves, grad)
        return row
    except Exception as exc:  # an experimental backend that fails is a result
        return failed_row(name, exc)


def failed_row(name: str, exc: Exception) -> dict[str, Any]:
    """A row for a kernel that could not run here, with the reason (cut to 600 characters)."""
    return {"implementation": name, "note": f"failed: {type(exc).__name__}: {exc}"[:600]}


def agreement(attention, block_mask, options, leaves, grad) -> str:
    """Largest relative error of the output and of dq, dk, dv: `options`' kernel against the
    default (Triton) kernel on the same inputs."""

    def run(kernel_options):
        q, k, v = (t.detach().clone().requires_grad_(True) for t in leaves)
        out = attention(q, k, v, block_mask=block_mask, kernel_options=kernel_options)
        out.backward(grad)
        return [out.detach(), q.grad, k.grad, v.grad]

    errors = [
        float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
        for a, b in zip(run(options), run(None), strict=True)
    ]
    return "rel. error vs Triton out/dq/dk/dv " + " ".join(f"{e:.1e}" for e in errors)


def main() -> None:
    parser = help_parser(__doc__)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--reps", type=int, default=5, help="timed runs: the median is reported")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs first (compiles)")
    parser.add_argument("--no-sdpa", action="store_true", help="skip the dense SDPA row")
    parser.add_argument(
        "--flash",
        action="store_true",
        help="add raw flex rows with BACKEND='FLASH' (needs flash-attn-4 and nvidia-cutlass-dsl)",
    )
    args = parser.parse_args()

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    shape = SMOKE if args.smoke else SEED
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    anchors, valid, leaves, grad = make_inputs(shape, device, dtype)
    s, b = shape.context, shape.block
    rows: list[dict[str, Any]] = []
    flex_ok = device.type == "cuda"  # FlexAttention has no backward on the CPU

    # Ours, exactly as the trainer calls it.
    backend = "flex" if flex_ok else "sdpa"
    mask = build_draft_mask(anchors, valid, s, b, backend=backend, num_heads=shape.heads)
    ours = measure(
        f"draft_attention ({backend})",
        fwd_bwd(lambda q, k, v: draft_attention(q, k, v, mask), leaves, grad),
        device,
        args,
        **{
            "mask build ms": build_ms(
                lambda: build_draft_mask(
                    anchors, valid, s, b, backend=backend, num_heads=shape.heads
                ),
                device,
                args,
            )
        },
    )
    density = None
    if mask.block_mask is not None:
        density = 1.0 - mask.block_mask.sparsity() / 100.0
    rows.append(ours)

    def preset_row(preset: str) -> dict[str, Any]:
        """`draft_attention` with the flex kernel preset `preset` (`run.attention_kernels`)."""
        preset_mask = build_draft_mask(
            anchors, valid, s, b, backend="flex", num_heads=shape.heads, kernel_preset=preset
        )
        return measure(
            f"draft_attention (flex, {preset} kernels)",
            fwd_bwd(lambda q, k, v: draft_attention(q, k, v, preset_mask), leaves, grad),
            device,
            args,
        )

    if flex_ok:  # the tiles that fit ~100 KiB GPUs, forced here: goal within 1.3x of ours
        rows.append(preset_row("small"))
    if flex_ok and args.flash:  # the CuTe-DSL backend, as the trainer calls it
        try:
            rows.append(preset_row("flash"))
        except Exception as exc:  # not installed, or not this GPU: the row says so
            rows.append(failed_row("draft_attention (flex, flash kernels)", exc))

    # Raw compiled flex over a hand-built BlockMask: the figure to match.
    if flex_ok:
        raw_attention = torch.compile(flex_attention)
        raw_block_mask = torch.compile(create_block_mask)
        mod = raw_mask_mod(anchors, s, b)

        def raw_build():
            return raw_block_mask(mod, shape.batch, None, shape.q_len, shape.kv_len, device=device)

        block_mask = raw_build()
        rows.append(
            measure(
                "raw torch.compile(flex_attention)",
                fwd_bwd(
                    lambda q, k, v: raw_attention(q, k, v, block_mask=block_mask), leaves, grad
                ),
                device,
                args,
                **{"mask build ms": build_ms(raw_build, device, args)},
            )
        )
        try:
            sync(device)
            eager_ms = build_ms(
                lambda: create_block_mask(
                    mod, shape.batch, None, shape.q_len, shape.kv_len, device=device
                ),
                device,
                argparse.Namespace(warmup=1, reps=3),
            )
        except Exception as exc:
            if not is_oom(exc):
                raise
            eager_ms = None
        rows.append(
            {"implementation": "create_block_mask, not compiled", "mask build ms": eager_ms}
        )
        if args.flash:
            rows.append(flash_row(raw_attention, block_mask, leaves, grad, device, args))
    else:
        rows.append(
            {
                "implementation": "raw torch.compile(flex_attention)",
                "note": "skipped: no flex backward on the CPU",
            }
        )

    # SDPA with the dense bool mask of the whole batch.
    if not args.no_sdpa:
        try:
            dense = batched_dense_mask(anchors, s, b, valid=valid)[:, None]  # (Bsz, 1, Q, K)
            rows.append(
                measure(
                    "SDPA, dense bool mask",
                    fwd_bwd(
                        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
                        leaves,
                        grad,
                    ),
                    device,
                    args,
                    **{"mask GiB": dense.numel() / float(1 << 30)},
                )
            )
            del dense
        except Exception as exc:
            if not is_oom(exc):
                raise
            rows.append({"implementation": "SDPA, dense bool mask", "note": "OOM"})

    # Eager flex: the guard refuses it and says what it would cost.
    try:
        build_draft_mask(
            anchors,
            valid,
            s,
            b,
            backend="flex",
            num_heads=shape.heads,
            kernels=flex_kernels(compiled=False),
        )
        note = "within the dense budget (tiny shape)"
    except DenseAttentionTooLarge as exc:
        note = f"refused: would need {exc.needed_gib:.0f} GiB"
    rows.append({"implementation": "flex_attention, not compiled", "note": note})

    flop = 14.0 * shape.q_len * shape.kv_len * shape.head_dim * shape.heads * shape.batch
    summary: dict[str, Any] = {"block density": density, "dense fwd+bwd FLOP": flop}
    if density is not None:
        floor_ms = flop * density / (ANCHOR_TFLOPS * 1e12) * 1e3
        summary["floor ms at 790 TFLOP/s"] = floor_ms
        if ours.get("fwd+bwd ms"):
            summary["ours: fraction of floor"] = floor_ms / ours["fwd+bwd ms"]
    raw = next(
        (r for r in rows if r["implementation"].startswith("raw") and r.get("fwd+bwd ms")), None
    )
    if raw and ours.get("fwd+bwd ms"):
        summary["ours / raw flex"] = ours["fwd+bwd ms"] / raw["fwd+bwd ms"]
    flash_ours = next((r for r in rows if "flash kernels" in r["implementation"]), None)
    if flash_ours and flash_ours.get("fwd+bwd ms") and density is not None:
        summary["flash kernels: fraction of floor"] = floor_ms / flash_ours["fwd+bwd ms"]
        summary["ours / flash kernels"] = ours["fwd+bwd ms"] / flash_ours["fwd+bwd ms"]
    small_row = next((r for r in rows if "small kernels" in r["implementation"]), None)
    if small_row and small_row.get("fwd+bwd ms") and ours.get("fwd+bwd ms"):
        summary["small kernels / ours"] = small_row["fwd+bwd ms"] / ours["fwd+bwd ms"]

    report(
        args.out,
        title=f"shape {asdict(shape)} dtype {dtype} on {device}",
        shape=asdict(shape),
        dtype=dtype,
        device=device,
        rows=rows,
        columns=["implementation", "fwd+bwd ms", "peak GiB", "mask build ms", "mask GiB", "note"],
        summary=summary,
    )


if __name__ == "__main__":
    main()
