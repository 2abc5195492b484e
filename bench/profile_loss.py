"""Kernel-level breakdown of one dflash_loss forward+backward at the benchmark size (CUDA).

python bench/profile_loss.py [--kl] [--chunk-rows N]
"""

from __future__ import annotations

import torch
from common import help_parser, repo_on_path

repo_on_path()

from bench_loss import GAMMA, KL_WEIGHT, REAL, UNIFORM, make_inputs  # noqa: E402

from trainer.loss import dflash_loss  # noqa: E402


def main() -> None:
    parser = help_parser(__doc__)
    parser.add_argument("--kl", action="store_true", help="the CE + KL loss (default: CE alone)")
    parser.add_argument(
        "--chunk-rows", type=int, default=None, help="rows per chunk (default: the loss's own)"
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    hidden, target, weight, labels = make_inputs(REAL, device, torch.bfloat16)

    def step():
        hidden.grad = None
        kw = (
            dict(target_hidden=target, kl_weight=KL_WEIGHT, gamma=GAMMA)
            if args.kl
            else dict(gamma=UNIFORM)
        )
        dflash_loss(hidden, weight, labels, chunk_rows=args.chunk_rows, **kw).loss.backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        step()
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70)
    )


if __name__ == "__main__":
    main()
