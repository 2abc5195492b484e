"""`dflash status` per GPU: nvidia-smi readings at the place (a stand-in executable first on the
job's PATH) joined with the metrics rows the trainer's own writer (`trainer.run.metrics`) logs for a
split run, on this machine, over the loopback SSH host and in a container of the Proxmox
stand-in; and what happens without nvidia-smi
or with a driver that does not answer."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed import HashStore

from dflash_ops.commands import gpus
from tests.cli_helpers import Where, container_defaults, kill_tmux_server
from trainer.run.metrics import GIB, METRICS, RankStats, RoleMetrics, append_row
from trainer.split.roles import Roles

STANDIN = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia_smi_standin"  # copied per test
STD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# util %, MiB used, MiB total of physical GPUs 0…3 as the stand-in prints them
SMI = [(87, 40312, 143771), (12, 20011, 143771), (99, 70000, 143771), ("[N/A]", 3, 143771)]
VISIBLE = [2, 0, 1]
CT = 200  # CUDA_VISIBLE_DEVICES: local rank r runs on physical GPU VISIBLE[r]


def write_split_metrics(out: Path, *, targets: int, world: int, steps: int = 2) -> dict[str, Any]:
    """Rows of a split run as drafter rank 0 logs them: every rank publishes its counters into
    a store, `RoleMetrics.fields` turns them into the split's fields of the metrics.jsonl row. The CUDA readings a GPU
    rank would publish (its device index, torch's allocated memory) are filled in by hand."""
    store = HashStore()
    stats = []
    for rank in range(world):
        roles = Roles(rank=rank, world_size=world, local_rank=rank, num_targets=targets)
        stats.append(
            RankStats(SimpleNamespace(roles=roles, device=torch.device("cpu"), store=store))
        )
    lead = SimpleNamespace(roles=stats[targets].session.roles, store=store)
    writer = RoleMetrics(lead)
    row: dict[str, Any] = {}
    for step in range(1, steps + 1):
        for st in stats:
            st.batches += 1
            st.tokens += 512 * (st.session.roles.rank + 1)
            st.wait_s += 0.01 * st.session.roles.rank
            st.in_flight = 2 if st.session.roles.role == "target" else 0
            gpu = st.session.roles.local_rank
            snap = {**st.snapshot(), "gpu": gpu, "mem_gib": 10.0 + gpu, "mem_peak_gib": 20.0}
            store.set(f"stats/{st.session.roles.rank}", json.dumps(snap))
        store.add("produced", 3)
        store.add("trained", 2)
        fields, _ = writer.fields()
        row = {
            "step": step, "time": time.time(), "loss": 1.0, "ce": 1.0, "kl": 0.0, "cap": 0.0,
            "lr": 1e-3, "grad_norm": 1.0, "slot_accuracy": [None, 0.5], "tokens": 512,
            "tokens_per_s": 1000.0, **fields,
        }  # fmt: skip
        append_row(out / METRICS, row)
    return row


@dataclass
class GpuPlace(Where):
    """A place whose job PATH can hold a stand-in nvidia-smi copied to `standin_host`."""

    standin_at: str = ""  # the stand-in's folder as the place sees it
    standin_host: Path = Path("/nonexistent")  # the same folder as this machine sees it


@pytest.fixture(params=["local", "ssh", "proxmox"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[GpuPlace]:
    project = tmp_path / "project"
    project.mkdir()
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    smi = tmp_path / "smi"
    if request.param == "local":
        root = project / ".dflash" / "local"
        spot = GpuPlace("local", project, [], root, root / "checkpoints", socket)
        spot.standin_at, spot.standin_host = str(smi), smi
    elif request.param == "proxmox":  # inside the container: its own /root
        proxmox = request.getfixturevalue("proxmox")
        proxmox.create(CT)
        flags = ["--host", proxmox.alias, "--ct", str(CT)]
        root, ckpt = container_defaults(proxmox, CT, project)
        spot = GpuPlace("proxmox", project, flags, root, ckpt, socket)
        spot.standin_at, spot.standin_host = "/root/smi", proxmox.root_dir(CT) / "smi"
    else:
        request.getfixturevalue("ssh_home")
        root, ckpt = tmp_path / "remote-root", tmp_path / "remote-ckpt"
        flags = ["--target", "box", "--host", "testbox"]
        spot = GpuPlace("ssh", project, flags, root, ckpt, socket)
        spot.standin_at, spot.standin_host = str(smi), smi
        spot.targets = (
            f'[targets.box]\nplace = "ssh"\nhost = "elsewhere"\n'
            f'root = "{root}"\ncheckpoints = "{ckpt}"\n'
        )
    yield spot
    if request.param != "proxmox":  # a container's tmux ends with the container
        kill_tmux_server(socket)


def smi_env(where: GpuPlace, *, driver_down: bool = False, **extra: str) -> dict[str, str]:
    """The job's env with a copy of the nvidia-smi stand-in first on PATH, told what to print,
    and an env value that must stay off nvidia-smi's command line."""
    folder = where.standin_host
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy2(STANDIN / "nvidia-smi", folder / "nvidia-smi")
    (folder / "gpus").write_text(",".join(":".join(str(v) for v in gpu) for gpu in SMI))
    if driver_down:
        (folder / "driver-down").touch()
    return {"PATH": f"{where.standin_at}:{STD_PATH}", "HF_TOKEN": "hf_secret", **extra}


def test_status_shows_each_gpu_with_its_role(where: GpuPlace) -> None:
    visible = ",".join(map(str, VISIBLE))
    env = smi_env(where, CUDA_VISIBLE_DEVICES=visible)
    where.config("echo up; exec sleep 600", env=env, extra="gpus = 3\n")
    deployed = where.run("deploy", *where.flags)
    assert deployed.returncode == 0, deployed.stderr
    row = write_split_metrics(where.checkpoints, targets=1, world=3)

    report = where.status()
    assert report["running"] and report["gpu_note"] is None
    assert report["split"] == {
        "roles": row["roles"], "in_flight": row["in_flight"], "batches": row["batches"],
    }  # fmt: skip
    assert row["in_flight"] == 2 and row["roles"]["drafter"]["ranks"] == 2
    by_physical = {VISIBLE[r["gpu"]]: r for r in row["ranks"]}
    assert [g["index"] for g in report["gpus"]] == list(range(len(SMI)))
    for gpu, (util, used, total) in zip(report["gpus"], SMI, strict=True):
        assert gpu["util_pct"] == (None if util == "[N/A]" else util)
        assert (gpu["mem_used_mib"], gpu["mem_total_mib"]) == (used, total)
        rank = by_physical.get(gpu["index"])
        if rank is None:
            assert (gpu["role"], gpu["ranks"], gpu["mem_gib"]) == ("—", [], None)
        else:
            assert (gpu["role"], gpu["ranks"]) == (rank["role"], [rank["rank"]])
            assert gpu["mem_gib"] == rank["mem_gib"]
    assert report["gpus"][2]["role"] == "target"  # rank 0 on local device 0 = physical 2
    seen = (where.standin_host / "last-env").read_text()
    assert f"PATH={env['PATH']}\n" in seen and "hf_secret" not in seen  # only PATH passed on

    human = where.run("status")
    assert human.returncode == 0, human.stderr
    lines = human.stdout.splitlines()
    assert any(line.startswith("split") and "batches in flight" in line for line in lines)
    table = [line.split() for line in lines if line.split()[:1] in (["0"], ["1"], ["2"], ["3"])]
    assert [cells[:2] for cells in table] == [
        ["0", "drafter"], ["1", "drafter"], ["2", "target"], ["3", "—"],
    ]  # fmt: skip
    assert table[0][3] == "87%" and table[3][3] == "?" and table[2][-1] == f"{10.0:.1f}"


def test_status_without_nvidia_smi_or_driver(where: GpuPlace, tmp_path: Path) -> None:
    where.config("echo up; exec sleep 600", env=smi_env(where, driver_down=True))
    assert where.run("deploy", *where.flags).returncode == 0
    broken = where.status()
    assert broken["gpus"] is None and broken["running"]
    assert broken["gpu_note"].startswith("nvidia-smi failed (exit 9): NVIDIA-SMI has failed")
    human = where.run("status")
    assert human.returncode == 0 and "couldn't communicate with the NVIDIA driver" in human.stdout

    empty = tmp_path / "no-tools"
    empty.mkdir()
    # read by status; no redeploy needed
    where.config("echo up; exec sleep 600", env={"PATH": str(empty)})
    absent = where.status()
    assert (absent["gpus"], absent["gpu_note"]) == (None, "no nvidia-smi at the place")
    assert absent["split"] is None and absent["running"]


def test_a_colocated_run_holds_the_first_visible_gpu() -> None:
    readings = gpus.parse("0, 50, 10, 100\n1, 0, 0, 100\n")
    rows = gpus.table(readings, {"step": 3, "loss": 0.5}, env={"CUDA_VISIBLE_DEVICES": "1"})
    assert [(r["index"], r["role"]) for r in rows] == [(0, "—"), (1, "colocated")]
    assert [r["role"] for r in gpus.table(readings, None, env={})] == ["—", "—"]
    with pytest.raises(ValueError):
        gpus.parse("0, 50, 10\n")


def test_other_nodes_ranks_are_not_this_nodes_gpus(tmp_path: Path) -> None:
    row = write_split_metrics(tmp_path, targets=1, world=2)
    here = row["ranks"][0]["host"]
    row["ranks"][1] = {**row["ranks"][1], "host": "node1", "gpu": 0}  # same local index, elsewhere
    assert gpus.hosts_of(row) == {here, "node1"}
    rows = gpus.table(gpus.parse("0, 1, 1, 2\n"), row, env={}, host=here)
    assert (rows[0]["role"], rows[0]["ranks"], rows[0]["mem_gib"]) == ("target", [0], 10.0)
    assert row["ranks"][0]["mem_gib"] == 10.0 and GIB > 0


def test_a_cpu_job_on_a_place_with_gpus_is_warned_about(where: GpuPlace) -> None:
    """`[job] gpus = 0` (what `init` writes when it cannot count) on a place with four GPUs:
    deploy and doctor say so, with the fix; an empty CUDA_VISIBLE_DEVICES says it is meant."""
    where.config("echo up; exec sleep 600", env=smi_env(where))
    deployed = where.run("deploy", *where.flags)
    assert deployed.returncode == 0, deployed.stderr
    config = where.project / "deploy.toml"
    assert "has 4 GPUs, but [job] gpus = 0: the job trains on the CPU." in deployed.stderr
    assert f"hint: Set gpus = 4 under [job] in {config}" in deployed.stderr
    if where.kind == "local":  # the job's python has torch here
        doctor = where.run("doctor", "--no-gpu-smoke", "--json")
        assert doctor.returncode == 0, doctor.stdout
        (check,) = [c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "gpu count"]
        assert check["status"] == "warning" and check["ok"]
        assert "has 4 GPUs, but [job] gpus = 0" in check["detail"]
        human = where.run("doctor", "--no-gpu-smoke")
        assert "! gpu count:" in human.stdout and "1 warning above" in human.stderr

    where.config("echo up; exec sleep 600", env=smi_env(where, CUDA_VISIBLE_DEVICES=""))
    meant = where.run("deploy", *where.flags)
    assert meant.returncode == 0 and "GPUs, but" not in meant.stderr, meant.stderr
