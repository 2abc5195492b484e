"""`python -m trainer VERB [options]`: the trainer's one entry. Each verb is one command module's
`main(argv)`, imported only when named, so `--help` and a mistyped verb load no torch.

    python -m trainer train --config train.toml --out runs/r1
    python -m trainer launch --standalone --nproc-per-node 8 -m trainer train --config …
    python -m trainer evaluate --config train.toml --checkpoint runs/r1 --prompts p.jsonl
"""

from __future__ import annotations

import importlib
import sys

# verb → (module, what it does)
VERBS: dict[str, tuple[str, str]] = {
    "train": ("trainer.commands.train", "train a drafter (one process, or a rank under torchrun)"),
    "launch": ("trainer.commands.launcher", "torchrun that exits 0 after a graceful stop"),
    "check": ("trainer.commands.check", "check a config, its target and data before a run"),
    "generate": ("trainer.generation.generate", "answer prompts with the target into shards"),
    "evaluate": ("trainer.evaluation.evaluate", "a drafter's acceptance length (τ) on prompts"),
    "export": ("trainer.export.folder", "a checkpoint as the folder the engines load"),
    "plan": ("trainer.commands.plan", "time each role and predict every GPU split"),
    "smoke": ("trainer.commands.smoke", "compiled attention and the loss against float64"),
    "tokenize": ("trainer.commands.tokenize", "chat or text JSONL into tokenized JSONL"),
    "demo": ("trainer.commands.demo", "write the demo's tiny target and its data"),
    "vllm-report": ("trainer.evaluation.vllm_report", "prompts through vLLM: its engine report"),
}


def usage() -> str:
    width = max(map(len, VERBS))
    rows = "\n".join(f"  {verb:<{width}}  {what}" for verb, (_, what) in VERBS.items())
    return (
        f"usage: python -m trainer VERB [options]\n\nverbs:\n{rows}\n\n"
        "python -m trainer VERB --help shows a verb's options."
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    verb, rest = args[0], args[1:]
    if verb not in VERBS:
        print(f"error: no verb {verb!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(VERBS[verb][0])
    code: int = module.main(rest)
    return code


if __name__ == "__main__":
    sys.exit(main())
