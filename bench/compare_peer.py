"""Side by side with the peer: SpecForge's DFlash trainer and this project's on one GPU, on the
same target, data, drafter shape, anchors, batch, schedule and steps.

    pip install --no-deps --target /tmp/peer-site .whl/peer/*.whl     # SpecForge + what it imports
    python bench/compare_peer.py --peer-site /tmp/peer-site --out $OUT/peer-specforge  # one H200
    python bench/compare_peer.py --smoke --out /tmp/peer        # CPU, tiny shapes: checks the path

Results in `--out`: `summary.json`, `summary.md`, `stages/<stage>.json` (each stage's own
figures), `logs/<stage>.log`. Each stage is its own process (its peak memory is its own;
SpecForge's packages are on the path of its stages only, `--peer-site`), run in this order,
each within what is left of `--budget-s` (a stage that overruns is stopped; what finished
stays), the summary rewritten after every stage:
1. `prepare`: the evaluation benchmark's target and its generated answers (`bench_eval.py
   --prepare-only`, smaller: `--samples`, `--target-steps`);
2. `ours-train`: this project's trainer on those answers (`bench/peer_ours.py`), exported;
3. `specforge-capture`, `specforge-train`: the same target's features written as SpecForge's
   offline features, then its own training entry (`specforge train`) and exporter
   (`bench/peer_specforge.py`); when the entry fails, `specforge-modules`: its draft model,
   loss and optimizer driven from ours' data loop (`bench/peer_modules.py`);
4. `evaluate`: held-out τ of both exported folders through this project's evaluator, prompt
   lookup beside them, paired 95 % intervals (`bench/peer_eval.py`);
5. `reference`: the same through z-lab's reference decoding loop (`dflash_generate`, carried
   as a file: `--reference`), as many prompts as fit `--reference-seconds`;
6. `ours-step`, `specforge-step`: each trainer's drafter step alone at `bench_pipeline.py`'s
   Qwen3-8B-shaped target (`bench/peer_ours.py`, `bench/peer_modules.py`).
Every setting where the two differ is listed in the summary with the reason
(`bench/peer_summary.differences`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import help_parser, log  # noqa: E402
from bench.peer_common import Settings, read_stage, specforge_folder, stage_path  # noqa: E402
from bench.peer_summary import summarize  # noqa: E402
from bench.records import write_json  # noqa: E402

SCRIPT = Path(__file__).resolve()


@dataclass(frozen=True)
class Stage:
    name: str
    cap_s: float  # longest it may take on the GPU (the budget may give it less)
    peer: bool = False  # SpecForge's packages on its path


STAGES = [
    Stage("ours-train", 240),
    Stage("specforge-capture", 150),
    Stage("specforge-train", 240, peer=True),
    Stage("specforge-modules", 240, peer=True),  # only when specforge-train failed
    Stage("evaluate", 180),
    Stage("reference", 120),
    Stage("ours-step", 180),
    Stage("specforge-step", 150, peer=True),
]
TRAINING = ("ours-train", "specforge-capture", "ours-step")  # reused by --resume when ok
STEP_ROWS = ("ours-step", "specforge-step")  # need neither the target nor the data
PREPARE_CAP_S = 240
MIN_STAGE_S = 30  # a stage with less time left is skipped, not started


# ---- settings -------------------------------------------------------------------------------------


def settings_from(args: argparse.Namespace) -> Settings:
    """The comparison's settings: the GPU recipe, or tiny shapes on the CPU (`--smoke`)."""
    steps = args.steps or (6 if args.smoke else 300)
    log_every = 2 if args.smoke else 10
    gpu: dict[str, Any] = dict(
        device="cuda", batch=128, block_size=8, drafter_layers=4, anchors=64, prompt_len=64,
        gen_len=192, eval_prompts=args.eval_prompts or 128, max_new_tokens=128,
        step_timed=8, specforge_sharding="SHARD_GRAD_OP", specforge_workers=None,
    )  # fmt: skip
    smoke: dict[str, Any] = dict(
        device="cpu", batch=4, block_size=4, drafter_layers=1, anchors=8, prompt_len=8,
        gen_len=24, eval_prompts=args.eval_prompts or 2, max_new_tokens=12, step_timed=2,
        specforge_sharding="NO_SHARD", specforge_workers=0,
    )  # fmt: skip
    return Settings(
        work=str(Path(args.work).resolve()),
        smoke=args.smoke,
        steps=steps,
        lr=2e-3,
        warmup=max(1, steps // 20),
        kl_weight=0.15,
        log_every=log_every,
        warm_steps=args.warm_steps or max(log_every, (steps // 5) // log_every * log_every),
        lookup_max_n=4,
        reference_prompts=args.reference_prompts or (2 if args.smoke else 128),
        reference_seconds=args.reference_seconds,
        peer_site=str(Path(args.peer_site).resolve()) if args.peer_site else None,
        reference=str(args.reference) if args.reference else None,
        **(smoke if args.smoke else gpu),
    )


def default_reference() -> Path | None:
    """z-lab's `dflash/model.py` carried beside the wheels (`.whl/peer/zlab-dflash-*/`)."""
    found = sorted((ROOT / ".whl" / "peer").glob("zlab-dflash-*/dflash/model.py"))
    return found[-1] if found else None


# ---- running a stage ----------------------------------------------------------------------------


def child_env(settings: Settings, peer: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if peer and settings.peer_site:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (settings.peer_site, env.get("PYTHONPATH")) if p
        )
    if peer and settings.device == "cpu":
        env["SPECFORGE_DEVICE"] = "cpu"
    return env


def run_child(argv: list[str], env: dict[str, str], log_path: Path, timeout: float) -> str:
    """Run `argv` in its own process group, its output to the console and `log_path`; stopped
    (the group: SpecForge's loader workers too) at `timeout` → its status."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as out:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True,
        )  # fmt: skip
        assert proc.stdout is not None
        pipe = proc.stdout

        def copy() -> None:
            for line in pipe:
                out.write(line)
                sys.stdout.write(line)
            sys.stdout.flush()

        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reader.join(timeout=10)
            return f"stopped after {timeout:.0f} s"
        reader.join(timeout=10)
    return "done" if code == 0 else f"failed (exit {code}): see {log_path.name}"


class Run:
    """The stages of one comparison, against the clock."""

    def __init__(
        self, settings: Settings, out: Path, budget_s: float, *, resume: bool, command: str
    ) -> None:
        self.settings = settings
        self.command = command
        self.out = out
        self.deadline = time.monotonic() + budget_s
        self.resume = resume
        self.status: dict[str, dict[str, Any]] = {}
        self.settings_file = settings.root / "settings.json"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def timeout(self, cap_s: float) -> float | None:
        """What a stage may take: its cap on the GPU (none on the CPU), within the budget."""
        left = self.left()
        if left < MIN_STAGE_S and not self.settings.smoke:
            return None
        return left if self.settings.smoke else min(cap_s, left)

    def record(self, name: str, status: str, seconds: float) -> None:
        self.status[name] = {"status": status, "seconds": seconds}
        log(f"stage {name}: {status} ({seconds:.0f} s; {max(0.0, self.left()):.0f} s left)")
        self.write()

    def write(self) -> None:
        summary = summarize(self.settings, self.status, self.command)
        self.out.mkdir(parents=True, exist_ok=True)
        write_json(self.out / "summary.json", summary)
        from bench.peer_summary import markdown

        (self.out / "summary.md").write_text(markdown(summary) + "\n")
        raw = self.out / "stages"  # every stage's own result, beside the summary made of them
        raw.mkdir(exist_ok=True)
        for path in (self.settings.root / "stages").glob("*.json"):
            shutil.copyfile(path, raw / path.name)

    def prepare(self, args: argparse.Namespace) -> bool:
        if self.resume and (self.settings.root / "prepare.json").is_file():
            self.record("prepare", "reused", 0.0)
            return True
        argv = [sys.executable, str(ROOT / "bench" / "bench_eval.py"), "--work", self.settings.work]
        argv += ["--prepare-only", "--out", str(self.settings.root / "prepare.json")]
        if self.settings.smoke:
            argv += ["--smoke"]
        else:
            argv += ["--samples", str(args.samples), "--target-steps", str(args.target_steps)]
            argv += ["--gen-compare", "0", "--eval-prompts", str(self.settings.eval_prompts)]
        return self.launch("prepare", argv, peer=False, cap_s=PREPARE_CAP_S) == "done"

    def launch(self, name: str, argv: list[str], *, peer: bool, cap_s: float) -> str:
        timeout = self.timeout(cap_s)
        if timeout is None:
            self.record(name, "skipped: no time left in --budget-s", 0.0)
            return "skipped"
        log(f"stage {name}: " + shlex.join(argv[1:]))
        t0 = time.monotonic()
        status = run_child(
            argv, child_env(self.settings, peer), self.out / "logs" / f"{name}.log", timeout
        )
        self.record(name, status, time.monotonic() - t0)
        return status

    def stage(self, stage: Stage, why: str = "") -> str:
        done = read_stage(self.settings, stage.name)
        if self.resume and stage.name in TRAINING and done and done.get("ok"):
            self.record(stage.name, "reused", 0.0)
            return "done"
        stage_path(self.settings, stage.name).unlink(missing_ok=True)
        argv = [sys.executable, str(SCRIPT), "--stage", stage.name]
        argv += ["--settings", str(self.settings_file)] + (["--why", why] if why else [])
        return self.launch(stage.name, argv, peer=stage.peer, cap_s=stage.cap_s)


def peer_missing(settings: Settings) -> str | None:
    """Why SpecForge's DFlash model does not import with `--peer-site`, or None."""
    probe = "from bench.peer_specforge import importable; print(importable() or '')"
    env = child_env(settings, peer=True)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    found = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    lines = found.stdout.strip().splitlines()
    if found.returncode:
        return found.stderr.strip().splitlines()[-1] if found.stderr.strip() else "probe failed"
    return lines[-1] if lines and lines[-1] else None


def compare(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    settings.root.mkdir(parents=True, exist_ok=True)
    run = Run(
        settings, Path(args.out).resolve(), args.budget_s, resume=args.resume, command=args.command
    )
    if args.resume and run.settings_file.is_file():
        before = Settings.load(run.settings_file)
        if replace(before, peer_site=None, reference=None) != replace(
            settings, peer_site=None, reference=None
        ):
            raise SystemExit(
                "--resume: --work holds a run of other settings; drop --resume or pick a new --work"
            )
    settings.save(run.settings_file)
    missing = peer_missing(settings)
    run.status["specforge"] = {
        "status": f"absent: {missing}" if missing else "present",
        "seconds": 0.0,
    }
    log(f"SpecForge {'absent (' + missing + '): ours only' if missing else 'present'}")
    if missing:  # a resumed --work may hold an earlier run's SpecForge results: not this run's
        for stage in STAGES:
            if stage.name.startswith("specforge-"):
                stage_path(settings, stage.name).unlink(missing_ok=True)
        shutil.rmtree(specforge_folder(settings), ignore_errors=True)
    stages = args.stages or ["prepare", *(s.name for s in STAGES)]
    if set(stages) - set(STEP_ROWS) and not run.prepare(args):
        return 1
    by_name = {s.name: s for s in STAGES}

    def go(name: str, why: str = "") -> str:
        return run.stage(by_name[name], why) if name in stages else "not asked"

    go("ours-train")
    if not missing:
        go("specforge-capture")
        trained = go("specforge-train") == "done"
        entry_ok = (read_stage(settings, "specforge-train") or {}).get("ok")
        if "specforge-train" in stages and not (trained and entry_ok):
            run.stage(by_name["specforge-modules"], why=entry_failure(settings))
        elif "specforge-train" not in stages:
            go("specforge-modules", why="asked for (--stages)")
    go("evaluate")
    go("reference")
    go("ours-step")
    if not missing:
        go("specforge-step")
    run.write()
    return 0


def entry_failure(settings: Settings) -> str:
    """What stopped SpecForge's entry (its last attempt's error), for the record."""
    result = read_stage(settings, "specforge-train") or {}
    attempts = result.get("attempts") or [{}]
    return str(
        attempts[-1].get("error") or "its stage did not finish (see logs/specforge-train.log)"
    )


# ---- command line ---------------------------------------------------------------------------------


def child(args: argparse.Namespace) -> int:
    """One stage in this process (`--stage`)."""
    import torch

    settings = Settings.load(args.settings)
    if settings.smoke:
        torch.set_num_threads(1)  # tiny shapes: one thread beats two fighting over a shared CPU
    name = args.stage
    if name.startswith("ours-"):
        from bench.peer_ours import stage as ours_stage

        ours_stage(settings, name)
    elif name in ("specforge-capture", "specforge-train"):
        from bench.peer_specforge import stage as specforge_stage

        specforge_stage(settings, name)
    elif name in ("specforge-modules", "specforge-step"):
        from bench.peer_modules import stage as modules_stage

        modules_stage(settings, name, args.why or "")
    else:
        from bench.peer_eval import stage as eval_stage

        eval_stage(settings, name)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = help_parser(__doc__)
    p.add_argument(
        "--out", default=None, help="folder for summary.json, summary.md, stages/, logs/"
    )
    p.add_argument(
        "--work", default="/tmp/dflash-compare-peer", help="target, data, features, runs"
    )
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument(
        "--peer-site",
        default=None,
        help="folder SpecForge and its packages were installed into (pip install --no-deps --target)",
    )
    p.add_argument(
        "--reference",
        type=Path,
        default=None,
        help="z-lab/dflash's dflash/model.py (default: .whl/peer/zlab-dflash-*/dflash/model.py)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=540.0,
        help="wall time for all stages; each stops when it is spent",
    )
    p.add_argument(
        "--samples", type=int, default=4096, help="generated answers both trainers train on"
    )
    p.add_argument(
        "--target-steps", type=int, default=600, help="the target's training steps (bench_eval)"
    )
    p.add_argument(
        "--steps", type=int, default=None, help="training steps of both (default 300; smoke 6)"
    )
    p.add_argument(
        "--warm-steps", type=int, default=None, help="steps left out of the steady state"
    )
    p.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts (default 128)")
    p.add_argument(
        "--reference-prompts",
        type=int,
        default=None,
        help="of those, decoded by the reference loop",
    )
    p.add_argument(
        "--reference-seconds", type=float, default=45.0, help="the reference loop's time"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="reuse --work's target, data and finished training stages",
    )
    p.add_argument(
        "--stages",
        type=stage_list,
        default=None,
        help="only these, comma-separated, in their order (e.g. ours-step,specforge-step: the "
        "8B-shaped rows alone, without the target and data)",
    )
    p.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    p.add_argument("--settings", default=None, help=argparse.SUPPRESS)
    p.add_argument("--why", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.command = shlex.join(
        ["python", "bench/compare_peer.py", *(sys.argv[1:] if argv is None else argv)]
    )
    if args.reference is None and args.stage is None:
        args.reference = default_reference()
    if args.stage is None and not args.out:
        p.error("--out: the folder for the summary, e.g. --out /tmp/peer")
    if args.stage is None and args.steps is not None and args.steps < 2:
        p.error("--steps: at least 2")
    return args


def stage_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    known = ["prepare", *(s.name for s in STAGES)]
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown stage {', '.join(unknown) or text!r}: pick from {', '.join(known)}"
        )
    return names


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return child(args) if args.stage else compare(args)


if __name__ == "__main__":
    sys.exit(main())
