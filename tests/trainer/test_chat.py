"""Chat and text data given directly as `data.path`: tokenized with a real (byte-level) tokenizer
and real Jinja chat templates built here, cached next to the checkpoints, reported.

The supervised spans are decoded and compared with the assistant turns as written: a template
that strips `<think>` from earlier turns gives one sample per turn, each supervised on its own
turn only; `enable_thinking` reaches the template; bad lines are dropped with file:line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from trainer.data.chat import DEFAULT_TEMPLATE, TemplateOptions, load_tokenizer
from trainer.data.dataset import load_data, load_samples, prepare
from trainer.data.formats import DataFileError, Sample
from trainer.setup.demo import build_tokenizer

END = "<|im_end|>\n"
# Like Qwen3's: assistant turns before the last user message lose their <think>…</think>.
STRIP_THINK = (
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last and '</think>' in m['content'] %}"
    "{{ m['content'].split('</think>')[-1].lstrip() }}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# An empty think block opens the assistant turn when enable_thinking is false.
THINKING = (
    "{% set off = enable_thinking is defined and enable_thinking is false %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and off %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if off %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def tokenizer_dir(tmp_path: Path, template: str | None = None) -> Path:
    folder = tmp_path / "target"
    build_tokenizer(folder)
    if template is not None:
        tok = load_tokenizer(folder)
        tok.chat_template = template
        tok.save_pretrained(str(folder))
    return folder


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def supervised_text(folder: Path, sample: Sample) -> list[str]:
    """The decoded supervised spans of a sample, one string per contiguous run."""
    tok = load_tokenizer(folder)
    spans, run = [], []
    for t, m in zip(sample.input_ids, sample.loss_mask, strict=True):
        if m:
            run.append(t)
        elif run:
            spans.append(tok.decode(run))
            run = []
    if run:
        spans.append(tok.decode(run))
    return spans


def chat(*turns: str, system: str | None = None) -> dict[str, Any]:
    msgs = [{"role": "system", "content": system}] if system else []
    for i, text in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"messages": msgs}


def test_chat_jsonl_is_trained_on_directly_supervising_assistant_turns(tmp_path: Path) -> None:
    folder = tokenizer_dir(tmp_path)
    data = write_jsonl(tmp_path / "chat.jsonl", [chat("hi", "hello", "bye", "ok")])
    lines: list[str] = []
    (sample,) = load_samples(data, tokenizer_dir=folder, emit=lines.append)
    assert supervised_text(folder, sample) == ["hello" + END, "ok" + END]
    tok = load_tokenizer(folder)
    assert tok.decode(sample.input_ids) == (
        "<|im_start|>user\nhi" + END + "<|im_start|>assistant\nhello" + END
        + "<|im_start|>user\nbye" + END + "<|im_start|>assistant\nok" + END
    )  # fmt: skip
    assert lines[0].startswith(f"data {data} (chat): 1 samples, ")


def test_a_template_stripping_earlier_thinking_gives_one_sample_per_turn(tmp_path: Path) -> None:
    folder = tokenizer_dir(tmp_path, STRIP_THINK)
    a1, a2 = "<think>r1</think>a1", "<think>r2</think>a2"
    data = write_jsonl(tmp_path / "chat.jsonl", [chat("q1", a1, "q2", a2)])
    lines: list[str] = []
    first, second = load_samples(data, tokenizer_dir=folder, emit=lines.append)
    assert supervised_text(folder, first) == [a1 + END]
    assert supervised_text(folder, second) == [a2 + END]
    tok = load_tokenizer(folder)
    # the second turn is trained in the context the template gives it: earlier thinking stripped
    assert tok.decode(second.input_ids).startswith(
        "<|im_start|>user\nq1" + END + "<|im_start|>assistant\na1" + END
    )
    assert any("1 conversations rendered one sample per assistant turn" in x for x in lines)


def test_enable_thinking_and_the_system_prompt_reach_the_template(tmp_path: Path) -> None:
    folder = tokenizer_dir(tmp_path, THINKING)
    data = write_jsonl(tmp_path / "chat.jsonl", [chat("q", "a")])
    tok = load_tokenizer(folder)
    (plain,) = load_samples(data, tokenizer_dir=folder)
    assert "<think>" not in tok.decode(plain.input_ids)
    off = TemplateOptions(enable_thinking=False, system_prompt="be brief")
    (sample,) = load_samples(data, tokenizer_dir=folder, template=off)
    text = tok.decode(sample.input_ids)
    assert text.startswith("<|im_start|>system\nbe brief" + END)
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\na" + END in text
    assert supervised_text(folder, sample) == ["a" + END]  # the empty think block is prompt


def test_text_lines_are_supervised_everywhere(tmp_path: Path) -> None:
    folder = tokenizer_dir(tmp_path)
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": "plain text, all of it"}])
    (sample,) = load_samples(data, tokenizer_dir=folder)
    assert supervised_text(folder, sample) == ["plain text, all of it"]


def test_the_report_counts_truncation_and_names_dropped_lines(tmp_path: Path) -> None:
    folder = tokenizer_dir(tmp_path)
    rows: list[Any] = [chat("q", "a" * 40), chat("q", "short"), "{not json", chat("only a user")]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    lines: list[str] = []
    samples = load_samples(data, tokenizer_dir=folder, max_len=30, emit=lines.append)
    short = len(load_tokenizer(folder).apply_chat_template(rows[1]["messages"])["input_ids"])
    assert [len(s.input_ids) for s in samples] == [30, short] and short < 30
    supervised = sum(sum(s.loss_mask) for s in samples)
    assert lines[0] == (
        f"data {data} (chat): 2 samples, {supervised} supervised tokens, "
        "1 truncated at data.max_len = 30, 2 lines dropped"
    )
    assert f"dropped {data}:3: not JSON" in "\n".join(lines)
    assert f"dropped {data}:4: no assistant turn: nothing to supervise" in lines


def test_nothing_usable_fails_naming_the_first_bad_line(tmp_path: Path) -> None:
    folder = tokenizer_dir(tmp_path)
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": []}])
    with pytest.raises(DataFileError, match=r"chat.jsonl:1: 'messages' must be a non-empty"):
        load_samples(data, tokenizer_dir=folder)
    with pytest.raises(DataFileError, match="does not exist"):
        load_samples(tmp_path / "missing.jsonl", tokenizer_dir=folder)
    with pytest.raises(DataFileError, match="need the target's tokenizer"):
        load_samples(write_jsonl(tmp_path / "t.jsonl", [{"text": "x"}]))


def test_the_cache_is_reused_until_the_source_or_the_tokenizer_changes(tmp_path: Path) -> None:
    from trainer.settings.loading import config_from_dict

    folder = tokenizer_dir(tmp_path)
    data = write_jsonl(tmp_path / "chat.jsonl", [chat("hi", "hello")])
    cfg = config_from_dict({"model": {"target": str(folder)}, "data": {"path": str(data)}})
    out = tmp_path / "run" / "checkpoints"
    cache = tmp_path / "run" / "data-cache"

    def load() -> tuple[list[Sample], str]:
        lines: list[str] = []
        samples = load_data(
            cfg.data, out, tokenizer_dir=cfg.model.target or None, emit=lines.append
        )
        return samples, next(x for x in lines if x.startswith("data cache:"))

    first, said = load()
    assert said.startswith(f"data cache: wrote {cache}/chat-")
    again, said = load()
    assert again == first and said.startswith("data cache: reused")
    memo = json.loads((cache / "chat.source.json").read_text())  # size + mtime → sha256
    assert memo["size"] == data.stat().st_size and len(memo["sha256"]) == 64
    write_jsonl(data, [chat("hi", "hello there")])
    changed, said = load()
    assert said.startswith("data cache: wrote") and changed != first
    size = data.stat().st_size
    write_jsonl(data, [chat("hi", "hello where")])  # same size, new content and mtime
    mtime = data.stat().st_mtime_ns + 10**9
    os.utime(data, ns=(mtime, mtime))
    assert data.stat().st_size == size
    same_size, said = load()
    assert said.startswith("data cache: wrote") and same_size != changed
    tok = load_tokenizer(folder)
    tok.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")
    tok.save_pretrained(str(folder))
    _, said = load()
    assert said.startswith("data cache: wrote")
    assert len(list(cache.glob("*.jsonl"))) == 4


def test_prepare_writes_what_training_reads(tmp_path: Path) -> None:
    folder = tokenizer_dir(tmp_path, STRIP_THINK)
    data = write_jsonl(tmp_path / "chat.jsonl", [chat("q1", "<think>r</think>a", "q2", "b")])
    out = tmp_path / "tokens.jsonl"
    assert prepare(data, folder, out, emit=lambda _: None) == 2
    assert load_samples(out) == load_samples(data, tokenizer_dir=folder, template=DEFAULT_TEMPLATE)


def test_the_trainer_trains_on_a_chat_file_and_caches_it_next_to_the_run(tmp_path: Path) -> None:
    from trainer.run.trainer import Trainer
    from trainer.settings.config import DemoConfig
    from trainer.settings.loading import config_from_dict
    from trainer.setup.demo import build_target

    folder = tokenizer_dir(tmp_path)
    build_target(folder, DemoConfig(enabled=True, num_layers=4))
    rows = [chat(f"question {i}", f"answer number {i}", "more?", f"yes {i}") for i in range(4)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = config_from_dict(
        {
            "model": {"target": str(folder), "num_layers": 1, "block_size": 4},
            "data": {"path": str(data), "batch_size": 2, "max_len": 64, "num_anchors": 4},
            "run": {"steps": 2, "device": "cpu", "checkpoint_every": 0},
        }
    )
    said: list[str] = []
    results = Trainer(cfg, tmp_path / "run" / "out", emit=said.append).run()
    assert len(results) == 2 and all(r.loss == r.loss for r in results)
    assert any(s.startswith(f"data {data} (chat): 4 samples") for s in said)
    (cached,) = (tmp_path / "run" / "data-cache").glob("chat-*.jsonl")
    assert load_samples(cached) == load_samples(data, tokenizer_dir=folder)


def test_eval_prompts_from_chat_lines_use_the_same_template_options(tmp_path: Path) -> None:
    from trainer.data.eval_prompts import load_prompts

    folder = tokenizer_dir(tmp_path, THINKING)
    data = write_jsonl(tmp_path / "prompts.jsonl", [chat("q", "a")])
    off = TemplateOptions(enable_thinking=False, system_prompt="be brief")
    (prompt,) = load_prompts(data, tokenizer_dir=folder, template=off)
    assert load_tokenizer(folder).decode(prompt) == (
        "<|im_start|>system\nbe brief" + END + "<|im_start|>user\nq" + END
        + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )  # fmt: skip
