"""The evaluation benchmark's target: a byte-level BPE tokenizer and a Qwen3-shaped causal LM
trained from scratch on the corpus's training files (`bench/eval_corpus.py`), saved in the work
folder with the corpus split it learnt, so that a later run can reuse it (`--reuse-target`) and is
refused if it asks for another split.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import log

SPECIAL = ["<|pad|>", "<|endoftext|>"]


# ---- tokenizer ------------------------------------------------------------------------------------


def build_tokenizer(texts: list[str], vocab_size: int, folder: Path) -> Any:
    """A byte-level BPE trained on `texts`, saved with `save_pretrained` into `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|endoftext|>"
    )
    fast.save_pretrained(str(folder))
    return fast


def encode(tokenizer: Any, texts: list[str]) -> torch.Tensor:
    """All texts as one long token stream, each followed by end-of-text → (T,) long."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for ids_one in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids += ids_one + [eos]
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, count: int, length: int, *, seed: int) -> torch.Tensor:
    """`count` random windows of `length` tokens → (count, length)."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - length, (count,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


# ---- the target --------------------------------------------------------------------------------


def target_config(
    hidden: int, layers: int, vocab: int, *, pad_token_id: int, eos_token_id: int | None = None
) -> Any:
    """The benchmark's target shape: a Qwen3 of `layers` × `hidden` with heads of 64, a quarter
    of them for keys and values, and an MLP of 8/3 × hidden."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
    )


def train_target(
    stream: torch.Tensor, tokenizer: Any, args: argparse.Namespace, device: torch.device
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A Qwen3-shaped causal LM trained from scratch for `args.target_steps` steps, or for
    `args.target_seconds` when that is 0 (AdamW, bf16 autocast on CUDA, warmup then cosine over
    the steps or the time). A step count gives the same target on every run and GPU; a time
    budget does not (its step count moves with the machine's speed and load)."""
    from transformers import Qwen3ForCausalLM

    cfg = target_config(
        args.target_hidden,
        args.target_layers,
        len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(device).train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=args.target_lr, betas=(0.9, 0.95), weight_decay=0.1
    )
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    gen = torch.Generator().manual_seed(1)
    seq, bsz, warmup = args.target_seq, args.target_batch, 50
    start, step, losses = time.perf_counter(), 0, []
    while True:
        if args.target_steps:
            frac = step / args.target_steps
        else:
            frac = (time.perf_counter() - start) / args.target_seconds
        if frac >= 1:
            break
        lr = min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = args.target_lr * lr
        starts = torch.randint(0, len(stream) - seq - 1, (bsz,), generator=gen)
        batch = torch.stack([stream[s : s + seq] for s in starts.tolist()]).to(device)
        with autocast:
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 100 == 0:
            losses.append(loss.item())
            log(f"target step {step} loss {losses[-1]:.3f}")
    model.eval()
    return model, {
        "steps": step,
        "seconds": time.perf_counter() - start,
        "final_loss": loss.item(),
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "config": {k: getattr(cfg, k) for k in ("hidden_size", "num_hidden_layers", "vocab_size")},
    }


# ---- the saved target and its split --------------------------------------------------------

SPLIT_FILE = "bench-corpus-split.json"  # beside the saved target: which files it learnt


def split_of(args: argparse.Namespace) -> dict[str, int]:
    return {key: getattr(args, key) for key in ("corpus_bytes", "holdout_every", "unseen_every")}


def saved_split(target_dir: Path) -> dict[str, int] | None:
    """The corpus split a saved target was trained with; None where no target is saved. A target
    saved before splits were recorded kept no file from training."""
    path = target_dir / SPLIT_FILE
    if path.is_file():
        return dict(json.loads(path.read_text()))
    return {"unseen_every": 0} if (target_dir / "config.json").is_file() else None


def check_split(target_dir: Path, args: argparse.Namespace) -> None:
    """Refuse a reused target with another corpus split: the held-out files could be ones it
    learnt, and "unseen" files too."""
    saved = saved_split(target_dir) or {}
    wanted = split_of(args)
    if any(saved.get(key, wanted[key]) != value for key, value in wanted.items()):
        raise SystemExit(
            f"--reuse-target: the target in {target_dir} was trained with the corpus split "
            f"{saved}, this run asks for {wanted}: pass the same --corpus-bytes, "
            "--holdout-every and --unseen-every, or train a target anew (no --reuse-target)"
        )


def target_and_tokenizer(
    args: argparse.Namespace, train_texts: list[str], device: torch.device
) -> tuple[Any, dict[str, Any]]:
    """(tokenizer, info) of the target in `--work/target`: trained here and saved, or the one a
    previous run saved (`--reuse-target`)."""
    target_dir = Path(args.work) / "target"
    if args.reuse_target:
        if not (target_dir / "config.json").is_file():
            raise SystemExit(f"--reuse-target: no saved target in {target_dir}; run once without")
        from transformers import AutoTokenizer

        check_split(target_dir, args)
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
        return tokenizer, {"reused": str(target_dir)}
    tokenizer = build_tokenizer(train_texts, args.vocab, target_dir)
    model, info = train_target(encode(tokenizer, train_texts), tokenizer, args, device)
    model.save_pretrained(str(target_dir))
    (target_dir / SPLIT_FILE).write_text(json.dumps(split_of(args)) + "\n")
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return tokenizer, info
