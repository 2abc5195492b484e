"""Target-generated data on a tiny random target: batched KV-cached decoding equals plain greedy
decoding token for token (rows finishing early included; the static engine through its grouped
step attention, across mask widths), the CLI writes shards whose supervised
span is exactly the answer, names bad prompt lines (file:line), drops duplicates, refuses a
changed resume, resumes after a kill without losing or rewriting a finished shard, and the
trainer trains from the shards and says when it starts repeating them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.signal_helpers import handlers_installed
from tests.trainer.hybrid_target import hybrid_model
from trainer.data.shards import MANIFEST, ShardSamples, finished_shards
from trainer.generation.decode import Sampling, decode_batch, length_batches, static_unsupported
from trainer.generation.decode_attention import COLUMN_BLOCK, NAME, grouped_decoding
from trainer.generation.generate import main
from trainer.model.target import load_target
from trainer.settings.config import DemoConfig
from trainer.settings.loading import load_config
from trainer.setup.demo import ensure_demo_assets

REPO = Path(__file__).resolve().parents[2]
DEMO = DemoConfig(enabled=True, num_samples=8, num_layers=2, prompt_len=6, gen_len=8)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    target, _ = ensure_demo_assets(tmp_path_factory.mktemp("assets"), DEMO)
    return target


@pytest.fixture(scope="module")
def model(target_dir: Path) -> torch.nn.Module:
    return load_target(target_dir).model


def reference(model: torch.nn.Module, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    """Plain greedy decoding: the whole sequence through the model at every step, no cache."""
    seq, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            tok = int(model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax())
        out.append(tok)
        seq.append(tok)
        if tok in eos:
            break
    return out


def random_prompts(n: int, *, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 12, (n,), generator=gen).tolist()
    return [torch.randint(0, 256, (k,), generator=gen).tolist() for k in lengths]


@pytest.fixture(scope="module")
def eager_model(target_dir: Path) -> torch.nn.Module:
    """The same target with `eager` attention (the static engine hands it an additive mask)."""
    model = load_target(target_dir).model
    model.set_attn_implementation("eager")
    return model


@pytest.mark.parametrize(
    ("engine", "attention"),
    [("dynamic", "sdpa"), ("static", "sdpa"), ("static", "eager")],
)
def test_batched_cached_decoding_equals_plain_greedy(
    model: torch.nn.Module, eager_model: torch.nn.Module, engine: str, attention: str
) -> None:
    model = eager_model if attention == "eager" else model
    assert model.config._attn_implementation == attention
    prompts = random_prompts(6, seed=0)
    free = [reference(model, p, 12, set()) for p in prompts]
    eos = {free[1][3], free[4][6]}  # rows 1 and 4 (at least) end early: rows leave the batch
    want = [reference(model, p, 12, eos) for p in prompts]
    assert sorted(map(len, want))[0] < 12 < max(map(len, free)) + 1
    got = decode_batch(model, prompts, max_new_tokens=12, eos_ids=eos, pad_id=256, engine=engine)
    assert got == want
    hf = model.generate(
        input_ids=torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False, pad_token_id=256
    )
    assert got[0] == hf[0, len(prompts[0]) :].tolist()[: len(got[0])]


def test_the_static_engine_decodes_across_mask_widths_as_plain_greedy(
    model: torch.nn.Module,
) -> None:
    """Prompts of 3…11 tokens and 70 new ones: steps attend through masks 64 and then 128
    columns wide, the rows left-padded differently."""
    seen: set[str] = set()
    hook = model.register_forward_pre_hook(lambda m, _: seen.add(m.config._attn_implementation))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 11, 7)]
    try:
        got = decode_batch(
            model, prompts, max_new_tokens=70, eos_ids=(), pad_id=256, engine="static"
        )
    finally:
        hook.remove()
    assert COLUMN_BLOCK < 11 + 70  # the masks widen once
    assert got == [reference(model, p, 70, set()) for p in prompts]
    assert seen == {NAME}  # every forward of the decoding attended through the grouped path
    assert model.config._attn_implementation == "sdpa"  # and the model is as it was


def test_grouped_decoding_leaves_other_attention_alone_and_restores_on_error(
    model: torch.nn.Module,
) -> None:
    with pytest.raises(KeyError), grouped_decoding(model) as grouped:
        assert grouped and model.config._attn_implementation == NAME
        raise KeyError("a failure inside the decoding")
    assert model.config._attn_implementation == "sdpa"
    model.config._attn_implementation = "eager"
    try:
        with grouped_decoding(model) as grouped:
            assert not grouped and model.config._attn_implementation == "eager"
    finally:
        model.config._attn_implementation = "sdpa"


def test_a_hybrid_target_decodes_as_plain_greedy() -> None:
    """`auto` takes the dynamic engine for it; left padding and rows leaving the batch must
    carry the recurrent states along with the keys and values."""
    model = hybrid_model()
    assert set(model.config.layer_types) == {"linear_attention", "full_attention"}
    assert "not all full attention" in (static_unsupported(model) or "")
    prompts = random_prompts(4, seed=2)
    free = [reference(model, p, 10, set()) for p in prompts]
    eos = {free[1][3]}
    want = [reference(model, p, 10, eos) for p in prompts]
    assert min(map(len, want)) < 10 and len({len(p) for p in prompts}) > 1
    got = decode_batch(model, prompts, max_new_tokens=10, eos_ids=eos, pad_id=0, engine="auto")
    assert got == want


@pytest.mark.parametrize("engine", ["dynamic", "static"])
def test_sampling_is_seeded_and_a_tiny_nucleus_is_greedy(
    model: torch.nn.Module, engine: str
) -> None:
    prompts = random_prompts(4, seed=1)
    hot = Sampling(temperature=1.5, seed=0)

    def sample(s: Sampling) -> list[list[int]]:
        gen = torch.Generator().manual_seed(5)
        return decode_batch(
            model, prompts, max_new_tokens=8, eos_ids=(), pad_id=256, sampling=s, generator=gen,
            engine=engine,
        )  # fmt: skip

    assert sample(hot) == sample(hot)
    greedy = decode_batch(model, prompts, max_new_tokens=8, eos_ids=(), pad_id=256, engine=engine)
    assert sample(hot) != greedy
    assert sample(Sampling(temperature=1.0, top_p=1e-6)) == greedy


def test_the_static_engine_names_a_model_it_cannot_decode(target_dir: Path) -> None:
    model = load_target(target_dir).model
    model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
    with pytest.raises(ValueError, match="not all full attention"):
        decode_batch(model, [[1, 2]], max_new_tokens=2, eos_ids=(), pad_id=0, engine="static")
    with pytest.raises(ValueError, match="engine must be one of"):
        decode_batch(model, [[1, 2]], max_new_tokens=2, eos_ids=(), pad_id=0, engine="fast")


def test_length_batches_group_similar_lengths() -> None:
    assert length_batches([3, 9, 1, 8, 2], 2) == [[1, 3], [0, 4], [2]]


def write_config(tmp: Path, target_dir: Path) -> Path:
    path = tmp / "train.toml"
    path.write_text(
        f'[model]\ntarget = "{target_dir}"\nnum_layers = 1\nblock_size = 4\nnum_target_layers = 2\n'
        f'[data]\npath = "unused"\nbatch_size = 4\nmax_len = 96\nnum_anchors = 4\nbucket = 16\n'
        '[run]\nsteps = 3\ndevice = "cpu"\nthreads = 1\nlog_every = 1\n'
    )
    return path


def write_prompts(path: Path, n: int, *, extra: list[str] = ()) -> Path:  # type: ignore[assignment]
    lines = [
        json.dumps({"messages": [{"role": "user", "content": f"q{i} " + "z" * (i % 7)}]})
        for i in range(n)
    ]
    path.write_text("\n".join([*lines, *extra]) + "\n")
    return path


def run_cli(cfg: Path, prompts: Path, out: Path, *more: str) -> int:
    return main(["--config", str(cfg), "--prompts", str(prompts), "--out", str(out),
                 "--max-new-tokens", "10", "--batch-size", "3", *more])  # fmt: skip


def test_cli_writes_answers_names_bad_lines_and_drops_duplicates(
    tmp_path: Path, target_dir: Path, model: torch.nn.Module, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoTokenizer

    cfg = write_config(tmp_path, target_dir)
    dup = json.dumps({"messages": [{"role": "user", "content": "q0 "}]})
    extra = ['{"text": "plain text prompt"}', "{broken", '{"input_ids": [5, 6, 7]}', dup,
             '{"messages": [{"role": "assistant", "content": "only an answer"}]}']  # fmt: skip
    prompts = write_prompts(tmp_path / "p.jsonl", 5, extra=extra)
    assert run_cli(cfg, prompts, tmp_path / "out", "--shard-size", "3", "--enable-thinking") == 0
    logged = capsys.readouterr().out
    assert "the chat template has no enable_thinking switch" in logged
    assert f"skipped {prompts}:7: not JSON" in logged
    assert f"skipped {prompts}:10: messages hold no turn" in logged
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["complete"] and manifest["prompts"]["duplicates"] == 1
    assert [b.split(": ")[0] for b in manifest["prompts"]["bad"]] == [
        f"{prompts}:7",
        f"{prompts}:10",
    ]
    assert manifest["counts"]["samples"] == 7 and manifest["num_shards"] == 3
    assert manifest["sampling"]["greedy"] and manifest["template"]["add_generation_prompt"]
    samples = ShardSamples(tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    eos = {tok.eos_token_id}
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "q1 z"}], tokenize=True, add_generation_prompt=True
    )
    chat = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
    wanted = {
        1: chat,
        5: list(tok("plain text prompt")["input_ids"]),
        6: [5, 6, 7],
    }
    for i, prompt in wanted.items():
        s = samples[i]
        assert s.input_ids[: len(prompt)] == prompt
        assert s.loss_mask == [False] * len(prompt) + [True] * (len(s.input_ids) - len(prompt))
        assert s.input_ids[len(prompt) :] == reference(model, prompt, 10, eos)


def test_strict_refuses_the_bad_line(
    tmp_path: Path, target_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", 2, extra=['{"text": 3}'])
    assert run_cli(write_config(tmp_path, target_dir), prompts, tmp_path / "out", "--strict") == 2
    assert f"error: {prompts}:3: text must be a non-empty string" in capsys.readouterr().err
    assert not finished_shards(tmp_path / "out")


def test_a_resume_with_other_settings_is_refused(
    tmp_path: Path, target_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, prompts = write_config(tmp_path, target_dir), write_prompts(tmp_path / "p.jsonl", 2)
    assert run_cli(cfg, prompts, tmp_path / "out") == 0
    assert run_cli(cfg, prompts, tmp_path / "out", "--temperature", "0.7") == 2
    assert "sampling differ" in capsys.readouterr().err


def test_a_sampled_prefix_joins_the_prompt_and_the_greedy_answer_follows_it(
    tmp_path: Path, target_dir: Path, model: torch.nn.Module
) -> None:
    cfg = write_config(tmp_path, target_dir)
    ids = tmp_path / "ids.jsonl"
    prompts = random_prompts(6, seed=4)
    ids.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    flags = ["--temperature", "2.0", "--sampled-prefix", "4", "--seed", "3"]
    assert run_cli(cfg, ids, tmp_path / "a", *flags) == 0
    assert run_cli(cfg, ids, tmp_path / "b", *flags) == 0
    a, b = ShardSamples(tmp_path / "a"), ShardSamples(tmp_path / "b")
    assert [a[i].input_ids for i in range(len(a))] == [b[i].input_ids for i in range(len(b))]
    manifest = json.loads((tmp_path / "a" / MANIFEST).read_text())
    assert manifest["sampling"]["sampled_prefix"] == 4 and manifest["sampling"]["greedy"]
    off_greedy = 0
    for i in range(len(a)):
        s = a[i]
        prompt = next(p for p in prompts if s.input_ids[: len(p)] == p)
        n = s.loss_mask.index(True)
        assert n == len(prompt) + 4 and all(s.loss_mask[n:])  # the prefix is not supervised
        prefix, answer = s.input_ids[len(prompt) : n], s.input_ids[n:]
        off_greedy += prefix != reference(model, prompt, 4, set())
        assert answer == reference(model, s.input_ids[:n], 10 - 4, set())
    assert off_greedy >= len(a) // 2  # the prefix was sampled, not the greedy answer's start


def test_a_sampled_prefix_needs_a_temperature_and_room_for_an_answer(
    tmp_path: Path, target_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, prompts = write_config(tmp_path, target_dir), write_prompts(tmp_path / "p.jsonl", 2)
    assert run_cli(cfg, prompts, tmp_path / "a", "--sampled-prefix", "4") == 2
    assert "--sampled-prefix samples at --temperature, which is 0" in capsys.readouterr().err
    flags = ["--sampled-prefix", "9", "--temperature", "1"]
    assert run_cli(cfg, prompts, tmp_path / "b", *flags) == 2
    assert "--sampled-prefix must be in 0…8" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_killed_generation_resumes_without_losing_or_rewriting_a_shard(
    tmp_path: Path, target_dir: Path
) -> None:
    cfg, prompts = write_config(tmp_path, target_dir), write_prompts(tmp_path / "p.jsonl", 60)
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "trainer", "generate", "--config", str(cfg), "--prompts",
            str(prompts), "--out", str(out), "--max-new-tokens", "30", "--batch-size", "1",
            "--shard-size", "2", "--log-every", "0"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while not finished_shards(out) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = {i: (p.stat().st_ino, p.stat().st_mtime_ns) for i, p in finished_shards(out).items()}
    assert 1 <= len(first) < 30, "the kill must land between shards"
    assert main(argv[4:]) == 0
    after = finished_shards(out)
    assert sorted(after) == list(range(30))
    assert all((after[i].stat().st_ino, after[i].stat().st_mtime_ns) == v for i, v in first.items())
    assert not list(out.glob("*.tmp-*"))
    clean = tmp_path / "clean"
    assert main([*argv[4:8], "--out", str(clean), *argv[10:]]) == 0
    assert [a.read_bytes() for a in after.values()] == [
        p.read_bytes() for p in finished_shards(clean).values()
    ]
    assert json.loads((out / MANIFEST).read_text())["counts"]["samples"] == 60


def test_an_interrupt_at_any_moment_of_the_start_up_ends_the_generation_with_one_line(
    tmp_path: Path, target_dir: Path
) -> None:
    """SIGINT while torch imports or the target loads: exit 130 at once, one line saying the
    finished shards are kept, no traceback, no shard. (Before: the interrupt came out of the
    module's torch import as a traceback, the process ended by the signal.)"""
    cfg, prompts = write_config(tmp_path, target_dir), write_prompts(tmp_path / "p.jsonl", 8)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    def start(out: Path) -> subprocess.Popen[str]:
        argv = [sys.executable, "-m", "trainer", "generate", "--config", str(cfg), "--prompts",
                str(prompts), "--out", str(out), "--max-new-tokens", "8", "--batch-size", "1",
                "--shard-size", "1", "--log-every", "0"]  # fmt: skip
        return subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    calibrate = start(tmp_path / "calibrate")
    installed = handlers_installed(calibrate)
    deadline = time.monotonic() + 120
    while not finished_shards(tmp_path / "calibrate") and time.monotonic() < deadline:
        assert calibrate.poll() is None, calibrate.communicate()[0][-3000:]
        time.sleep(0.01)
    first_shard = time.monotonic() - installed
    calibrate.kill()
    calibrate.communicate()
    for i in range(8):
        moment = i * 0.6 * first_shard / 7  # from the handlers' installation on
        out = tmp_path / f"out-{i}"
        proc = start(out)
        time.sleep(max(0.0, handlers_installed(proc) + moment - time.monotonic()))
        proc.send_signal(signal.SIGINT)
        try:
            log = proc.communicate(timeout=15)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"still running 15 s after SIGINT ({moment:.2f} s in)")
        where = f"SIGINT {moment:.2f} s after the handlers' installation:\n{log[-3000:]}"
        assert proc.returncode == 130, where
        assert "SIGINT received: interrupted; finished shards are kept" in log, where
        assert "Traceback" not in log and not finished_shards(out), where


def test_the_trainer_trains_from_shards_and_says_when_data_repeats(
    tmp_path: Path, target_dir: Path
) -> None:
    from trainer.run.trainer import Trainer

    cfg, prompts = write_config(tmp_path, target_dir), write_prompts(tmp_path / "p.jsonl", 9)
    assert run_cli(cfg, prompts, tmp_path / "data", "--shard-size", "4") == 0
    config = load_config(cfg, [f"data.path={tmp_path / 'data'}", "run.steps=3"])
    lines: list[str] = []
    trainer = Trainer(config, tmp_path / "run", emit=lines.append)
    results = trainer.run()
    assert len(results) == 3 and all(r.loss == r.loss for r in results)
    repeats = [line for line in lines if "repeated samples" in line]
    assert repeats == [repeat_line(2, 9)]  # 2 batches of 4 per epoch: step 3 starts epoch 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [round(r["epochs"], 3) for r in rows] == [
        round(4 / 9, 3),
        round(8 / 9, 3),
        round(1 + 4 / 9, 3),
    ]


def repeat_line(epoch: int, samples: int) -> str:
    from trainer.data.dataset import repeat_note

    return repeat_note(epoch - 1, samples)


def test_torchrun_ranks_share_the_shards_and_write_what_one_process_writes(
    tmp_path: Path, target_dir: Path
) -> None:
    cfg, prompts = write_config(tmp_path, target_dir), write_prompts(tmp_path / "p.jsonl", 10)
    flags = ["--config", str(cfg), "--prompts", str(prompts), "--max-new-tokens", "8",
             "--shard-size", "3", "--log-every", "0"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "trainer", "generate", *flags, "--out", str(tmp_path / "two")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[-2000:]
    assert "[rank 1/2] 2 of 4 shards are this rank's" in two.stdout
    assert main([*flags, "--out", str(tmp_path / "one")]) == 0
    one, both = finished_shards(tmp_path / "one"), finished_shards(tmp_path / "two")
    assert [p.read_bytes() for p in both.values()] == [p.read_bytes() for p in one.values()]
    manifest = json.loads((tmp_path / "two" / MANIFEST).read_text())
    assert manifest["complete"] and manifest["counts"]["samples"] == 10


def test_a_target_without_tokenizer_answers_token_ids_and_refuses_chat(
    tmp_path: Path, target_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (target_dir / name).is_file():
            (bare / name).write_bytes((target_dir / name).read_bytes())
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"input_ids": [5, 6, 7, 8]}\n')
    assert run_cli(write_config(tmp_path, bare), ids, tmp_path / "a") == 0
    assert ShardSamples(tmp_path / "a")[0].input_ids[:4] == [5, 6, 7, 8]
    chat = write_prompts(tmp_path / "chat.jsonl", 1)
    assert run_cli(write_config(tmp_path, bare), chat, tmp_path / "b") == 2
    assert "has no tokenizer" in capsys.readouterr().err


def test_enable_thinking_reaches_a_template_that_has_the_switch(
    tmp_path: Path, target_dir: Path
) -> None:
    from transformers import AutoTokenizer

    from trainer.data.prompt_file import Renderer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}A:{% if enable_thinking is defined and not enable_thinking %}"
        "<t></t>{% endif %}{% endif %}"
    )
    tok.save_pretrained(str(tmp_path))
    msgs = [{"role": "user", "content": "hi"}]
    plain = Renderer(tmp_path)("messages", msgs)
    off = Renderer(tmp_path, enable_thinking=False)
    assert off.template_has_thinking and tok.decode(plain) == "hiA:"
    assert tok.decode(off("messages", msgs)) == "hiA:<t></t>"
    assert off.describe()["enable_thinking"] is False
