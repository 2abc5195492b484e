"""Sweep FlexAttention kernel options for the drafter's attention at the seed's shape.

    python bench/tune_attention.py --out tune.jsonl              # one GPU, ~8 minutes
    python bench/tune_attention.py --only default,small --out t  # some candidates only

Each candidate is a `kernel_options` dict (forward keys prefixed `fwd_`, backward keys `bwd_`)
passed to the same compiled `flex_attention` over the trainer's own BlockMask. For each: fwd and
fwd+bwd ms (median, CUDA events), peak GiB, the largest shared memory any of its Triton kernels
uses (read from the compiled kernels' metadata in a private inductor cache), and the relative
difference of output and input gradients to the default options. Rows are appended to `--out`
as JSON lines as they finish, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_attention import SEED, make_inputs
from common import ANCHOR_TFLOPS, help_parser, peak_gib, repo_on_path, time_ms

repo_on_path()

from torch.nn.attention.flex_attention import flex_attention  # noqa: E402

from trainer.model.attention import build_draft_mask  # noqa: E402


def fwd(bm: int, bn: int, stages: int, warps: int) -> dict[str, Any]:
    return {"fwd_BLOCK_M": bm, "fwd_BLOCK_N": bn, "fwd_num_stages": stages, "fwd_num_warps": warps}


def bwd(m1: int, n1: int, m2: int, n2: int, stages: int, warps: int) -> dict[str, Any]:
    return {
        "bwd_BLOCK_M1": m1,
        "bwd_BLOCK_N1": n1,
        "bwd_BLOCK_M2": m2,
        "bwd_BLOCK_N2": n2,
        "bwd_num_stages": stages,
        "bwd_num_warps": warps,
    }


CANDIDATES: dict[str, dict[str, Any]] = {
    "default": {},
    "small": {**fwd(64, 64, 2, 4), **bwd(32, 64, 64, 32, 2, 4)},
    "small-b": {**fwd(128, 32, 2, 4), **bwd(64, 64, 64, 64, 1, 4)},
    "fwd128x128s2": fwd(128, 128, 2, 8),
    "fwd-tma": {**fwd(128, 64, 3, 8), "fwd_USE_TMA": True},
    "fwd128x64s4": fwd(128, 64, 4, 8),
    "bwd64x64s3": bwd(64, 64, 64, 64, 3, 4),
    "bwd64x128s2": bwd(64, 128, 128, 64, 2, 8),
    "bwd32x128s3": bwd(32, 128, 128, 32, 3, 4),
    "bwd64x128s4": bwd(64, 128, 128, 64, 4, 8),
    "bwd-nowritedq": {"bwd_WRITE_DQ": False},
    "prescale": {"PRESCALE_QK": True},
}


def max_shared(cache: Path) -> int | None:
    """The largest `shared` (bytes) among the compiled Triton kernels' metadata in `cache`."""
    best = None
    for meta in cache.rglob("*.json"):
        try:
            data = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("shared"), int):
            best = max(best or 0, data["shared"])
    return best


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main() -> None:
    parser = help_parser(__doc__)
    parser.add_argument("--out", required=True, help="append JSON lines here")
    parser.add_argument("--only", help="comma-separated candidate names")
    parser.add_argument("--budget-s", type=float, default=480.0, help="start no candidate after")
    parser.add_argument("--reps", type=int, default=5, help="timed runs per candidate (median)")
    args = parser.parse_args()
    start = time.monotonic()
    torch._dynamo.config.recompile_limit = 1000
    torch._dynamo.config.accumulated_recompile_limit = 10000
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    env = {
        "torch": torch.__version__,
        "gpu": props.name,
        "capability": f"{props.major}.{props.minor}",
        "shared_memory_per_block_optin": getattr(props, "shared_memory_per_block_optin", None),
    }
    print(json.dumps(env), flush=True)
    shape = SEED
    anchors, valid, leaves, grad = make_inputs(shape, device, torch.bfloat16)
    mask = build_draft_mask(anchors, valid, shape.context, shape.block, backend="flex")
    assert mask.block_mask is not None
    density = 1.0 - mask.block_mask.sparsity() / 100.0
    flop = 14.0 * shape.q_len * shape.kv_len * shape.head_dim * shape.heads * density
    floor_ms = flop / (ANCHOR_TFLOPS * 1e12) * 1e3
    names = args.only.split(",") if args.only else list(CANDIDATES)
    reference: tuple[torch.Tensor, ...] | None = None
    with open(args.out, "a") as out:
        out.write(json.dumps({"env": env, "density": density, "floor_ms": floor_ms}) + "\n")
        for name in names:
            if time.monotonic() - start > args.budget_s:
                print(f"budget spent; skipping {name}", flush=True)
                continue
            options = CANDIDATES[name]
            cache = Path(tempfile.mkdtemp(prefix=f"inductor-{name}-"))
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
            os.environ["TRITON_CACHE_DIR"] = str(cache / "triton")
            torch._dynamo.reset()
            kernel = torch.compile(flex_attention)
            row: dict[str, Any] = {"name": name, "options": options}
            t0 = time.monotonic()

            def attend(q, k, v, kernel=kernel, options=options):
                return kernel(q, k, v, block_mask=mask.block_mask, kernel_options=options or None)

            def step():
                for t in leaves:
                    t.grad = None
                attend(*leaves).backward(grad)

            try:
                step()
                torch.cuda.synchronize()
                row["compile s"] = time.monotonic() - t0
                with torch.no_grad():
                    row["fwd ms"] = time_ms(
                        lambda: attend(*leaves), device, warmup=2, reps=args.reps
                    )
                row["fwd+bwd ms"] = time_ms(step, device, warmup=2, reps=args.reps)
                row["fraction of floor"] = floor_ms / row["fwd+bwd ms"]
                row["peak GiB"] = peak_gib(step, device)
                step()
                got = (attend(*leaves).detach(), *(t.grad.detach().clone() for t in leaves))
                if reference is None:
                    reference = got
                else:
                    row["rel diff out,dq,dk,dv"] = [
                        rel(a, b) for a, b in zip(got, reference, strict=True)
                    ]
                row["max shared bytes"] = max_shared(cache)
            except Exception as exc:  # an option set the kernel refuses is a result too
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
