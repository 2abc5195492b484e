"""deploy.toml parsing, target selection and precedence, and the TOML writer's round trip."""

from __future__ import annotations

import math
import sys
import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dflash_ops.commands import environment
from dflash_ops.commands.checks import Setup
from dflash_ops.errors import ConfigError
from dflash_ops.settings import project, state, toml_writer
from dflash_ops.settings.deploy_config import TargetFlags, find_config, load_config, resolve_target
from dflash_ops.settings.job_config import DEFAULT_ENV

FULL = """
[target]
place = "local"

[targets.gpu-box]
place = "proxmox"
host = "10.1.2.6"
ct = 200
checkpoints = "/data/ckpt"

[targets.plain]
place = "ssh"
host = "box"
user = "me"
port = 2222
python = "/opt/venv/bin/python"

[job]
session = "train-1"
log = "out.log"
env = { OMP_NUM_THREADS = 4, PYTORCH_CUDA_ALLOC_CONF = "off" }
gpus = 8
target_gpus = 5
command = "echo hi"
socket = "mine"
stop_timeout = 2.5

[train]
steps = 10
model = { layers = 2 }
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "deploy.toml"
    path.write_text(text)
    return path


def test_full_file(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, FULL))
    job = config.job
    assert (job.session, job.log, job.gpus, job.target_gpus) == ("train-1", "out.log", 8, 5)
    assert job.env == {"OMP_NUM_THREADS": "4", "PYTORCH_CUDA_ALLOC_CONF": "off"}
    assert (job.command, job.socket, job.stop_timeout) == ("echo hi", "mine", 2.5)
    assert config.train == {"steps": 10, "model": {"layers": 2}}


def test_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, ""))
    assert config.job.session == "dflash" and config.job.log == "train_stdout.log"
    assert config.job.env == DEFAULT_ENV
    assert config.job.socket is None and config.job.gpus == 0
    target = resolve_target(config, TargetFlags(), remembered=None)
    assert target.place == "local" and target.name == "default"
    assert target.root == str(tmp_path / ".dflash" / "local")
    assert target.checkpoints == str(tmp_path / ".dflash" / "local" / "checkpoints")
    assert target.python == sys.executable
    assert target.timeout == 120.0  # each command at the place, each step of the site program


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[job]\nsesion = 'x'\n", "'job.sesion'"),
        ("[jobs]\n", "'jobs'"),
        ("[target]\nplace = 'local'\nhots = 'x'\n", "'target.hots'"),
        ("[targets.a]\nplace = 'ssh'\nprot = 22\n", "'targets.a.prot'"),
        ("[job]\ngpus = 'eight'\n", "'job.gpus'"),
        ("[job]\ngpus = true\n", "'job.gpus'"),
        ("[targets.a]\nport = '22'\n", "'targets.a.port'"),
        ("[job]\nenv = { A = [1] }\n", "'job.env.A'"),
        ("[job]\nenv = 'A=1'\n", "'job.env'"),
        ("[train]\nx = 1\n[train]\n", "not valid TOML"),
        ("[target]\nplace = 'lxc'\n", "'target.place'"),
        ("[job]\ngpus = 2\ntarget_gpus = 2\n", "'job.target_gpus'"),
        ("[job]\nsession = 'a;b'\n", "'job.session'"),
        ("[job]\nsession = 'a.b'\n", "'job.session'"),
        ("[job]\nlog = '../x'\n", "'job.log'"),
        ("[job]\nenv = { 'A B' = '1' }\n", "'job.env.A B'"),
        ("[job]\nstop_timeout = 0\n", "'job.stop_timeout'"),
        ("[job]\nstart_wait = -1\n", "'job.start_wait'"),
        ("[job]\nready = ' '\n", "'job.ready'"),
        ("[venv]\ntorch_index = 'download.pytorch.org'\n", "'venv.torch_index'"),
        ("[venv]\ntorch_index = 'https://x'\nwheels = '/w'\n", "'venv.wheels'"),
        ("[venv]\npackages = ['--index-url=http://x']\n", "'venv.packages'"),
        ("[venv]\nsystem_site_packages = 1\n", "'venv.system_site_packages'"),
        ("[venv]\nwheels = 'relative'\n", "'venv.wheels'"),
        ("[venv]\n", "trainer/requirements.txt"),
        ("[target]\ntimeout = '60'\n", "'target.timeout'"),
        ("[targets.a]\ntimeout = true\n", "'targets.a.timeout'"),
    ],
)
def test_errors_name_key_and_file(tmp_path: Path, text: str, words: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert words in str(info.value)
    assert str(path) in str(info.value)


def test_missing_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DFLASH_CONFIG", raising=False)
    with pytest.raises(ConfigError, match="No config file"):
        find_config(None, cwd=tmp_path)


def test_config_discovery_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "deploy.toml").write_text("")
    other = tmp_path / "other.toml"
    other.write_text("")
    flag = tmp_path / "flag.toml"
    flag.write_text("")
    monkeypatch.delenv("DFLASH_CONFIG", raising=False)
    assert find_config(None, cwd=tmp_path) == tmp_path / "deploy.toml"
    monkeypatch.setenv("DFLASH_CONFIG", str(other))
    assert find_config(None, cwd=tmp_path) == other
    assert find_config(flag, cwd=tmp_path) == flag


def test_named_target_and_per_place_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, FULL))
    box = resolve_target(config, TargetFlags(target="gpu-box"), remembered=None)
    assert (box.place, box.host, box.ct) == ("proxmox", "10.1.2.6", 200)
    own = project.load(tmp_path)  # this folder's own root at any remote place
    assert (box.root, box.checkpoints, box.python) == (own.remote_root, "/data/ckpt", "python3")
    assert own.remote_root.startswith(f"/root/dflash/{tmp_path.name}-")
    plain = resolve_target(config, TargetFlags(target="plain", port=22), remembered=None)
    assert (plain.user, plain.port, plain.python) == ("me", 22, "/opt/venv/bin/python")


def test_missing_target_name(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, FULL))
    with pytest.raises(ConfigError, match=r"No target named 'nope'.*known: gpu-box, plain"):
        resolve_target(config, TargetFlags(target="nope"), remembered=None)


def test_host_flags_make_ssh_and_proxmox(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, FULL))
    ssh = resolve_target(config, TargetFlags(host="h", user="u", port=2200), remembered=None)
    assert (ssh.place, ssh.host, ssh.user, ssh.port, ssh.ct) == ("ssh", "h", "u", 2200, None)
    own = project.load(tmp_path)
    assert (ssh.root, ssh.checkpoints) == (own.remote_root, own.remote_checkpoints)
    assert own.remote_checkpoints == f"/workspace/dflash/{own.id}"
    pve = resolve_target(config, TargetFlags(host="h", ct=201), remembered=None)
    assert (pve.place, pve.ct) == ("proxmox", 201)
    # --host on a named target keeps its other fields
    moved = resolve_target(
        config, TargetFlags(target="gpu-box", host="h2", ct=300), remembered=None
    )
    assert (moved.host, moved.ct, moved.checkpoints) == ("h2", 300, "/data/ckpt")


REMOTE_DEFAULT = """
[target]
place = "proxmox"
host = "10.1.2.6"
ct = 200
python = "/opt/venv/bin/python"
checkpoints = "/data/ckpt"

[targets.other]
place = "ssh"
host = "box"
root = "/srv/dflash"
"""


def test_host_flags_override_only_what_they_name(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, REMOTE_DEFAULT))
    same = resolve_target(config, TargetFlags(host="10.1.2.6", ct=200), remembered=None)
    assert (same.name, same.python, same.checkpoints) == (
        "default",
        "/opt/venv/bin/python",
        "/data/ckpt",
    )
    assert same.note == ""
    named = resolve_target(config, TargetFlags(host="box"), remembered=None)
    assert (named.name, named.root, named.python) == ("other", "/srv/dflash", "python3")
    # Another container: [target]'s other keys still apply, and the note says which table.
    moved = resolve_target(config, TargetFlags(host="10.1.2.7", ct=201), remembered=None)
    assert (moved.host, moved.ct, moved.python) == ("10.1.2.7", 201, "/opt/venv/bin/python")
    assert moved.checkpoints == "/data/ckpt" and moved.root == project.load(tmp_path).remote_root
    assert "[target] (host 10.1.2.6, ct 200)" in moved.note and "python, checkpoints" in moved.note
    # --host alone is an SSH host: the base table's container id does not come along.
    host = resolve_target(config, TargetFlags(host="10.1.2.6"), remembered=None)
    assert (host.place, host.ct, host.python) == ("ssh", None, "/opt/venv/bin/python")
    # Remembered flags resolve the same way (what doctor, logs, status see after a deploy).
    later = resolve_target(config, TargetFlags(), remembered=TargetFlags(host="10.1.2.6", ct=200))
    assert later == same


def test_ct_without_host_is_an_error(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, FULL))
    with pytest.raises(ConfigError, match="--ct needs --host"):
        resolve_target(config, TargetFlags(ct=200), remembered=None)


@pytest.mark.parametrize("ct", [0, 99, -5])
def test_bad_container_ids(tmp_path: Path, ct: int) -> None:
    config = load_config(write(tmp_path, ""))
    with pytest.raises(ConfigError, match="container id"):
        resolve_target(config, TargetFlags(host="h", ct=ct), remembered=None)


def test_remembered_target_is_used_unless_flags_select(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, FULL))
    remembered = TargetFlags(host="pve", ct=250)
    target = resolve_target(config, TargetFlags(), remembered=remembered)
    assert (target.place, target.host, target.ct) == ("proxmox", "pve", 250)
    target = resolve_target(config, TargetFlags(user="admin"), remembered=remembered)
    assert target.user == "admin" and target.ct == 250
    target = resolve_target(config, TargetFlags(target="plain"), remembered=remembered)
    assert target.host == "box"
    gone = TargetFlags(target="removed")
    with pytest.raises(ConfigError, match="remembered"):
        resolve_target(config, TargetFlags(), remembered=gone)


def test_state_round_trip(tmp_path: Path) -> None:
    assert state.load(tmp_path) is None
    record = state.DeployRecord(
        flags=TargetFlags(host="h", ct=200, port=22),
        target="ct 200 on h:22",
        release="r1",
        deployed_at="2026-01-01T00:00:00Z",
    )
    state.save(tmp_path, record)
    assert state.load(tmp_path) == record
    state.state_path(tmp_path).write_text("{not json")
    with pytest.raises(ConfigError, match="state.json"):
        state.load(tmp_path)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ('place = "ssh"', "no host"),
        ('place = "proxmox"\nhost = "h"', "no container id"),
        ('place = "ssh"\nhost = "h"\nct = 200', 'place is "ssh"'),
        ('place = "local"\nhost = "h"', 'place is "local"'),
        ('place = "ssh"\nhost = "h"\nroot = "relative"', "root"),
        ('place = "ssh"\nhost = "h"\ncheckpoints = "/"', "checkpoints"),
        ('place = "ssh"\nhost = "-oProxyCommand=x"', "host"),
        ('place = "ssh"\nhost = "h"\nport = 70000', "port"),
        ("timeout = 0", "timeout = 0 is not a number of seconds above 0"),
        ("timeout = -1.5", "timeout = -1.5 is not"),
        ("timeout = inf", "timeout = inf is not"),
        ("timeout = nan", "timeout = nan is not"),
    ],
)
def test_target_combinations(tmp_path: Path, fields: str, words: str) -> None:
    config = load_config(write(tmp_path, f"[target]\n{fields}\n"))
    with pytest.raises(ConfigError, match=words):
        resolve_target(config, TargetFlags(), remembered=None)


def test_local_relative_paths_are_under_config_folder(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, '[target]\nroot = "run"\ncheckpoints = "ck"\n'))
    target = resolve_target(config, TargetFlags(), remembered=None)
    assert target.root == str(tmp_path / "run") and target.checkpoints == str(tmp_path / "ck")


# -- the TOML writer --------------------------------------------------------------------------

_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
_scalar = st.one_of(
    _text,
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
    st.booleans(),
)
_value = st.recursive(
    _scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_text, inner, max_size=4)),
    max_leaves=12,
)


@given(st.dictionaries(_text, _value, max_size=6))
def test_toml_writer_round_trips(table: dict) -> None:  # type: ignore[type-arg]
    assert tomllib.loads(toml_writer.dumps(table)) == table


def test_toml_writer_special_floats_and_nesting() -> None:
    text = toml_writer.dumps({"a": {"b": {}}, "x": math.inf, "y": -math.inf, "z": [{"k": 1}]})
    back = tomllib.loads(text)
    assert back["a"] == {"b": {}} and back["x"] == math.inf and back["y"] == -math.inf
    assert back["z"] == [{"k": 1}]
    assert math.isnan(tomllib.loads(toml_writer.dumps({"n": math.nan}))["n"])


def test_venv_is_the_jobs_python_keyed_by_what_it_is_built_from(tmp_path: Path) -> None:
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "requirements.txt").write_text("# comment\ntorch>=2.6\nnumpy\n")
    text = REMOTE_DEFAULT + '[venv]\ntorch_index = "https://download.pytorch.org/whl/cu128"\n'
    config = load_config(write(tmp_path, text))
    target = resolve_target(config, TargetFlags(), remembered=None)
    assert target.venv is not None and target.venv.base == "/opt/venv/bin/python"
    assert target.python == f"{target.venv.folder}/bin/python"
    assert target.venv.folder.startswith(f"{target.root}/venvs/")  # the project's own root
    assert target.venv.config.requirements == "torch>=2.6\nnumpy\n"
    assert target.venv.config.torch == "torch>=2.6"
    other = resolve_target(config, TargetFlags(target="other"), remembered=None)
    assert other.venv is not None and other.venv.folder != target.venv.folder  # another base
    (tmp_path / "trainer" / "requirements.txt").write_text("torch>=2.7\nnumpy\n")
    changed = resolve_target(load_config(tmp_path / "deploy.toml"), TargetFlags(), remembered=None)
    assert changed.venv is not None and changed.venv.folder != target.venv.folder
    # What the place is told: torch first from the index, then the rest; the modules checked.
    argv = environment.venv_argv(target, Setup(target=target, job=config.job, modules=("numpy",)))
    options = dict(zip(argv[5::2], argv[6::2], strict=False))
    assert options["--torch-index"] == "https://download.pytorch.org/whl/cu128"
    assert options["--torch"] == "torch>=2.6" and options["--python"] == "/opt/venv/bin/python"
    assert argv[-1] == "numpy" and "--wheels" not in options
