"""The stages of `bench/seed_size.py`, each run in a process of its own (`run`): the target's
feature forward (with the kernels transformers finds, with its reference, compiled), the
drafter's training step (default and CuTe-DSL attention kernels) and the split run. Every
stage rewrites <out>/<stage>.json after each figure, so a stage killed at its cap keeps what it
measured. Module docstring of `bench/seed_size.py`: what each stage measures and why.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import GIB, sync, time_ms
from bench.flops import drafter_step_flops, target_forward_flops

PEAK_BF16 = 989e12  # H200 dense bf16, as the other benchmarks count MFU
BLOCKED = ("fla", "causal_conv1d")  # what the fallback stage makes unimportable


class Record:
    """A stage's JSON, rewritten whole after every change."""

    def __init__(self, path: Path, **fields: Any) -> None:
        self.path, self.data = path, dict(fields)
        self.save()

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.save()

    def append(self, key: str, value: Any) -> None:
        self.data.setdefault(key, []).append(value)
        self.save()

    def save(self) -> None:
        write_json(self.path, self.data)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Written whole, then renamed: a reader never sees half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    tmp.replace(path)


def read_json(path: Path) -> dict[str, Any] | None:
    """A stage's JSON, None where the stage wrote none (not started, killed before it began)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def say(msg: str, indent: str = "  ") -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {indent}{msg}", flush=True)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def import_status(module: str) -> str:
    """The module's version when it imports, else why not (one line)."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # an import may fail with anything, the message says what
        return f"does not import ({first_line(exc)})"
    top = sys.modules.get(module.split(".")[0])
    return str(getattr(mod, "__version__", None) or getattr(top, "__version__", "imports"))


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "gpus": torch.cuda.device_count(),
    }
    for name, module in (
        ("triton", "triton"),
        ("fla", "fla.ops.gated_delta_rule"),
        ("causal_conv1d", "causal_conv1d"),
        ("flash_attn_cute", "flash_attn.cute"),
    ):
        blocked = module.split(".")[0] in sys.modules and sys.modules[module.split(".")[0]] is None
        env[name] = "unimportable in this stage" if blocked else import_status(module)
    return env


def device_of(smoke: bool) -> torch.device:
    return torch.device("cpu") if smoke else torch.device("cuda", 0)


def target_config(spec: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    t = dict(spec["target"])
    theta = t.pop("rope_theta")
    rope = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25}
    return AutoConfig.for_model("qwen3_5_text", **t, rope_parameters=rope, pad_token_id=0)


def write_data(path: Path, spec: dict[str, Any], samples: int) -> None:
    from bench.bench_pipeline import write_data as write

    write(path, {"seq_len": spec["seq_len"], "target": spec["target"], "samples": samples})


def train_config(spec: dict[str, Any], data: Path, device: torch.device, **run: Any) -> Any:
    """The run's config at the seed's shape: the published drafter, one sequence a step."""
    from trainer.settings.loading import config_from_dict

    bucket = 128 if spec["seq_len"] >= 1024 else 64
    return config_from_dict(
        {
            "model": {"target": "in-memory", **spec["drafter"]},
            "data": {
                "path": str(data),
                "max_len": spec["seq_len"],
                "num_anchors": spec["num_anchors"],
                "bucket": bucket,
                "noise": 0.01,
            },
            "optim": {"lr": 3e-4, "warmup_steps": 2},
            "loss": {"kl_weight": 0.15},
            "run": {"steps": 1000, "device": device.type, "checkpoint_every": 0, **run},
        }
    )


def load(spec: dict[str, Any], device: torch.device) -> Any:
    """The target as a target rank loads it (`trainer.model.target.load_target`, a config in
    memory: random weights made on `device`)."""
    from trainer.model.target import load_target

    layers = spec["drafter"]["num_target_layers"]
    return load_target(target_config(spec), device=device, num_layers=layers, seed=0)


# ---- the target -------------------------------------------------------------------------------


def stage_target(spec: dict[str, Any], out: Path, cap_s: float, mode: str, smoke: bool) -> None:
    """`mode`: "kernels" (whatever transformers finds), "fallback" (its reference: `fla` and
    `causal_conv1d` made unimportable before transformers binds), "compiled"."""
    if mode == "fallback":
        for name in BLOCKED:
            sys.modules[name] = None  # type: ignore[assignment]  # import raises ImportError
    began = time.perf_counter()
    device = device_of(smoke)
    name = {"kernels": "target", "fallback": "target-fallback"}.get(mode, f"target-{mode}")
    rec = Record(out / f"{name}.json", stage=name, mode=mode, env=environment(device))
    from trainer.model.linear_attention import bound_ops

    target = load(spec, device)
    sync(device)
    rec["build_s"] = round(time.perf_counter() - began, 1)
    weights = torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None
    rec["weights_gib"] = weights
    paths = bound_ops("qwen3_5_text", device_type=device.type)
    rec["linear_attention"] = {p.op: p.kernel or p.fallback for p in paths}
    say(f"{name}: built in {rec.data['build_s']} s; {rec.data['linear_attention']}")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.jsonl"
        write_data(data, spec, samples=2)
        lengths_timed(spec, target, data, rec, began, cap_s, mode, weights)
    if mode == "kernels" and device.type == "cuda":
        try:
            rec["conv"] = conv_alone(spec, device)
        except Exception as exc:  # the forward's figures stand; the reason is the record here
            rec["conv"] = {"error": first_line(exc)}


def lengths_timed(
    spec: dict[str, Any],
    target: Any,
    data: Path,
    rec: Record,
    began: float,
    cap_s: float,
    mode: str,
    weights: float | None,
) -> None:
    """Each length: untimed forwards (kernels' first launch, compiles), then timed ones; a
    length whose forwards the cap cannot fit, predicted from the length before, is skipped."""
    from trainer.data.dataset import BatchStream, load_samples
    from trainer.run.target_worker import TargetWorker

    device = target.device
    cfg = train_config(spec, data, device, compile_target=mode == "compiled")
    worker = TargetWorker.for_run(target, cfg)
    rec["compiled"] = worker.compiled
    last: tuple[int, float] | None = None
    for i, tokens in enumerate(spec["lengths"]):
        untimed, timed = spec["reps"][tokens]
        if mode == "fallback" and i:
            untimed = 0  # no kernel to launch first: the reference's first call is its cost
        if last is not None:
            predicted = last[1] * tokens / last[0] * 1.3 * (untimed + timed)
            if time.perf_counter() - began + predicted > cap_s - 5:
                rec.append("rows", {"tokens": tokens, "skipped": f"predicted {predicted:.0f} s"})
                continue
        stream = BatchStream(
            load_samples(data, max_len=tokens), cfg.data, block_size=cfg.model.block_size, seed=0
        )
        batch = stream.next_batch()
        start = time.perf_counter()
        for _ in range(untimed):
            worker.produce(batch)
        sync(device)
        first_s = time.perf_counter() - start
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for _ in range(timed):
            features = worker.produce(batch)
        sync(device)
        seconds = (time.perf_counter() - start) / timed
        last = (tokens, seconds)
        flops = target_forward_flops(target.model, tokens)
        row = {
            "tokens": tokens,
            "untimed": untimed,
            "timed": timed,
            "untimed_s": round(first_s, 2),
            "s_per_forward": seconds,
            "tokens_per_s": tokens / seconds,
            "flops": flops,
            "tflops": flops["total"] / seconds / 1e12,
            "mfu": flops["total"] / seconds / PEAK_BF16,
            "features_gib": (features.hidden.nbytes + features.last_hidden.nbytes) / GIB,
        }
        if device.type == "cuda" and weights is not None:
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
            row["peak_above_weights_gib"] = row["peak_gib"] - weights
        rec.append("rows", row)
        say(f"{tokens} tokens: {seconds:.3f} s, {row['tokens_per_s']:,.0f} tok/s, "
            f"MFU {100 * row['mfu']:.1f} %")  # fmt: skip


def conv_alone(spec: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The linear-attention layers' short causal convolution alone at the longest length, in
    the layout the layer hands it: what transformers bound (its F.conv1d fallback without the
    causal-conv1d package) beside fla's Triton kernel, per layer and per forward."""
    from trainer.model.linear_attention import kernel_of, linear_layers, modeling_module

    t = spec["target"]
    channels = 2 * t["linear_num_key_heads"] * t["linear_key_head_dim"]
    channels += t["linear_num_value_heads"] * t["linear_value_head_dim"]
    tokens, layers = spec["lengths"][-1], linear_layers(target_config(spec))[0]
    x = torch.randn(1, tokens, channels, device=device, dtype=torch.bfloat16)  # (B, T, D)
    w = torch.randn(channels, t["linear_conv_kernel_dim"], device=device, dtype=torch.bfloat16)
    bound = modeling_module("qwen3_5_text").causal_conv1d_fn
    ms = time_ms(
        lambda: bound(x.transpose(1, 2), w, None, activation="silu"), device, warmup=2, reps=5
    )
    out: dict[str, Any] = {
        "tokens": tokens,
        "channels": channels,
        "bound": kernel_of(bound) or "PyTorch reference (F.conv1d)",
        "bound_ms_per_layer": ms,
        "bound_ms_per_forward": ms * layers,
    }
    try:
        from fla.modules.causal_conv1d.ops import causal_conv1d

        fla_ms = time_ms(
            lambda: causal_conv1d(x, w, None, activation="silu"), device, warmup=2, reps=5
        )
        out |= {"fla_triton_ms_per_layer": fla_ms, "fla_triton_ms_per_forward": fla_ms * layers}
    except Exception as exc:  # no fla, or its kernel fails here: the reason is the figure
        out["fla_triton"] = first_line(exc)
    return out


# ---- the drafter ------------------------------------------------------------------------------


def stage_drafter(
    spec: dict[str, Any], out: Path, kernels: str, smoke: bool, *, recompute: bool = False
) -> None:
    """The drafter rank's step; `recompute`: with `run.recompute_layers` (the layers run again
    in the backward instead of keeping their activations)."""
    name = "drafter" + (f"-{kernels}" if kernels != "auto" else "") + "-recompute" * recompute
    device = device_of(smoke)
    rec = Record(
        out / f"{name}.json", stage=name, kernels=kernels, recompute=recompute,
        env=environment(device),
    )  # fmt: skip
    if kernels == "flash":
        if device.type != "cuda":
            rec["unavailable"] = "needs CUDA"
            return
        from trainer.base.errors import TrainerError
        from trainer.model.attention import check_flash_backend

        try:
            check_flash_backend(torch.cuda.get_device_capability(device))
        except TrainerError as exc:
            rec["unavailable"] = str(exc)
            return
    from trainer.data.dataset import BatchStream, load_samples
    from trainer.model.drafter import shape_from_target
    from trainer.model.target import default_target_layers
    from trainer.run.pipeline import DrafterWorker

    t = spec["target"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.jsonl"
        write_data(data, spec, samples=2)
        cfg = train_config(
            spec, data, device, attention_kernels=kernels, recompute_layers=recompute
        )
        batch = BatchStream(
            load_samples(data), cfg.data, block_size=cfg.model.block_size, seed=0
        ).next_batch()
    layers = default_target_layers(t["num_hidden_layers"], spec["drafter"]["num_target_layers"])
    shape = shape_from_target(target_config(spec), cfg.model, num_features=len(layers))
    frozen = {k: 0.02 * torch.randn(t["vocab_size"], t["hidden_size"], device=device, dtype=dtype)
              for k in ("embed_weight", "lm_head_weight")}  # fmt: skip
    torch.manual_seed(0)
    worker = DrafterWorker.for_config(shape, cfg, device, **frozen)
    rec["drafter"] = worker.drafter.describe()
    rec["target_layers"] = layers
    features = seed_features(batch, len(layers) * t["hidden_size"], t["hidden_size"], device, dtype)
    on_device = batch.to(device)  # the mask's pairs are counted where they are quick to count
    flops = drafter_step_flops(shape, on_device, kl=cfg.loss.kl_weight > 0)
    rec["flops_per_step"] = flops
    steps: list[float] = []
    for i in range(spec["warmup_steps"] + spec["timed_steps"]):
        if i == 1 and device.type == "cuda":  # past the first step's compiles
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        start = time.perf_counter()
        worker.train_step(features, i)  # ends with the host reading its figures
        steps.append(time.perf_counter() - start)
        rec["step_s"] = steps
        say(f"{name} step {i}: {steps[-1]:.2f} s")
        if i:  # a figure from the second step on, the untimed steps left out once there are more
            timed = steps[spec["warmup_steps"] :] or steps[1:]
            rec["result"] = step_result(timed, batch, shape, flops, device) | {
                "compiled_layers": worker.compiled
            }
    if device.type == "cuda":  # one step more, its peak taken apart
        from bench.memory_peak import peak_breakdown

        n = len(steps)
        rec["memory_at_peak"] = peak_breakdown(lambda: worker.train_step(features, n), device)
        say(f"{name}: peak {rec['memory_at_peak']['peak_gib']:.1f} GiB")
        for row in rec["memory_at_peak"]["rows"]:
            say(f"  {row['gib']:6.2f} GiB  {row['where']}")


def step_result(
    timed: list[float], batch: Any, shape: Any, flops: float, device: torch.device
) -> dict[str, Any]:
    step_s = sum(timed) / len(timed)
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    return {
        "step_s": step_s,
        "timed_steps": len(timed),
        "tokens": batch.num_tokens,
        "queries": int(batch.valid.sum()) * shape.block_size,
        "tokens_per_s": batch.num_tokens / step_s,
        "tflops": flops / step_s / 1e12,
        "mfu": flops / step_s / PEAK_BF16,
        "peak_gib": peak,
    }


def seed_features(
    batch: Any, width: int, hidden: int, device: torch.device, dtype: torch.dtype
) -> Any:
    """What a target rank sends for `batch`: its ids, anchors and labels, with random hidden
    states of the target's width in place of the target's (the drafter's work is the same)."""
    from trainer.run.target_worker import Features

    gen = torch.Generator(device=device).manual_seed(0)
    rows, seq = batch.input_ids.shape
    on = batch.to(device)
    return Features(
        hidden=torch.randn(rows, seq, width, device=device, dtype=dtype, generator=gen),
        last_hidden=torch.randn(rows, seq, hidden, device=device, dtype=dtype, generator=gen),
        input_ids=on.input_ids,
        anchors=on.anchors,
        valid=on.valid,
        labels=on.labels,
        num_tokens=batch.num_tokens,
        host_labels=batch.labels,
    )


# ---- the split --------------------------------------------------------------------------------


def stage_split(spec: dict[str, Any], out: Path, smoke: bool) -> None:
    """The split run at the planned split of this machine's GPUs (two CPU ranks on gloo for the
    smoke): measured tokens/s beside the plan's prediction from stages 1 and 2."""
    from bench.seed_plan import plan_for_gpus

    device = device_of(smoke)
    gpus = 2 if smoke else torch.cuda.device_count()
    rec = Record(out / "split.json", stage="split", env=environment(device), gpus=gpus)
    if gpus < 2:
        rec["skipped"] = f"{gpus} GPU: no split to run"
        return
    stages = {s: read_json(out / f"{s}.json") for s in ("target", "drafter")}
    targets, predicted = plan_for_gpus(stages, gpus)
    rec["targets"], rec["drafters"], rec["predicted_tokens_per_s"] = (
        targets,
        gpus - targets,
        predicted,
    )
    import torch.multiprocessing as mp

    from bench.bench_pipeline import measured_rate

    with tempfile.TemporaryDirectory() as tmp:
        data, run = Path(tmp) / "data.jsonl", Path(tmp) / "run"
        write_data(data, spec, samples=spec["split_steps"] * gpus + 4)
        # the store held here, as torchrun's agent holds it: its port is the OS's pick, bound
        # before any rank starts (a port found free and bound later may be taken meanwhile)
        store = _agent_store()
        mp.spawn(split_rank, args=(gpus, store.port, targets, spec, str(data), str(run), smoke),
                 nprocs=gpus)  # fmt: skip
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    measured = measured_rate(rows, spec["split_warmup"])
    rec["measured_tokens_per_s"] = measured
    rec["plan_efficiency"] = measured / predicted if predicted else None


def split_rank(
    rank: int, world: int, port: int, targets: int, spec: dict, data: str, run: str, smoke: bool
) -> None:
    """One rank of the split run (spawned), its environment as torchrun would set it."""
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True",
                      DFLASH_TARGET_GPUS=str(targets))  # fmt: skip
    from trainer.split.roles import roles_from_env
    from trainer.split.session import run_split

    device = device_of(smoke)
    cfg = train_config(spec, Path(data), device, steps=spec["split_steps"], log_every=1)
    roles = roles_from_env()
    assert roles is not None
    run_split(cfg, run, roles, target_loader=lambda c, d: load(spec, d), save_checkpoints=False)


def _agent_store() -> Any:
    """A TCP store on a port the OS picks, that the ranks join as clients."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=300))


# ---- dispatch ---------------------------------------------------------------------------------


def run(stage: str, spec: dict[str, Any], out: Path, *, cap_s: float, smoke: bool) -> int:
    if smoke:
        torch.set_num_threads(1)
    if stage.startswith("target"):
        mode = {"target": "kernels"}.get(stage, stage.removeprefix("target-"))
        stage_target(spec, out, cap_s, mode, smoke)
    elif stage.startswith("drafter"):
        kernels = "flash" if "-flash" in stage else "auto"
        stage_drafter(spec, out, kernels, smoke, recompute=stage.endswith("-recompute"))
    elif stage == "split":
        stage_split(spec, out, smoke)
    else:
        print(f"unknown stage {stage!r}", file=sys.stderr)
        return 2
    return 0
