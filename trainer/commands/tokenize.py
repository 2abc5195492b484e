"""Tokenize chat or text JSONL with the target's tokenizer into tokenized JSONL, ahead of a run
(`data.path` then points at the output: the run skips its own tokenizing pass)."""

from __future__ import annotations

import argparse
import sys

from trainer.data.chat import TemplateOptions
from trainer.data.dataset import prepare
from trainer.settings.config import TrainConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer tokenize", description=__doc__.split("\n")[0]
    )
    parser.add_argument("source", help="chat ({'messages': …}) or text ({'text': …}) JSONL")
    parser.add_argument("tokenizer_dir", help="the target's folder (tokenizer, chat template)")
    parser.add_argument("out", help="tokenized JSONL to write")
    parser.add_argument("max_len", nargs="?", type=int, default=None)
    thinking = parser.add_mutually_exclusive_group()
    thinking.add_argument("--enable-thinking", dest="thinking", action="store_true", default=None)
    thinking.add_argument("--disable-thinking", dest="thinking", action="store_false")
    parser.add_argument("--system-prompt", default="", help="for conversations without one")
    args = parser.parse_args(argv)
    template = TemplateOptions(enable_thinking=args.thinking, system_prompt=args.system_prompt)
    try:
        n = prepare(
            args.source, args.tokenizer_dir, args.out, max_len=args.max_len, template=template
        )
    except TrainConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {n} samples to {args.out}")
    return 0
