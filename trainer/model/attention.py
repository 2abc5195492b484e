"""The drafter's attention: block queries over `[context | own block]` keys, two backends.

`build_draft_mask` is called once per batch and its `DraftMask` is shared by every layer;
`draft_attention` runs one layer's attention with it.

Backends:

- ``"flex"``: `torch.compile(flex_attention)` over a `BlockMask` made by a compiled
  `create_block_mask` with `B=Bsz, H=None`: the mask depends on the batch row (each sequence has
  its own anchors) but never on the head, so it is broadcast over heads and never built per
  head. Only the compiled kernel uses the block sparsity; eager FlexAttention materialises the
  fp32 score matrix (320 GiB at the seed's shape), so an eager kernel holder is refused beyond
  the dense budget. The caller pads the context length S to a bucket (a multiple of 128) and
  keeps N·B fixed, so a new batch reuses the compiled kernels: a new BlockMask never
  recompiles, a new length may (dynamo then switches to dynamic shapes after the second one).
- ``"sdpa"``: `F.scaled_dot_product_attention` with the dense boolean mask of the whole batch
  (`trainer.model.masks.batched_dense_mask`) and `enable_gqa`. This is the CPU path: FlexAttention has
  no backward on the CPU. Its mask (and, on the math backend, its fp32 scores) grows with Q·K,
  so it is refused beyond the dense budget with the GiB it would need.
- ``"auto"``: flex on CUDA, sdpa elsewhere.

Kernel options (flex only; `kernel_options`): the tile sizes, warps and pipeline stages of the
forward and backward kernels, picked per device from its shared memory per block. Inductor's
defaults for head dim 128 need more shared memory than workstation and consumer GPUs have; the
``"small"`` preset fits them, slower on a GPU that could run the large tiles
(`bench/tune_attention.py`, bench/results/attention/). A kernel that still does not fit raises
`AttentionKernelsTooLarge` naming the setting that fixes it. ``"flash"`` runs the same BlockMask
on FlexAttention's CuTe-DSL backend (`flash-attn-4`, Hopper and newer): faster than the large
Triton kernels at the seed's shape, for a little more memory (its fp32 dq accumulator;
bench/results/attention-flash/); opt-in, since it needs packages the trainer does not install.

Rows of an invalid block see no key. Both paths return zeros for them (flex does so natively;
the sdpa path lets them see key 0 and multiplies their output by 0), with zero gradients, so
no NaN reaches the loss, which ignores those rows anyway.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from trainer.base.errors import (
    AttentionBackendUnavailable,
    AttentionKernelsTooLarge,
    CompileCacheFull,
    DenseAttentionTooLarge,
)
from trainer.model.masks import batched_dense_mask, draft_mask_mod
from trainer.settings.config import ATTENTION_KERNELS

BACKENDS = ("auto", "flex", "sdpa")
DEFAULT_DENSE_BUDGET_GIB = 4.0
# Distinct compiled variants allowed per kernel: (static + dynamic) × mask variants (full and
# sliding-window layers, training and the single-anchor τ probe) × length regimes, with room.
RECOMPILE_LIMIT = 64
_GIB = float(1 << 30)

KERNEL_PRESETS = ATTENTION_KERNELS  # one list: the setting's check reads it too
# Shared memory per block the default (large) flex kernels use at head dim 128, bf16 (H200).
LARGE_KERNELS_SHARED_BYTES = 166_400
# Tiles that fit 80 KiB of shared memory (81,920 B measured), forward and backward.
SMALL_KERNEL_OPTIONS: dict[str, Any] = {
    "fwd_BLOCK_M": 64,
    "fwd_BLOCK_N": 64,
    "fwd_num_stages": 2,
    "fwd_num_warps": 4,
    "bwd_BLOCK_M1": 32,
    "bwd_BLOCK_N1": 64,
    "bwd_BLOCK_M2": 64,
    "bwd_BLOCK_N2": 32,
    "bwd_num_stages": 2,
    "bwd_num_warps": 4,
}
# Hopper: the forward kernel loads K/V tiles with the tensor memory accelerator (~8 % faster).
HOPPER_KERNEL_OPTIONS: dict[str, Any] = {"fwd_USE_TMA": True}
# FlexAttention's CuTe-DSL kernels (flash-attn-4), forward and backward, Hopper and newer.
FLASH_KERNEL_OPTIONS: dict[str, Any] = {"BACKEND": "FLASH"}
FLASH_MIN_CAPABILITY = (9, 0)


@dataclass(frozen=True)
class FlexKernels:
    """The FlexAttention callables one process uses: attention and BlockMask construction.

    Held in an object (made once by `flex_kernels()`) rather than in module globals, so the
    compile caches live exactly as long as something refers to them and a test can ask for an
    eager holder explicitly. `compiled=False` is for debugging at tiny sizes only.
    """

    attention: Callable[..., Tensor]
    block_mask: Callable[..., BlockMask]
    compiled: bool


@functools.cache
def flex_kernels(*, compiled: bool = True) -> FlexKernels:
    """The process's FlexAttention kernels; `functools.cache` makes it compile once per process.

    Dynamo caches compiled code per callable object, so reusing one compiled object across
    batches and layers is what keeps recompiles to the length buckets.
    """
    if not compiled:
        return FlexKernels(attention=flex_attention, block_mask=create_block_mask, compiled=False)
    fail_instead_of_eager_fallback()
    return FlexKernels(
        attention=torch.compile(flex_attention),
        block_mask=torch.compile(create_block_mask),
        compiled=True,
    )


def fail_instead_of_eager_fallback() -> None:
    """Make dynamo raise when a kernel's compile cache is full, instead of running it eagerly.

    Dynamo's recompile limit (8 by default) counts per code object for the whole process; the
    eager fallback past it is the dense FlexAttention this module exists to avoid. The limit is
    raised to `RECOMPILE_LIMIT` (never lowered), and hitting it becomes `CompileCacheFull`.
    """
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    config.fail_on_recompile_limit_hit = True


@contextmanager
def compile_errors_as_typed(what: str) -> Iterator[None]:
    """Turn the compile failures a user can fix into typed errors naming `what` and the fix.

    A full compile cache becomes `CompileCacheFull`; a Triton kernel that needs more shared
    memory than the GPU has ("out of resource: shared memory") becomes
    `AttentionKernelsTooLarge`.
    """
    try:
        yield
    except torch._dynamo.exc.FailOnRecompileLimitHit as exc:
        limit = torch._dynamo.config.recompile_limit
        raise CompileCacheFull(
            f"{what} was compiled for more than {limit} distinct shapes in this "
            f"process ({str(exc).splitlines()[0] if str(exc) else 'recompile limit hit'})"
        ) from exc
    except Exception as exc:
        detail = _out_of_resource(exc)
        if detail is None:
            raise
        raise AttentionKernelsTooLarge(f"{what} does not fit this GPU: {detail}") from exc


def _out_of_resource(exc: BaseException) -> str | None:
    """Triton's "out of resource" line anywhere in the exception's chain, else None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for line in str(current).splitlines():
            if "out of resource" in line.lower():
                return line.strip()
        current = current.__cause__ or current.__context__
    return None


def kernel_options(device: torch.device, preset: str = "auto") -> dict[str, Any] | None:
    """The flex kernel options for `device`: ``"large"`` (inductor's defaults, plus TMA loads
    on Hopper), ``"small"`` (fits ~100 KiB GPUs), ``"flash"`` (the CuTe-DSL backend; raises
    `AttentionBackendUnavailable` where it cannot run), or ``"auto"``: large where the device
    has the shared memory the large tiles need, small elsewhere. None on the CPU (no flex
    backward)."""
    if preset not in KERNEL_PRESETS:
        raise ValueError(f"attention kernels must be one of {KERNEL_PRESETS}, got {preset!r}")
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    if preset == "flash":
        check_flash_backend((props.major, props.minor))
        return dict(FLASH_KERNEL_OPTIONS)
    if preset == "auto":
        shared = getattr(props, "shared_memory_per_block_optin", 0)
        preset = "large" if shared >= LARGE_KERNELS_SHARED_BYTES else "small"
    if preset == "small":
        return dict(SMALL_KERNEL_OPTIONS)
    return dict(HOPPER_KERNEL_OPTIONS) if (props.major, props.minor) == (9, 0) else None


def check_flash_backend(capability: tuple[int, int]) -> None:
    """Raise `AttentionBackendUnavailable` unless FlexAttention's FLASH backend can run on a
    GPU of `capability`: flash-attn-4's CuTe kernels importable, Hopper or newer."""
    if capability < FLASH_MIN_CAPABILITY:
        raise AttentionBackendUnavailable(
            f"attention kernels 'flash' need a Hopper or newer GPU (compute capability 9.0+), "
            f"this one is {capability[0]}.{capability[1]}",
            hint='Set run.attention_kernels = "auto" (Triton kernels sized for this GPU).',
        )
    try:
        importlib.import_module("flash_attn.cute")
    except ImportError as exc:
        raise AttentionBackendUnavailable(
            f"attention kernels 'flash' need flash-attn-4's CuTe kernels, which do not import "
            f"here ({exc})",
            hint="pip install flash-attn-4 nvidia-cutlass-dsl in the job's environment, or set "
            'run.attention_kernels = "auto".',
        ) from exc


def _compiled_call(kernel: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with compile_errors_as_typed("A FlexAttention kernel"):
        return kernel(*args, **kwargs)


@dataclass(frozen=True, kw_only=True)
class DraftMask:
    """One batch's attention mask, built once and shared by all layers.

    `block_mask` and `options` (the kernel options, see `kernel_options`) are set for the flex
    backend, `dense` (Bsz, 1, Q, K) bool and `row_seen` (Bsz, 1, Q, 1) (0 for rows that see no
    key) for the sdpa backend.
    """

    backend: str
    batch: int
    q_len: int
    kv_len: int
    block_mask: BlockMask | None = None
    kernels: FlexKernels | None = None
    options: dict[str, Any] | None = None
    dense: Tensor | None = None
    row_seen: Tensor | None = None


def bucket_length(length: int, *, multiple: int = 128) -> int:
    """The context length to pad to: the next multiple of `multiple` (FlexAttention's tile).

    Padding S to a few buckets keeps compiled kernels from recompiling for every batch.
    """
    if length < 0 or multiple < 1:
        raise ValueError(f"need length >= 0 and multiple >= 1, got {length}, {multiple}")
    return -(-length // multiple) * multiple


def dense_bytes(*, backend: str, batch: int, heads: int, q_len: int, kv_len: int) -> int:
    """Bytes a dense attention path would materialise at this shape (an upper estimate).

    sdpa: the bool mask (1 B per entry) plus, when SDPA picks its math backend for an arbitrary
    mask, the fp32 scores of every head (4 B per entry per head). Eager flex: the fp32 scores
    and their softmax for every head (8 B per entry per head).
    """
    entries = batch * q_len * kv_len
    if backend == "sdpa":
        return entries * (1 + 4 * heads)
    return entries * 8 * heads


def _check_budget(*, path: str, needed: int, budget_gib: float, why: str) -> None:
    if needed > budget_gib * _GIB:
        raise DenseAttentionTooLarge(
            path=path, needed_gib=needed / _GIB, budget_gib=budget_gib, why=why
        )


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return backend


def build_draft_mask(
    anchors: Tensor,
    valid: Tensor,
    context_len: int,
    block_size: int,
    *,
    window: int | None = None,
    causal_in_block: bool = False,
    backend: str = "auto",
    num_heads: int = 1,
    dense_budget_gib: float = DEFAULT_DENSE_BUDGET_GIB,
    kernels: FlexKernels | None = None,
    kernel_preset: str = "auto",
) -> DraftMask:
    """The batch's mask: `anchors` (Bsz, N) long sorted per row, `valid` (Bsz, N) bool.

    `context_len` is S, already padded to its bucket. `num_heads` only sizes the dense-memory
    estimate; `kernel_preset` picks the flex kernel options (`kernel_options`). Raises
    `DenseAttentionTooLarge` when the chosen path would materialise more than `dense_budget_gib`.
    """
    if anchors.dim() != 2:
        raise ValueError(f"anchors must be (Bsz, N), got {tuple(anchors.shape)}")
    resolved = _resolve_backend(backend, anchors.device)
    batch, n_blocks = anchors.shape
    q_len = n_blocks * block_size
    kv_len = context_len + q_len
    shape = dict(batch=batch, heads=num_heads, q_len=q_len, kv_len=kv_len)

    if resolved == "sdpa":
        _check_budget(
            path="SDPA with a dense mask",
            needed=dense_bytes(backend="sdpa", **shape),
            budget_gib=dense_budget_gib,
            why=f"its bool mask and fp32 scores grow with Bsz·H·Q·K = {batch}·{num_heads}·{q_len}·{kv_len}",
        )
        dense = batched_dense_mask(
            anchors,
            context_len,
            block_size,
            window=window,
            causal_in_block=causal_in_block,
            valid=valid,
        )  # (Bsz, Q, K)
        seen = dense.any(dim=-1)  # (Bsz, Q)
        dense[..., 0] |= ~seen  # a row with no key attends to key 0; its output is zeroed
        return DraftMask(
            backend="sdpa",
            batch=batch,
            q_len=q_len,
            kv_len=kv_len,
            dense=dense[:, None],
            row_seen=seen[:, None, :, None],
        )

    kernels = kernels if kernels is not None else flex_kernels()
    if not kernels.compiled:
        _check_budget(
            path="FlexAttention without torch.compile",
            needed=dense_bytes(backend="flex", **shape),
            budget_gib=dense_budget_gib,
            why="eager flex_attention materialises the fp32 score matrix of every head",
        )
    mask_mod = draft_mask_mod(
        anchors, valid, context_len, block_size, window=window, causal_in_block=causal_in_block
    )
    block_mask = _compiled_call(
        kernels.block_mask, mask_mod, batch, None, q_len, kv_len, device=anchors.device
    )
    return DraftMask(
        backend="flex",
        batch=batch,
        q_len=q_len,
        kv_len=kv_len,
        block_mask=block_mask,
        kernels=kernels,
        options=kernel_options(anchors.device, kernel_preset),
    )


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, mask: DraftMask) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (Bsz, heads, length, head_dim)")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape")
    bsz, heads, q_len, _ = q.shape
    if bsz != mask.batch or k.shape[0] != mask.batch:
        raise ValueError(f"batch {bsz} (k: {k.shape[0]}) does not match the mask's {mask.batch}")
    if q_len != mask.q_len or k.shape[2] != mask.kv_len:
        raise ValueError(
            f"q length {q_len} and kv length {k.shape[2]} must be the mask's "
            f"{mask.q_len} and {mask.kv_len}"
        )
    if heads % k.shape[1] != 0:
        raise ValueError(f"kv heads {k.shape[1]} must divide query heads {heads}")


def draft_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: DraftMask, *, scale: float | None = None
) -> Tensor:
    """Attention of the block queries: q (Bsz, H, N·B, hd), k/v (Bsz, Hkv, S+N·B, hd) → like q.

    GQA when Hkv < H (Hkv divides H). Rows of invalid blocks come out as zeros.
    """
    _check_shapes(q, k, v, mask)
    gqa = q.shape[1] != k.shape[1]
    if mask.backend == "sdpa":
        assert mask.dense is not None and mask.row_seen is not None
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.dense, scale=scale, enable_gqa=gqa
        )  # (Bsz, H, Q, hd)
        return out * mask.row_seen.to(out.dtype)

    assert mask.block_mask is not None and mask.kernels is not None
    if q.device.type == "cpu" and torch.is_grad_enabled() and _any_requires_grad(q, k, v):
        raise AttentionBackendUnavailable(
            "FlexAttention has no backward on the CPU; this call would need one."
        )
    kwargs: dict[str, Any] = {"block_mask": mask.block_mask, "scale": scale, "enable_gqa": gqa}
    if mask.options:
        kwargs["kernel_options"] = mask.options
    return _compiled_call(mask.kernels.attention, q, k, v, **kwargs)


def _any_requires_grad(*tensors: Tensor) -> bool:
    return any(t.requires_grad for t in tensors)
