"""The target's feature forward's memory: the selected layers kept by hooks (`trainer.model.target`,
what a run does) against `transformers`' `output_hidden_states=True` (every layer's output held
to the end), on one random Qwen3-shaped target, each in a process of its own.

    python bench/target_features_memory.py --out R.json            # the CPU: peak RSS
    python bench/target_features_memory.py --device cuda --layers 64 --hidden 5120 \\
        --intermediate 17408 --heads 40 --kv-heads 8 --tokens 49152 --out R.json

Per mode: the forward's peak above the memory held before it (the CPU: the process's peak RSS
less its RSS after the model was built; CUDA: `max_memory_allocated` less the allocated bytes
before), the features checked equal between the two. Also what the arithmetic says the hooks
save: (L + 1 − n) hidden states of tokens × hidden.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import environment, help_parser, write

MODES = ("hooks", "hidden_states")


def build(args: Any) -> Any:
    """A random Qwen3 of the given shape, in bf16 on CUDA, fp32 on the CPU."""
    from transformers import AutoConfig

    from trainer.model.target import load_target

    config = AutoConfig.for_model(
        "qwen3", vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=max(args.tokens, 4096),
    )  # fmt: skip
    return load_target(config, device=args.device, num_layers=args.features)


def resident() -> int:
    """This process's resident bytes now."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize()


def one_mode(args: Any) -> dict[str, Any]:
    """The forward of `args.mode` in this process: its peak above what was held before."""
    torch.manual_seed(0)
    target = build(args)
    device = torch.device(args.device)
    ids = torch.randint(1, args.vocab, (1, args.tokens), device=device)
    base = getattr(target.model, target.model.base_model_prefix)
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        before = resident()
    with torch.no_grad():
        if args.mode == "hooks":
            features = target(ids).features
        else:
            hs = base(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
            features = torch.cat([hs[i + 1] for i in target.layers], dim=-1)
            del hs
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {
        "mode": args.mode,
        "peak_extra_gib": peak / 2**30,
        "features_sum": float(features.double().sum()),
        "layers": target.layers,
    }


def main(argv: list[str] | None = None) -> int:
    p = help_parser(__doc__)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--layers", type=int, default=16, help="decoder layers of the target")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size")
    p.add_argument("--intermediate", type=int, default=1024, help="MLP width")
    p.add_argument("--heads", type=int, default=8, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    p.add_argument("--vocab", type=int, default=1000, help="vocabulary")
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the one sequence")
    p.add_argument("--features", type=int, default=5, help="target layers the drafter reads")
    p.add_argument("--mode", choices=MODES, default=None, help="(internal) one mode, in-process")
    p.add_argument("--out", default=None, help="the JSON record to write")
    args = p.parse_args(argv)
    if args.mode is not None:
        print(json.dumps(one_mode(args)))
        return 0
    rows = []
    for mode in MODES:  # each in a fresh process: a peak is a process's own
        run = subprocess.run(
            [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
             "--mode", mode],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
        print(f"{mode:>13}: {rows[-1]['peak_extra_gib']:.3f} GiB above the model", flush=True)
    same = rows[0]["features_sum"] == rows[1]["features_sum"]
    bytes_per = 2 if args.device.startswith("cuda") else 4
    held = (args.layers + 1 - args.features) * args.tokens * args.hidden * bytes_per
    result = {
        "env": environment(torch.device(args.device)),
        "shape": {k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads",
                                                 "kv_heads", "vocab", "tokens", "features")},
        "rows": rows,
        "features_equal": same,
        "saved_gib": rows[1]["peak_extra_gib"] - rows[0]["peak_extra_gib"],
        "arithmetic_saved_gib": held / 2**30,
    }  # fmt: skip
    print(f"saved {result['saved_gib']:.3f} GiB (arithmetic: {result['arithmetic_saved_gib']:.3f});"
          f" features equal: {same}")  # fmt: skip
    write(args.out, result)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
