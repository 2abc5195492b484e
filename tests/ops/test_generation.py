"""`dflash generate`'s job: the request becomes `-m trainer generate …` with every value a
literal argv element, and the release's launch script runs it (torchrun over the job's GPUs)
instead of the trainer or the user's `[job] command`."""

from __future__ import annotations

import shlex

from dflash_ops.commands.generate import GenerateRequest
from dflash_ops.remote.launch import LaunchPlan, render, trainer_argv


def test_the_request_becomes_the_generators_argv() -> None:
    request = GenerateRequest(
        prompts=("/d/a b.jsonl", "/d/$x.jsonl"), out="/d/gen", max_new_tokens=64,
        engine="static", temperature=0.7, sampled_prefix=16, enable_thinking=False, strict=True,
    )  # fmt: skip
    assert request.tool() == (
        "-m", "trainer", "generate", "--config", "train.toml", "--out", "/d/gen",
        "--prompts", "/d/a b.jsonl", "--prompts", "/d/$x.jsonl",
        "--max-new-tokens", "64", "--engine", "static", "--temperature", "0.7",
        "--sampled-prefix", "16", "--disable-thinking", "--strict",
    )  # fmt: skip


def test_the_launch_script_runs_the_generator_on_every_gpu() -> None:
    tool = GenerateRequest(prompts=("/d/a b.jsonl",), out="/d/gen").tool()
    plan = LaunchPlan(
        release_id="r", python="py", checkpoints="/ck", gpus=4, command="echo mine", tool=tool
    )
    argv = trainer_argv(plan)
    assert argv == ["py", "-m", "trainer", "launch", "--standalone",
                    "--nproc-per-node", "4", *tool]  # fmt: skip
    last = render(plan).splitlines()[-1]
    assert shlex.split(last) == ["exec", *argv]  # the user's [job] command is not run
    alone = LaunchPlan(release_id="r", python="py", checkpoints="/ck", tool=tool)
    assert trainer_argv(alone) == ["py", *tool]
