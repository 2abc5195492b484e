"""vLLM's CPU build serves the demo drafter as it was trained and measured (`make serve-test`).

The demo is trained as `make run` trains it (`trainer/configs/demo.toml`), exported in fp32 with
`python -m trainer export` (whose printed vLLM command gives K = B − 1), and served by vLLM's
offline API on token-id prompts (`tests/serve/vllm_harness.py`, in the vLLM environment named by
`DFLASH_SERVE_PYTHON`): the target alone, the drafter with vLLM as it is, and the drafter with
each layer's `k_norm` applied to its context keys. Then:

- every output, with and without the drafter, is the project's greedy decoding in fp32, token
  for token (lossless, every prompt);
- with each layer's `k_norm`, vLLM's accepted drafts per verify step are the project's
  (`python -m trainer evaluate --engine-report`), step for step, on every prompt: τ_vLLM /
  τ_project = 1;
- vLLM's CPU build as it is applies layer 0's `k_norm` to every layer's context keys (one batched
  `rms_norm` over the stacked weights; the CPU kernel reads the first row). The test measures
  that gap on this drafter's weights and asserts it is still there, so that it fails — and says
  so — on the day vLLM fixes it; meanwhile its effect on acceptance is bounded by
  `BATCHED_K_NORM_TAU_BOUND`.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from trainer.data.dataset import load_samples
from trainer.evaluation.drafters import DFlashDrafter
from trainer.evaluation.engine_check import EngineComparison, check_engine
from trainer.evaluation.engine_report import EngineRequest, read_report
from trainer.evaluation.speculative import greedy_outputs
from trainer.export.hf_format import load_for_target
from trainer.model.target import Target
from trainer.settings.loading import load_config
from trainer.setup.runtime import resolve_demo

pytestmark = pytest.mark.serve

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "trainer" / "configs" / "demo.toml"
HARNESS = Path(__file__).with_name("vllm_harness.py")
HELD_OUT, TRAINING = 8, 8  # prompts of each kind
# vLLM's batched k_norm gives every layer layer 0's weights: how far that may move vLLM's τ from
# the project's on the demo drafter (measured: docs/benchmarks.md, "Served by vLLM's CPU build")
BATCHED_K_NORM_TAU_BOUND = 0.02
# A bounded wait for each step, generous: a shared 2-core machine can be many times slower than
# one that runs the suite alone
STEP_TIMEOUT_S = 3600


@dataclass(frozen=True)
class Served:
    work: Path
    drafter: Path
    block_size: int
    export_stdout: str
    prompts: list[list[int]]
    max_tokens: int
    reports: dict[str, list[EngineRequest]]
    k_norm: dict


def _run(argv: list[str], *, env: dict[str, str] | None = None, timeout: float) -> str:
    proc = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, f"{shlex.join(argv)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def _prompts(config) -> list[list[int]]:
    """Held-out random byte prompts (the demo data's length) and prompts of the training data."""
    demo = config.demo
    gen = torch.Generator().manual_seed(20_000 + demo.seed)
    held = torch.randint(0, 256, (HELD_OUT, demo.prompt_len), generator=gen).tolist()
    seen = [s.input_ids[: demo.prompt_len] for s in load_samples(config.data.path)[:TRAINING]]
    return held + seen


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    work = tmp_path_factory.mktemp("serve")
    py = sys.executable
    _run(
        [py, "-m", "trainer", "train", "--config", str(DEMO), "--out", str(work / "run")],
        timeout=STEP_TIMEOUT_S,
    )
    drafter = work / "drafter"
    export_stdout = _run(
        [py, "-m", "trainer", "export", "--config", str(DEMO), "--checkpoint", str(work / "run"),
         "--out", str(drafter), "--dtype", "fp32"],
        timeout=STEP_TIMEOUT_S,
    )  # fmt: skip
    config = resolve_demo(load_config(DEMO), work / "run")  # the assets training built
    prompts = _prompts(config)
    (work / "prompts.jsonl").write_text(
        "".join(json.dumps({"input_ids": p}) + "\n" for p in prompts)
    )
    max_tokens = config.demo.gen_len
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in the harness's process
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: the demo needs little
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    _run(
        [os.environ["DFLASH_SERVE_PYTHON"], str(HARNESS), "--target", config.model.target,
         "--drafter", str(drafter), "--prompts", str(work / "prompts.jsonl"),
         "--max-tokens", str(max_tokens), "--out", str(work / "vllm")],
        env=env, timeout=STEP_TIMEOUT_S,
    )  # fmt: skip
    reports = {
        n: read_report(work / "vllm" / f"{n}.jsonl") for n in ("plain", "engine", "per_layer")
    }
    return Served(
        work=work,
        drafter=drafter,
        block_size=config.model.block_size,
        export_stdout=export_stdout,
        prompts=prompts,
        max_tokens=max_tokens,
        reports=reports,
        k_norm=json.loads((work / "vllm" / "k_norm.json").read_text()),
    )


@pytest.fixture(scope="module")
def project(served: Served) -> Project:
    """The target (fp32, CPU) and the exported folder as `trainer.evaluation.evaluate --drafter` loads
    them, and the target's greedy outputs of the prompts, decoded once."""
    config = resolve_demo(load_config(DEMO), served.work / "run")
    target, drafter, _ = load_for_target(served.drafter, config)
    block = DFlashDrafter(
        drafter, embed_weight=target.embed_weight, lm_head_weight=target.lm_head_weight
    )
    greedy = greedy_outputs(target, served.prompts, served.max_tokens, eos=[])
    return Project(target, block, greedy)


@dataclass(frozen=True)
class Project:
    target: Target
    drafter: DFlashDrafter
    greedy: list[list[int]]

    def check(self, report: list[EngineRequest]) -> EngineComparison:
        return check_engine(self.target, self.drafter, report, expected=self.greedy)


def test_export_prints_the_vllm_command_with_k_b_minus_one(served: Served) -> None:
    line = next(x for x in served.export_stdout.splitlines() if "vllm serve" in x)
    argv = shlex.split(line.split(": ", 1)[1])
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {
        "method": "dflash",
        "model": str(served.drafter),
        "num_speculative_tokens": served.block_size - 1,
    }
    assert {r.num_speculative_tokens for r in served.reports["engine"]} == {served.block_size - 1}


def test_every_output_is_the_targets_greedy_decoding(served: Served, project: Project) -> None:
    for name, report in served.reports.items():
        assert [r.prompt for r in report] == served.prompts, name
        result = project.check(report)
        differ = [r.index for r in result.requests if r.output is not None]
        assert differ == [], f"vLLM {name}: prompts {differ} differ from greedy decoding"


def test_with_each_layers_k_norm_vllm_accepts_what_the_project_accepts(served: Served) -> None:
    """Checked by the command a user runs: `trainer.evaluation.evaluate --engine-report`, exit 0."""
    argv = [
        sys.executable, "-m", "trainer", "evaluate", "--config", str(DEMO), "--drafter",
        str(served.drafter), "--engine-report", str(served.work / "vllm" / "per_layer.jsonl"),
        "--json",
    ]  # fmt: skip
    proc = subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=STEP_TIMEOUT_S, check=False
    )
    report = json.loads(proc.stdout)
    parted = [r for r in report["requests"] if r["accepted"] is not None or r["output"]]
    assert proc.returncode == 0 and report["agree"] and parted == [], parted
    ratio = report["engine_tau"] / report["project_tau"]
    assert abs(ratio - 1.0) <= 0.002, report
    assert report["engine_tau"] > 1.0  # drafts were accepted: the counts carry information
    _record(served, "per_layer", report)


def test_vllms_batched_k_norm_still_applies_layer_0s_weights_to_every_layer(
    served: Served, project: Project
) -> None:
    """vLLM's CPU `_normalize_context_k`: one `rms_norm` over the stacked weights, whose CPU
    kernel reads row 0 only. If the first assertion fails, vLLM normalises each layer with its
    own weights: drop `per_layer_k_norm` from the harness and require `engine.jsonl` to agree
    exactly."""
    gaps = served.k_norm["max_abs_diff_by_layer"]
    differ = served.k_norm["weight_max_abs_diff_from_layer_0"]
    assert gaps[0] == 0.0 and max(differ[1:]) > 0.0
    assert all(g > 0.0 for g, w in zip(gaps[1:], differ[1:], strict=True) if w > 0.0), gaps
    result = project.check(served.reports["engine"])
    assert all(r.output is None for r in result.requests)  # lossless all the same
    assert result.engine_tau is not None and result.project_tau is not None
    ratio = result.engine_tau / result.project_tau
    _record(served, "engine", result.to_json())
    assert abs(ratio - 1.0) <= BATCHED_K_NORM_TAU_BOUND, result.summary()


def _record(served: Served, name: str, report: dict) -> None:
    """The figures of a check, for the run's log (`pytest -rA` / the work folder)."""
    keep = {k: report[k] for k in ("engine_tau", "project_tau", "agree")}
    parted = sum(1 for r in report["requests"] if r["accepted"] is not None)
    line = json.dumps({"report": name, **keep, "requests_parted": parted})
    with (served.work / "figures.jsonl").open("a") as f:
        f.write(line + "\n")
    print(line)
