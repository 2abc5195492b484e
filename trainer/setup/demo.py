"""A tiny random target and data it generated itself, built offline, so the whole path (target
loading, prepare, training, checkpoints) runs on a CPU with nothing downloaded.

- the target: a small Qwen3 (`transformers` config, random weights at an init scale chosen so
  its greedy continuations fall into context-dependent cycles: structured, learnable), saved with `save_pretrained`;
- a byte-level tokenizer with a ChatML template, built with `tokenizers`, saved beside it;
- `train.jsonl`: random prompts and the target's own greedy continuations, supervised on the
  continuation only — exactly what a drafter of this target can learn;
- `heldout.jsonl`: more of them, from other random prompts, never trained on: what
  `python -m trainer evaluate` (and `dflash eval`) decodes on the demo when no prompts are given.
A `complete.json` marker is written last; a folder without it is rebuilt (one from before the
held-out prompts only gets them).

    python -m trainer demo FOLDER     # build the assets into FOLDER
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainer.data.dataset import Sample, write_samples
from trainer.settings.config import DemoConfig

if TYPE_CHECKING:  # transformers loads only when the demo is built
    from transformers import Qwen3Config, Qwen3ForCausalLM

SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MARKER = "complete.json"
HELDOUT = "heldout.jsonl"
HELDOUT_PROMPTS = 16


def build_tokenizer(folder: str | Path) -> None:
    """A byte-level tokenizer (256 byte tokens + SPECIAL_TOKENS at ids 256…) with a ChatML
    template, saved with `save_pretrained`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>", mask_token="<|mask|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))


def target_config(config: DemoConfig) -> Qwen3Config:
    """The demo target's `transformers` config: known before the assets are built (the default
    split of a node is chosen from it, `trainer.split.split_shapes`)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.hidden_size // config.num_heads,
        max_position_embeddings=4096,
        initializer_range=config.init_std,
        tie_word_embeddings=False,
        pad_token_id=256,  # <|pad|>: a real row, used as the drafter's mask token by default
    )


def build_target(folder: str | Path, config: DemoConfig) -> Qwen3ForCausalLM:
    """A random tiny Qwen3 saved with `save_pretrained` (float32)."""
    from transformers import Qwen3ForCausalLM

    cfg = target_config(config)
    torch.manual_seed(config.seed)
    model = Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(str(folder))
    return model


@torch.no_grad()
def generate_samples(
    model: Qwen3ForCausalLM, config: DemoConfig, *, count: int | None = None, stream: int = 1
) -> list[Sample]:
    """Greedy continuations of `count` (default `num_samples`) random byte prompts; loss on the
    continuation. `stream` picks the random prompts: 1 the training data, 2 the held-out ones."""
    gen = torch.Generator().manual_seed(config.seed + stream)
    rows = config.num_samples if count is None else count
    prompts = torch.randint(0, 256, (rows, config.prompt_len), generator=gen)
    full = model.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        do_sample=False,
        max_new_tokens=config.gen_len,
        min_new_tokens=config.gen_len,
        pad_token_id=256,
    )  # (num_samples, prompt_len + gen_len)
    mask = [False] * config.prompt_len + [True] * config.gen_len
    return [Sample(row.tolist(), list(mask)) for row in full]


def write_heldout(folder: Path, model: Qwen3ForCausalLM, config: DemoConfig) -> Path:
    """`heldout.jsonl` in `folder`: the target's continuations of prompts it did not train on,
    written whole (a temporary file renamed into place)."""
    path = folder / HELDOUT
    tmp = path.with_name(f".{HELDOUT}.tmp-{os.getpid()}")
    write_samples(tmp, generate_samples(model.eval(), config, count=HELDOUT_PROMPTS, stream=2))
    os.replace(tmp, path)
    return path


def ensure_demo_assets(folder: str | Path, config: DemoConfig) -> tuple[Path, Path]:
    """Build (or reuse when complete and built from the same settings) → (target dir, data file)."""
    folder = Path(folder)
    target_dir, data_path = folder / "target", folder / "train.jsonl"
    wanted = {k: v for k, v in vars(config).items() if k not in ("enabled", "folder")}
    marker = folder / MARKER
    if marker.is_file():
        try:
            if json.loads(marker.read_text()) == wanted:
                if not (folder / HELDOUT).is_file():  # built before the held-out prompts
                    from transformers import Qwen3ForCausalLM

                    write_heldout(folder, Qwen3ForCausalLM.from_pretrained(target_dir), config)
                return target_dir, data_path
        except ValueError:  # torn or not UTF-8: rebuilt below
            pass
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model = build_target(tmp / "target", config)
    build_tokenizer(tmp / "target")
    write_samples(tmp / "train.jsonl", generate_samples(model, config))
    write_heldout(tmp, model, config)
    (tmp / MARKER).write_text(json.dumps(wanted, sort_keys=True))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return target_dir, data_path
