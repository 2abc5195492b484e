"""One full drafter training step on CUDA: compiled FlexAttention (BlockMask built once per
batch) and the chunked lm_head loss together, forward and backward, against a small
Qwen3-shaped random target loaded through `save_pretrained`/`from_pretrained` in bf16. Then
steps at other sequence buckets, and again at buckets already seen: those must not compile
anything new, and dynamo must never hit its recompile limit (it would fall back to eager
FlexAttention, which materialises dense scores)."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu


def _target(folder):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(str(folder))


def _batch(length: int, seed: int, *, num_anchors: int = 64, block_size: int = 16):
    from trainer.data.dataset import Sample, collate

    gen = torch.Generator().manual_seed(seed)
    samples = []
    for n in (length, length - 37):
        ids = torch.randint(1, 8192, (n,), generator=gen).tolist()
        samples.append(Sample(ids, [False] * 20 + [True] * (n - 20)))
    gens = [torch.Generator().manual_seed(seed + i) for i in range(2)]
    return collate(
        samples,
        block_size=block_size,
        num_anchors=num_anchors,
        bucket=128,
        pad_token_id=0,
        generators=gens,
    )


def _worker(drafter, target, **settings):  # type: ignore[no-untyped-def]
    """The drafter's training worker as both tests run it (lr 1e-3, no warmup, KL and cap on)."""
    from trainer.run.pipeline import DrafterWorker
    from trainer.settings.config import LossConfig, OptimConfig

    return DrafterWorker(
        drafter,
        embed_weight=target.embed_weight,
        lm_head_weight=target.lm_head_weight,
        optim=OptimConfig(lr=1e-3, warmup_steps=0),
        loss=LossConfig(kl_weight=0.15, cap_weight=0.1),
        total_steps=100,
        **settings,
    )


def _fresh_target_and_shape(folder):  # type: ignore[no-untyped-def]
    """The small target loaded on CUDA (3 feature layers) and a 2-layer drafter's shape for it,
    with dynamo's and the kernels' caches cleared first."""
    from trainer.model.attention import flex_kernels
    from trainer.model.drafter import shape_from_target
    from trainer.model.target import load_target
    from trainer.settings.config import ModelConfig

    torch._dynamo.reset()
    flex_kernels.cache_clear()
    _target(folder / "t")
    target = load_target(folder / "t", device=torch.device("cuda"), num_layers=3)
    shape = shape_from_target(
        target.config, ModelConfig(target="t", num_layers=2, block_size=16), num_features=3
    )
    return target, shape


def test_full_training_step_compiled_flex_and_chunked_loss(tmp_path) -> None:
    from torch._dynamo.utils import counters

    from trainer.model.attention import flex_kernels
    from trainer.model.drafter import Drafter, shape_from_target
    from trainer.model.target import load_target
    from trainer.run.target_worker import TargetWorker
    from trainer.settings.config import ModelConfig

    # Dynamo's recompile limit counts per code object across the whole process, so entries
    # compiled by other GPU tests in this process would count against this training run.
    torch._dynamo.reset()
    flex_kernels.cache_clear()
    counters.clear()
    if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):  # eager fallback = failure
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    _target(tmp_path / "t")
    device = torch.device("cuda")
    target = load_target(tmp_path / "t", device=device, num_layers=3)
    assert target.model.dtype == torch.bfloat16 and target.layers == [1, 3, 5]
    model_cfg = ModelConfig(
        target="t", num_layers=2, block_size=16, sliding_window=64, sliding_layers=[1]
    )
    shape = shape_from_target(target.config, model_cfg, num_features=3)
    drafter = Drafter(shape, attention_backend="auto").to(device)
    worker = _worker(drafter, target, noise=0.05, loss_chunk_rows=128)  # several loss chunks
    producer = TargetWorker(target, compiled=True)  # as a run on CUDA (`run.compile_target`)
    assert flex_kernels().compiled

    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    features = producer.produce(_batch(500, 1))  # bucket 512
    assert features.hidden.shape == (2, 512, 3 * 512) and features.hidden.dtype == torch.bfloat16
    mask = drafter.build_masks(features.anchors, features.valid, 512)
    assert all(m.backend == "flex" for m in mask.values())
    result = worker.train_step(features, 0)
    assert math.isfinite(result.loss) and math.isfinite(result.grad_norm) and result.grad_norm > 0
    assert result.kl > 0 and result.cap < 0
    for name, p in drafter.named_parameters():  # every parameter got a gradient and moved
        assert torch.isfinite(p).all(), name
        assert not torch.equal(p.detach(), before[name]), f"{name} did not change"

    for step, length in enumerate((700, 300, 900), start=1):  # buckets 768, 384, 1024
        r = worker.train_step(producer.produce(_batch(length, step)), step)
        assert math.isfinite(r.loss)
    graphs = counters["stats"]["unique_graphs"]
    for step, length in enumerate((500, 700, 300, 900, 450), start=4):  # seen buckets only
        r = worker.train_step(producer.produce(_batch(length, step)), step)
        assert math.isfinite(r.loss)
    assert counters["stats"]["unique_graphs"] == graphs, "a seen bucket compiled again"
    torch.cuda.synchronize()


def test_a_step_in_two_parts_is_the_whole_batch_step_on_cuda(tmp_path) -> None:
    """`data.micro_batches` on the compiled path: one sequence per part, gradients accumulated,
    one optimizer step. Loss, gradient norm and slot accuracy equal the whole batch's step
    within bf16 rounding (the CPU tests hold it, and the weights after the step, in float64)."""
    from trainer.model.drafter import Drafter
    from trainer.run.target_worker import TargetWorker

    device = torch.device("cuda")
    target, shape = _fresh_target_and_shape(tmp_path)
    features = TargetWorker(target).produce(_batch(500, 1))
    results = []
    for parts in (1, 2):
        torch.manual_seed(0)
        drafter = Drafter(shape, attention_backend="auto").to(device)
        worker = _worker(drafter, target, noise=0.0, micro_batches=parts)
        results.append(worker.train_step(features, 0))
    whole, split = results
    assert split.loss == pytest.approx(whole.loss, rel=2e-3)
    assert split.grad_norm == pytest.approx(whole.grad_norm, rel=2e-2)
    assert split.slot_accuracy == pytest.approx(whole.slot_accuracy, abs=5e-3)
    torch.cuda.synchronize()


def test_a_launched_step_waits_for_nothing_until_its_figures_are_read(tmp_path) -> None:
    """`launch_step` queues the whole step (target features to optimizer step) without one
    device sync, so the host can draw the next batch meanwhile; `result()` is the one wait.
    The step equals the same step planned from CUDA labels (which must sync)."""
    from dataclasses import replace

    from trainer.model.drafter import Drafter
    from trainer.run.target_worker import TargetWorker

    device = torch.device("cuda")
    target, shape = _fresh_target_and_shape(tmp_path)
    producer = TargetWorker(target)
    results = []
    for host in (True, False):
        torch.manual_seed(0)
        drafter = Drafter(shape, attention_backend="auto").to(device)
        worker = _worker(drafter, target, noise=0.05)
        worker.train_step(producer.produce(_batch(500, 1)), 0)  # compiles
        features = producer.produce(_batch(500, 2))
        assert features.host_labels is not None and features.host_labels.device.type == "cpu"
        if not host:
            features = replace(features, host_labels=None)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if host else "default")
        try:
            pending = worker.launch_step(features, 1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results.append(pending.result())
    assert results[0].loss == pytest.approx(results[1].loss, rel=1e-3)
    assert results[0].grad_norm == pytest.approx(results[1].grad_norm, rel=1e-2)
    assert math.isfinite(results[0].loss)


def test_recomputed_layers_take_the_same_step_in_less_memory(tmp_path) -> None:
    """`run.recompute_layers` on the compiled FlexAttention path: the layers' checkpoint traces
    into their graphs (no graph break), the step's loss and gradient norm equal the step that
    keeps the activations within bf16 rounding, and its peak memory above the weights is lower."""
    from torch._dynamo.utils import counters

    from trainer.model.drafter import Drafter
    from trainer.run.target_worker import TargetWorker

    device = torch.device("cuda")
    target, shape = _fresh_target_and_shape(tmp_path)
    features = TargetWorker(target).produce(_batch(2000, 1, num_anchors=256))
    results, peaks = [], []
    for recompute in (False, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        drafter = Drafter(shape, attention_backend="auto", recompute_layers=recompute).to(device)
        drafter.compile_layers()
        worker = _worker(drafter, target, noise=0.0)
        worker.train_step(features, 0)  # compiles; AdamW's state now exists
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        results.append(worker.train_step(features, 1))
        peaks.append(torch.cuda.max_memory_allocated(device) - base)
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    kept, again = results
    assert again.loss == pytest.approx(kept.loss, rel=2e-3)
    assert again.grad_norm == pytest.approx(kept.grad_norm, rel=2e-2)
    assert peaks[1] < 0.7 * peaks[0], peaks
