"""`python -m trainer check`: each mistake is caught before anything loads, named by its key and
file, with the fix; a good config passes with a short summary. Real files: a tiny Qwen3 target
saved with `save_pretrained`, the demo's byte-level tokenizer, JSONL written here."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_helpers import REPO
from trainer.commands.check import main
from trainer.data.dataset import load_samples
from trainer.data.formats import Sample, write_samples
from trainer.settings.config import DemoConfig
from trainer.setup.demo import build_target, build_tokenizer


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("check") / "target"
    build_target(folder, DemoConfig(enabled=True, num_layers=4, num_heads=4, num_kv_heads=2))
    build_tokenizer(folder)
    return folder


def config(tmp_path: Path, target: Path, data: Path, extra: str = "") -> Path:
    path = tmp_path / "train.toml"
    path.write_text(f'[model]\ntarget = "{target}"\n[data]\npath = "{data}"\n{extra}')
    return path


def tokenized(tmp_path: Path, n: int = 3) -> Path:
    path = tmp_path / "tokens.jsonl"
    write_samples(path, [Sample([1, 2, 3, 4], [False, True, True, True])] * n)
    return path


def chat_file(tmp_path: Path, *extra_lines: str) -> Path:
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(line + "\n" for line in [json.dumps(row), *extra_lines]))
    return path


def check(capsys: pytest.CaptureFixture[str], path: Path, *args: str) -> tuple[int, str, str]:
    code = main(["--config", str(path), *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_good_config_passes_with_a_summary(tmp_path: Path, target: Path) -> None:
    """In a fresh interpreter, as the deploy runs it: tokenized data never imports torch."""
    path = config(tmp_path, target, tokenized(tmp_path))
    probe = (
        "import sys; from trainer.commands.check import main; rc = main(sys.argv[1:]); "
        "print('torch imported:', 'torch' in sys.modules); sys.exit(rc)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, "--config", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert f"ok: target {target}: qwen3, 4 layers, hidden 64" in result.stdout
    assert "tokenized JSONL, the first 3 lines parse" in result.stdout
    assert "torch imported: False" in result.stdout


def test_chat_data_is_rendered_with_the_targets_template(
    tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = check(capsys, config(tmp_path, target, chat_file(tmp_path)))
    assert code == 0 and "chat JSONL, the first 1 lines parse and render (1 samples" in out


def test_an_unknown_key_exits_2_naming_the_key_and_file(
    tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = config(tmp_path, target, tokenized(tmp_path), "[run]\nnonsense_typo = 1\n")
    code, _, err = check(capsys, path)
    assert code == 2
    assert f"error: {path}: run.nonsense_typo: unknown key; known keys of [run]" in err
    assert "hint: " in err


def test_no_data_path_exits_2(
    tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "train.toml"
    path.write_text(f'[model]\ntarget = "{target}"\n')
    code, _, err = check(capsys, path)
    assert code == 2 and "data.path: set the training data file" in err


def test_a_missing_data_file_and_eval_prompts_are_both_reported(
    tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.jsonl"
    extra = f'[eval]\nevery = 5\nprompts = "{tmp_path / "p.jsonl"}"\n'
    code, _, err = check(capsys, config(tmp_path, target, missing, extra))
    assert code == 1
    assert f"data.path: {missing} does not exist" in err
    assert f"eval.prompts: {tmp_path / 'p.jsonl'} does not exist" in err
    assert err.count("hint: ") == 2


def test_a_bad_line_is_named_with_the_loaders_own_words(
    tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tokenized(tmp_path)
    with open(data, "a") as fh:
        fh.write('{"input_ids": [1, 2], "loss_mask": [1]}\n')
    code, _, err = check(capsys, config(tmp_path, target, data))
    assert code == 1
    assert (
        f"error: {tmp_path / 'train.toml'}: data.path: {data}:4: input_ids (2) and loss_mask" in err
    )
    said: list[str] = []
    load_samples(data, emit=said.append)  # the loader drops the same line, in the same words
    assert any(f"dropped {data}:4: input_ids (2) and loss_mask (1)" in s for s in said)


def test_chat_lines_need_the_targets_tokenizer(
    tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(target, bare, ignore=shutil.ignore_patterns("tokenizer*", "special*"))
    code, _, err = check(capsys, config(tmp_path, bare, chat_file(tmp_path)))
    assert code == 1 and f"model.target: the tokenizer in {bare} does not load" in err


def test_a_chat_line_without_an_assistant_turn_is_caught(
    tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = chat_file(tmp_path, json.dumps({"messages": [{"role": "user", "content": "x"}]}))
    code, _, err = check(capsys, config(tmp_path, target, data))
    assert code == 1 and f"{data}:2: no assistant turn" in err


def test_the_target_must_be_a_supported_family_with_weights(
    tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other"
    shutil.copytree(target, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    code, _, err = check(capsys, config(tmp_path, other, tokenized(tmp_path)))
    assert code == 1 and "model_type 'gpt2' is not a supported target family" in err
    (other / "config.json").write_text(json.dumps(cfg))
    for weights in other.glob("*.safetensors"):
        weights.unlink()
    code, _, err = check(capsys, config(tmp_path, other, tokenized(tmp_path)))
    assert code == 1 and f"{other} has no weights" in err
    path = config(tmp_path, target, tokenized(tmp_path), "")
    code, _, err = check(capsys, path, "--set", "model.target_layers=[1, 3]")
    assert code == 1 and "model.target_layers: [3] outside 0…2 for the 4-layer target" in err
    starts = ("--set", "model.num_layers=2", "--set", "model.init_layers=[0, 4]")
    code, _, err = check(capsys, path, *starts)
    assert code == 1 and "model.init_layers: [4] outside 0…3 for the 4-layer target" in err
    wider = ("--set", "model.num_layers=2", "--set", "model.init_layers=[0, 1]")
    code, _, err = check(capsys, path, *wider, "--set", "model.intermediate_size=4096")
    assert code == 1 and "model.intermediate_size: 4096 with model.init_layers" in err
    code, _, err = check(capsys, path, *wider, "--set", "model.num_kv_heads=4")
    assert code == 1 and "model.num_kv_heads: 4 with model.init_layers" in err
    assert "have 2 key/value heads" in err
    code, _, err = check(capsys, path, "--set", "model.num_kv_heads=3")
    assert code == 1 and "model.num_kv_heads: 3 does not divide the target's 4 attention" in err
    assert "pick one of 1, 2, 4" in err
    assert check(capsys, path, "--set", "model.num_kv_heads=4")[0] == 0
    code, _, err = check(capsys, path, *wider, "--set", "model.head_dim=8")
    assert code == 1 and "model.head_dim: 8 with model.init_layers" in err
    code, _, err = check(capsys, path, "--set", "model.num_heads=3")
    assert code == 1 and "model.num_kv_heads: the target's 2 key/value heads do not divide" in err
    assert check(capsys, path, "--set", "model.num_heads=8", "--set", "model.head_dim=8")[0] == 0


def test_token_ids_past_the_targets_vocabulary_are_caught(
    tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "tokens.jsonl"
    write_samples(data, [Sample([1, 2, 9999], [False, True, True])])
    code, _, err = check(capsys, config(tmp_path, target, data))
    assert code == 1 and "token id 9999 is past the target's vocab_size 512" in err


def test_the_trainer_stops_before_loading_the_target_naming_the_missing_data(
    tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainer.commands.train import _os_error_hint
    from trainer.commands.train import main as train

    missing = tmp_path / "gone.jsonl"
    code = train(["--config", str(config(tmp_path, target, missing)), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and f"error: data.path: {missing} does not exist" in err
    assert "free space" not in err and not (tmp_path / "r").exists()
    gone = FileNotFoundError(2, "No such file or directory", str(missing))
    assert "check that path in the config" in _os_error_hint(gone, str(tmp_path / "r"))
    full = OSError(28, "No space left on device", str(tmp_path / "r" / "step-1"))
    assert "free space" in _os_error_hint(full, str(tmp_path / "r"))


def test_a_shard_folder_passes_and_a_folder_without_shards_is_named(
    tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """data.path may be the --out folder of trainer.generation.generate; any other folder is refused."""
    from trainer.data.shards import write_shard

    shards = tmp_path / "generated"
    shards.mkdir()
    write_shard(shards / "shard-00000.bin", [([1, 2, 3, 4], [False, True, True, True])] * 2)
    code, out, _ = check(capsys, config(tmp_path, target, shards))
    assert code == 0 and "2 samples in token shards" in out
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = check(capsys, config(tmp_path, target, empty))
    assert code == 1 and "data.path" in err and "without token shards" in err


def test_a_target_setting_the_served_drafter_cannot_follow_is_named(
    tmp_path: Path, target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GELU target is refused by the check, by field and value, before anything loads."""
    gelu = tmp_path / "gelu-target"
    shutil.copytree(target, gelu)
    raw = json.loads((gelu / "config.json").read_text())
    (gelu / "config.json").write_text(json.dumps({**raw, "hidden_act": "gelu"}))
    code, _, err = check(capsys, config(tmp_path, gelu, tokenized(tmp_path)))
    assert code == 1
    assert "model.target" in err and "hidden_act = 'gelu'" in err
