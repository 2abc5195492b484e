"""How far rounding moves a target's logits between forward lengths: the scale behind the lossless
check's tie tolerance (`trainer/evaluation/lossless.py`).

    python bench/logit_rounding.py                 # CPU: random Qwen3s of 4 and 16 layers
    python bench/logit_rounding.py --device cuda   # the same on a GPU (its own kernels round)

Plain greedy decoding reads position L−1 from a forward over L tokens; speculative decoding reads
it from a longer verify forward. For each precision and depth this prints the largest change of
any logit at the same position between the two, relative to the best logit there (at least 1).
The lm_head is scaled so that the best logit is about 60, as peaked as a trained model's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import help_parser  # noqa: E402
from bench.eval_target import target_config  # noqa: E402
from trainer.evaluation.lossless import HALF_RTOL, TIE_RTOL  # noqa: E402
from trainer.model.target import Target  # noqa: E402


def random_target(layers: int, dtype: torch.dtype, device: str) -> Target:
    """A random Qwen3 of `layers` × 512 shaped as `bench_eval.py` shapes its target."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(target_config(512, layers, 4096, pad_token_id=0))
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    return Target(model.to(device=device, dtype=dtype), [0])


@torch.no_grad()
def largest_change(target: Target, *, trials: int = 3, length: int = 96) -> float:
    """max over positions and logits of |prefix forward − full forward| ÷ max(1, |best logit|)."""
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for _ in range(trials):
        seq = torch.randint(0, 4096, (1, length), generator=gen).to(target.device)
        full = target.logits(target(seq).last_hidden[0])
        for end in range(16, length, 9):
            part = target.logits(target(seq[:, :end]).last_hidden[0, -1])
            best = float(full[end - 1].max())
            change = float((part - full[end - 1]).abs().max())
            worst = max(worst, change / max(1.0, abs(best)))
    return worst


def main() -> None:
    p = help_parser(__doc__)
    p.add_argument("--device", default="cpu", help="cpu, or cuda: its kernels round their own way")
    p.add_argument("--layers", default="4,16", help="depths, comma-separated")
    args = p.parse_args()
    print("| layers | dtype | largest relative change | tie tolerance |")
    print("| --- | --- | --- | --- |")
    for layers in (int(n) for n in args.layers.split(",")):
        for dtype in (torch.float32, torch.bfloat16):
            change = largest_change(random_target(layers, dtype, args.device))
            tolerance = TIE_RTOL.get(dtype, HALF_RTOL)
            print(
                f"| {layers} | {str(dtype).removeprefix('torch.')} | {change:.2e} | {tolerance:g} |"
            )


if __name__ == "__main__":
    main()
