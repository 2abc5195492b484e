"""`run.profile_steps`: a real run records the steps asked for (also when it ends or resumes
inside the window) into readable files, and kernels are sorted into kinds."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from tests.trainer.test_train import tiny_config
from trainer.run.profiling import by_kind, kind_of
from trainer.run.trainer import Trainer
from trainer.settings.config import TrainConfigError
from trainer.settings.loading import config_from_dict


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo-assets")


def _run(assets: Path, out: Path, until: int | None = None, **run: int) -> list[str]:
    lines: list[str] = []
    cfg = tiny_config(assets, run={"steps": 8, **run})
    Trainer(cfg, out, emit=lines.append).run(until=until)
    return lines


def test_records_the_asked_steps_into_readable_files(tmp_path, assets) -> None:
    lines = _run(assets, tmp_path / "run", profile_start=2, profile_steps=3)
    folder = tmp_path / "run" / "profile"
    assert sorted(p.name for p in folder.iterdir()) == [
        "steps-3-5.json",
        "steps-3-5.trace.json.gz",
        "steps-3-5.txt",
    ]
    report = json.loads((folder / "steps-3-5.json").read_text())
    assert (report["first"], report["last"], report["device"]) == (3, 5, "cpu")
    assert report["kernel_ms"] > 0 and report["wall_ms"] > 0
    kinds = {row["kind"] for row in report["kinds"]}
    assert {"matmul", "attention forward", "attention backward", "optimizer"} <= kinds
    assert sum(row["share"] for row in report["kinds"]) == pytest.approx(1.0)
    with gzip.open(folder / "steps-3-5.trace.json.gz", "rt") as f:
        trace = json.load(f)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names and "Optimizer.step#AdamW.step" in names
    said = [line for line in lines if line.startswith("profile of steps 3–5:")]
    assert len(said) == 1 and "CPU ops" in said[0] and str(folder / "steps-3-5.txt") in said[0]
    table = (folder / "steps-3-5.txt").read_text()
    assert table.startswith(said[0]) and "aten::mm" in table
    # the steps around the window are logged as usual
    steps = [json.loads(r)["step"] for r in (tmp_path / "run" / "metrics.jsonl").open()]
    assert steps == list(range(1, 9))


def test_a_run_that_ends_inside_the_window_writes_what_it_recorded(tmp_path, assets) -> None:
    _run(assets, tmp_path / "run", until=6, profile_start=4, profile_steps=10)
    report = json.loads((tmp_path / "run" / "profile" / "steps-5-6.json").read_text())
    assert (report["first"], report["last"]) == (5, 6)


def test_a_run_resumed_past_the_start_records_its_first_steps(tmp_path, assets) -> None:
    cfg = tiny_config(assets, run={"steps": 8, "checkpoint_every": 4})
    Trainer(cfg, tmp_path / "run", emit=lambda _: None).run(until=4)
    assert not (tmp_path / "run" / "profile").exists()  # profiling is off by default
    _run(assets, tmp_path / "run", checkpoint_every=4, profile_start=1, profile_steps=2)
    names = sorted(p.name for p in (tmp_path / "run" / "profile").iterdir())
    assert names[0] == "steps-5-6.json"


@pytest.mark.parametrize("key", ["profile_steps", "profile_start"])
def test_negative_settings_are_refused(key: str) -> None:
    with pytest.raises(TrainConfigError, match=f"run.{key}"):
        config_from_dict({"run": {key: -1}})


@pytest.mark.parametrize(
    "name,kind",
    [
        ("triton_tem_fused_flex_attention_backward_0", "attention backward"),
        ("triton_tem_fused_flex_attention_0", "attention forward"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention forward"),
        ("triton_poi_fused_create_block_mask_3", "block mask"),
        ("_stats_kernel", "loss kernels"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
        ("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NTT", "matmul"),
        ("aten::addmm", "matmul"),
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
            "optimizer",
        ),
        ("ncclDevKernel_SendRecv", "communication"),
        ("Memcpy HtoD (Pageable -> Device)", "copies"),
        ("void at::native::vectorized_elementwise_kernel<4, ...>", "other"),
    ],
)
def test_kernel_kinds(name: str, kind: str) -> None:
    assert kind_of(name) == kind


def test_kinds_add_up_largest_first() -> None:
    rows = by_kind([("nvjet_a", 600.0), ("nvjet_b", 200.0), ("_grad_kernel", 100.0)], 1000.0)
    assert rows == [
        {"kind": "matmul", "ms_per_step": 0.8, "share": 0.8},
        {"kind": "loss kernels", "ms_per_step": 0.1, "share": 0.1},
    ]


def test_one_trainer_records_once_across_calls(tmp_path, assets) -> None:
    cfg = tiny_config(assets, run={"steps": 8, "profile_start": 1, "profile_steps": 2})
    trainer = Trainer(cfg, tmp_path / "run", emit=lambda _: None)
    trainer.run(until=2)
    trainer.run()
    names = sorted(p.name for p in (tmp_path / "run" / "profile").glob("*.json"))
    assert names == ["steps-2-2.json"]
