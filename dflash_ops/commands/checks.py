"""The checks of `dflash doctor`, one small function each, looking at one thing through a place.

Each returns a `Check(name, ok, detail, fix)`; none raises for what it finds (the runner,
`doctor.diagnose`, turns an error on the way into a failed check). What one check learns that
later ones need (the python probe's answer) goes into `Findings`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_ops.commands import gpus
from dflash_ops.commands.probes import MIN_PYTHON, MISSING, PROBE, VERSION_PROBE
from dflash_ops.commands.workspace import Workspace
from dflash_ops.connect import shell
from dflash_ops.connect.place import Place, timed_out
from dflash_ops.connect.ssh_config import SSHTarget, by_hand
from dflash_ops.connect.transport import Result
from dflash_ops.errors import CommandTimedOut, DflashError
from dflash_ops.remote.requirements import REQUIREMENTS, required_modules
from dflash_ops.settings.deploy_config import Target
from dflash_ops.settings.job_config import JobConfig
from dflash_ops.untrusted import clip, last_line

MIN_TORCH = (2, 6)
DEFAULT_MIN_FREE_GIB = 10.0
_PASSED, _FAILED, _SKIPPED, _WARNING = "passed", "failed", "skipped", "warning"


@dataclass(frozen=True, kw_only=True)
class Check:
    """One line of the checklist. `fix` says what to do when it failed (empty when it passed)."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    skipped: bool = False
    warning: bool = False  # passed, but something the user should act on (`fix` says what)

    @property
    def status(self) -> str:
        if self.warning:
            return _WARNING
        return _SKIPPED if self.skipped else _PASSED if self.ok else _FAILED

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "status": self.status,
            "detail": self.detail,
            "fix": self.fix,
        }


def passed(name: str, detail: str) -> Check:
    return Check(name=name, ok=True, detail=detail)


def failed(name: str, detail: str, fix: str) -> Check:
    return Check(name=name, ok=False, detail=detail, fix=fix)


def from_error(name: str, exc: DflashError) -> Check:
    """A check that could not be made: the error's message and its hint, as deploy shows them."""
    return failed(name, str(exc), exc.hint)


@dataclass(frozen=True, kw_only=True)
class Setup:
    """What the checks compare the place against: the target, `[job]` and `[train]`."""

    target: Target
    job: JobConfig
    train: Mapping[str, Any] = field(default_factory=dict)
    project_dir: Path | None = None  # where trainer/ is taken from for the smoke test
    min_free_gib: float = DEFAULT_MIN_FREE_GIB
    modules: tuple[str, ...] = ()  # what the trainer imports (`remote.requirements`)
    config: Path | None = None  # the deploy.toml the settings came from (named in fixes)

    @property
    def config_file(self) -> str:
        """The file a fix names: the config the settings came from."""
        return str(self.config) if self.config is not None else "deploy.toml"

    @classmethod
    def of(cls, ws: Workspace, *, min_free_gib: float = DEFAULT_MIN_FREE_GIB) -> Setup:
        """The setup of a command's workspace (its target, `[job]`, `[train]`, project folder)."""
        trainer = ws.config.project_dir / "trainer"
        return cls(
            target=ws.target,
            job=ws.config.job,
            train=ws.config.train,
            project_dir=ws.config.project_dir,
            min_free_gib=min_free_gib,
            modules=tuple(required_modules(trainer)),
            config=ws.config.path,
        )


@dataclass
class Findings:
    """What earlier checks learned that later ones use (the python probe's answer)."""

    python: dict[str, Any] = field(default_factory=dict)


# --- the checks -------------------------------------------------------------------------------


def check_reachable(setup: Setup, place: Place, _: Findings) -> Check:
    """The host answers `true` over SSH: connection, host key known, authentication."""
    name = "ssh"
    try:
        result = place.transport.run(["true"], timeout=place.timeout)
    except CommandTimedOut:
        raise timed_out(["true"], place.timeout, place.transport.description) from None
    if result.exit_code != 0:
        fix = "Check the login shell of that user: ssh <host> true must succeed."
        target = getattr(place.transport, "target", None)
        return failed(
            name,
            f"`true` exited {result.exit_code} on {place.transport.description}: "
            f"{last_line(result.stderr_text)}",
            by_hand(fix, target) if isinstance(target, SSHTarget) else fix,
        )
    return passed(name, f"{place.transport.description} reachable, host key known")


def check_container(setup: Setup, place: Place, _: Findings) -> Check:
    """`pct status <ct>` on the host: pct present, the container exists and runs."""
    place.ensure_ready()
    ct = setup.target.ct
    return passed("container", f"pct present; container {ct} is running")


def check_tmux(setup: Setup, place: Place, _: Findings) -> Check:
    """`tmux -V`: the job runs in a tmux session, so tmux must be on the place's PATH."""
    result = place.run(["tmux", "-V"], check=False)
    return judge_tmux(setup, place.description, result)


def judge_tmux(setup: Setup, where: str, result: Result) -> Check:
    """The tmux check's verdict on the result of `tmux -V` at `where` (also run by deploy)."""
    if result.exit_code == 0:
        return passed("tmux", clip(result.stdout_text.strip()))
    inside = " inside the container" if setup.target.place == "proxmox" else ""
    return failed(
        "tmux",
        f"tmux is not installed (or not on PATH) on {where} "
        f"(exit {result.exit_code}: {last_line(result.stderr_text)})",
        f"Install it{inside}: apt-get install -y tmux (or dnf install tmux).",
    )


def job_argv(setup: Setup, argv: Sequence[str]) -> list[str]:
    """argv run with the job's environment (`env K=V … argv`), as the job itself would see it:
    CUDA_VISIBLE_DEVICES in `[job] env` changes what torch sees."""
    pairs = [f"{shell.env_key(k)}={shell.env_value(v)}" for k, v in setup.job.env.items()]
    return ["env", *pairs, *argv]


def python_probe_argv(setup: Setup, probe: str = VERSION_PROBE) -> list[str]:
    """The job's python running `probe` with the job's environment, the trainer's modules as
    its arguments: ONE `python -c` at the place."""
    return job_argv(setup, [setup.target.python, "-c", probe, *setup.modules])


def check_python(setup: Setup, place: Place, found: Findings, *, probe: str = PROBE) -> Check:
    """The configured `python` starts and answers the probe (version, torch, CUDA)."""
    result = place.run(python_probe_argv(setup, probe), check=False)
    return judge_python(setup, place.description, result, found)


def judge_python(setup: Setup, where: str, result: Result, found: Findings) -> Check:
    """The python check's verdict on the probe's result at `where` (also run by deploy)."""
    python = setup.target.python
    fix = (
        f'Install Python 3.11+ there, or set python = "/path/to/python" in the target\'s table '
        f"of deploy.toml (now {python!r})."
    )
    if setup.target.venv is not None:
        fix = (
            f"Build the job's venv: dflash setup (from {setup.target.venv.base}; dflash deploy "
            "builds it too when it is missing)."
        )
    try:
        found.python = json.loads(result.stdout_text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        found.python = {}
    version = str(found.python.get("python", "?")) if isinstance(found.python, dict) else "?"
    major_minor = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    if major_minor and major_minor < MIN_PYTHON:
        return failed("python", f"{python} is Python {version}; the trainer needs 3.11+", fix)
    if result.exit_code not in (0, MISSING) or not isinstance(found.python, dict):
        return failed(
            "python",
            f"{python} does not run on {where} (exit {result.exit_code}: "
            f"{last_line(result.stderr_text)})",
            fix,
        )
    if not found.python or not isinstance(found.python, dict):
        found.python = {}
        said = clip(result.stdout_text.strip()) or "nothing"
        return failed("python", f"{python} printed no probe answer: {said}", fix)
    return passed("python", f"{python}: Python {version} ({found.python.get('executable')})")


def check_imports(setup: Setup, place: Place, found: Findings) -> Check:
    """Every module the trainer imports is there for the job's python (the probe's answer)."""
    return judge_imports(setup, found)


def judge_imports(setup: Setup, found: Findings) -> Check:
    """The imports check's verdict on the python probe's answer (also deploy's)."""
    missing = [str(m) for m in found.python.get("missing") or []]
    python = setup.target.python
    if missing:
        return failed(
            "imports",
            f"{python} lacks {', '.join(missing)}, which the trainer imports",
            environment_fix(setup),
        )
    if not setup.modules:
        return passed("imports", "no trainer/ here to ask for modules")
    return passed("imports", f"{python} has {', '.join(setup.modules)}")


def environment_fix(setup: Setup) -> str:
    """How to give the job a python with the trainer's modules, under PEP 668 too (Debian and
    Ubuntu refuse `pip install` into the system python): a virtual environment."""
    if setup.target.venv is not None:
        return (
            f"Run dflash setup: it builds {setup.target.venv.folder} from trainer/{REQUIREMENTS}"
            " and [venv] packages (a module neither provides goes into [venv] packages)."
        )
    return (
        "Give the job a python that has them: add a [venv] table to deploy.toml and run "
        f"dflash setup, which builds a virtual environment at the place from trainer/{REQUIREMENTS} "
        "(torch_index = a CUDA torch index, wheels = a wheel folder at the place for an "
        "offline node); or set python in the target's table to a virtual environment's python "
        "that has them. Not pip install into the system python: Debian and Ubuntu refuse it "
        "(externally-managed-environment, PEP 668)."
    )


def check_torch(setup: Setup, place: Place, found: Findings) -> Check:
    python = setup.target.python
    install = f"torch is one of the trainer's requirements. {environment_fix(setup)}"
    if "torch_error" in found.python:
        return failed(
            "torch", f"{python} cannot import torch: {found.python['torch_error']}", install
        )
    version = str(found.python.get("torch", ""))
    numbers = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if numbers < MIN_TORCH:
        wanted = ".".join(map(str, MIN_TORCH))
        return failed("torch", f"torch {version} is older than {wanted}", install)
    build = found.python.get("cuda_build")
    return passed("torch", f"torch {version} ({'CUDA ' + build if build else 'CPU-only build'})")


def check_cuda(setup: Setup, place: Place, found: Findings) -> Check:
    gpus = setup.job.gpus
    p = found.python
    if p.get("cuda"):
        names = sorted(set(p.get("gpu_names", [])))
        return passed("cuda", f"CUDA available: {p.get('gpus')} × {', '.join(names)}")
    why = p.get("cuda_error") or (
        "torch is a CPU-only build" if not p.get("cuda_build") else "no CUDA device is visible"
    )
    if gpus == 0:
        return passed("cuda", f"no CUDA ({why}); not needed: [job] gpus = 0")
    return failed(
        "cuda",
        f"no CUDA at {place.description} ({why}), but [job] gpus = {gpus}",
        "On a GPU machine: check `nvidia-smi` works there (driver; for a container, the GPU "
        "devices passed through) and give the job a CUDA build of torch: [venv] torch_index = "
        '"https://download.pytorch.org/whl/cu128" in deploy.toml, then dflash setup. '
        "To train on the CPU instead, set [job] gpus = 0 and target_gpus = 0 in deploy.toml.",
    )


def check_gpu_count(setup: Setup, place: Place, found: Findings) -> Check:
    want, have = setup.job.gpus, int(found.python.get("gpus", 0))
    idle = gpus.unused(setup.job, seen=max(gpus.count(place, setup.job.env), have))
    if idle:
        detail, fix = gpus.unused_words(idle, place.description, setup.config_file)
        return Check(name="gpu count", ok=True, detail=detail, fix=fix, warning=True)
    if have >= want:
        return passed("gpu count", f"{have} visible, [job] gpus = {want}")
    return failed(
        "gpu count",
        f"{have} GPU{'' if have == 1 else 's'} visible but [job] gpus = {want}",
        f"Set [job] gpus = {have} (and target_gpus below it) in deploy.toml, or make the GPUs "
        "visible to the job (CUDA_VISIBLE_DEVICES in [job] env, container GPU passthrough).",
    )


# Creates the folder, proves a file can be written in it, then prints `df` for it.
_CHECKPOINTS = (
    "d=$1\n"
    'if [ -e "$d" ] && [ ! -d "$d" ]; then echo "$d is a file, not a folder" >&2; exit 3; fi\n'
    'mkdir -p -- "$d" || exit 4\n'
    'p="$d/.dflash-doctor-$$"\n'
    '( : >"$p" ) || exit 5\n'
    'rm -f -- "$p"\n'
    'df -Pk -- "$d" | tail -n 1\n'
)


def check_checkpoints(setup: Setup, place: Place, _: Findings) -> Check:
    """The checkpoints folder exists (or can be made), takes a file, and has room."""
    folder = setup.target.checkpoints
    result = place.run(["bash", "-c", _CHECKPOINTS, "dflash-doctor", folder], check=False)
    why = last_line(result.stderr_text)
    key = "checkpoints in the target's table of deploy.toml"
    if result.exit_code in (3, 4):
        return failed(
            "checkpoints",
            f"cannot use {folder} as the checkpoints folder: {why}",
            f"Remove or move what is in the way, or set {key} to another folder.",
        )
    if result.exit_code == 5:
        return failed(
            "checkpoints",
            f"{folder} is not writable: {why}",
            f"Make it writable (a read-only mount? permissions?), or set {key} to a writable folder.",
        )
    if result.exit_code != 0:
        return failed("checkpoints", f"checking {folder} failed: {why}", f"Check {folder} by hand.")
    fields = result.stdout_text.split()
    free_gib = int(fields[3]) / 2**20 if len(fields) >= 4 and fields[3].isdigit() else -1.0
    if free_gib < setup.min_free_gib:
        return failed(
            "checkpoints",
            f"{folder} is writable but has {free_gib:.1f} GiB free "
            f"(less than {setup.min_free_gib:g} GiB)",
            f"Free some space (old archives: {folder}/archive), or set {key} to a larger disk.",
        )
    return passed("checkpoints", f"{folder} writable, {free_gib:.0f} GiB free")


# Prints the target folder's file names, then a NUL, then its config.json.
_MODEL = (
    "d=$1\n"
    '[ -e "$d" ] || { echo "$d does not exist" >&2; exit 3; }\n'
    '[ -d "$d" ] || { echo "$d is not a folder" >&2; exit 3; }\n'
    'ls -1 -- "$d" || exit 4\n'
    "printf '\\0'\n"
    'cat -- "$d/config.json" || exit 5\n'
)
_DRAFTER_KEYS = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "intermediate_size",
    "vocab_size",
)


def check_model(setup: Setup, place: Place, _: Findings) -> Check:
    """`[train.model] target`: a save_pretrained folder whose config.json shapes the drafter."""
    name = "target model"
    train = setup.train
    demo = train.get("demo")
    if demo is True or (isinstance(demo, Mapping) and demo.get("enabled") is True):
        return passed(
            name, "the demo config builds its own tiny target ([train] demo): nothing to check"
        )
    model = train.get("model", {})
    folder = model.get("target") if isinstance(model, Mapping) else None
    if not folder or not isinstance(folder, str):
        return failed(
            name,
            "no target model is configured ([train.model] target is not set)",
            'Set target = "/path/to/model" under [train.model] in deploy.toml (a local '
            "save_pretrained folder at the place), or set demo = true under [train].",
        )
    if not folder.startswith("/"):
        folder = f"{setup.target.root}/current/{folder}"  # the job runs in current/
    fix = (
        f"Copy the model (a save_pretrained folder with config.json and weights) to {folder} at "
        "the place, or set [train.model] target in deploy.toml to where it is."
    )
    result = place.run(["bash", "-c", _MODEL, "dflash-doctor", folder], check=False)
    if result.exit_code != 0:
        return failed(name, f"target model folder: {last_line(result.stderr_text)}", fix)
    listing, _nul, text = result.stdout.partition(b"\0")
    files = listing.decode("utf-8", "replace").split()
    try:
        config = json.loads(text.decode("utf-8", "replace"))
    except ValueError as exc:
        return failed(name, f"{folder}/config.json is not valid JSON: {exc}", fix)
    problem, summary = drafter_shape_problem(config)
    if problem:
        return failed(name, f"{folder}/config.json: {problem}", fix)
    problem = settings_problem(config, model)
    if problem:  # the setting is wrong, not the model
        setting = "Change it under [train.model] in deploy.toml (docs/training.md, [model])."
        return failed(name, f"{folder}/config.json: {problem}", setting)
    if not any(f.endswith((".safetensors", ".bin")) for f in files):
        return failed(
            name, f"{folder} has a config.json but no weights (*.safetensors, *.bin)", fix
        )
    return passed(name, f"{folder}: {summary}")


def drafter_shape_problem(config: Any) -> tuple[str, str]:
    """What keeps the drafter from being shaped like this target ("" when nothing), and a summary."""
    if not isinstance(config, dict):
        return "not a JSON object", ""
    c = language_config(config)
    bad = [k for k in _DRAFTER_KEYS if not (isinstance(c.get(k), int) and c[k] > 0)]
    if bad:
        return f"missing or not a positive integer: {', '.join(bad)}", ""
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    if not isinstance(kv, int) or kv <= 0 or heads % kv:
        return f"num_key_value_heads = {kv!r} does not divide num_attention_heads = {heads}", ""
    if not c.get("head_dim") and c["hidden_size"] % heads:
        return f"hidden_size {c['hidden_size']} is not a multiple of {heads} heads", ""
    layers = c["num_hidden_layers"]
    arch = ",".join(config.get("architectures") or []) or str(config.get("model_type", "?"))
    summary = (
        f"{arch}: {layers} layers, hidden {c['hidden_size']}, {heads} heads ({kv} kv), "
        f"vocab {c['vocab_size']}"
    )
    return "", summary


def settings_problem(config: dict[str, Any], model: Mapping[str, Any]) -> str:
    """What in `[train.model]` this target cannot take ("" when nothing); `config` has passed
    `drafter_shape_problem`."""
    c = language_config(config)
    heads, layers = c["num_attention_heads"], c["num_hidden_layers"]
    own_kv = model.get("num_kv_heads")
    if own_kv is not None and (not isinstance(own_kv, int) or own_kv <= 0 or heads % own_kv):
        return (
            f"[train.model] num_kv_heads = {own_kv!r} does not divide the target's {heads} "
            "attention heads"
        )
    wanted = model.get("target_layers") or []
    out_of_range = [i for i in wanted if not isinstance(i, int) or not 0 <= i < layers]
    if out_of_range:
        return f"[train.model] target_layers {out_of_range} outside 0…{layers - 1}"
    return ""


def language_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's shape: multimodal configs keep it under `text_config`."""
    text = config.get("text_config")
    return text if "hidden_size" not in config and isinstance(text, dict) else config
