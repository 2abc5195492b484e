"""The trainer's expected failures, each named for its condition and carrying the next step.

The trainer never imports `dflash_ops`; these mirror its style (a base class with a `hint`).
Library code raises them; the entry point turns them into a message and an exit code.
"""

from __future__ import annotations


class TrainerError(Exception):
    """Base of the trainer's expected failures. `hint` says what to do next."""

    hint: str = ""
    # `python -m trainer train` exits with it: 2 for what the settings or inputs must fix, 1
    # for what the machine did (a full disk, like any OSError), then start again to resume.
    exit_code: int = 2

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        if hint is not None:
            self.hint = hint

    def __str__(self) -> str:
        base = super().__str__()
        return f"{base} ({self.hint})" if self.hint else base


class DenseAttentionTooLarge(TrainerError):
    """An attention path would materialise a dense mask or score matrix beyond the budget.

    Eager FlexAttention and SDPA with a dense mask both build Q×K-sized tensors; at the drafter's
    real shapes that is hundreds of GiB. Refusing up front is cheaper than an out-of-memory
    error mid-run.
    """

    hint = (
        "Use the compiled flex backend on CUDA (backend='flex' or 'auto'), or shrink the batch, "
        "the context bucket or the number of anchors."
    )

    def __init__(self, *, path: str, needed_gib: float, budget_gib: float, why: str) -> None:
        super().__init__(
            f"{path} would need about {needed_gib:.2f} GiB (budget {budget_gib:.2f} GiB): {why}"
        )
        self.path = path
        self.needed_gib = needed_gib
        self.budget_gib = budget_gib


class AttentionBackendUnavailable(TrainerError):
    """The requested attention backend cannot run here (e.g. flex without torch.compile)."""

    hint = "Use backend='sdpa' on the CPU, or 'auto' to pick flex on CUDA and SDPA elsewhere."


class CompileCacheFull(TrainerError):
    """torch.compile met more distinct shapes of one kernel (FlexAttention, the mask builder or a
    compiled drafter layer) than its recompile limit allows.

    Past the limit dynamo would silently run the code eagerly: for FlexAttention that
    materialises the fp32 score matrix (hundreds of GiB at the drafter's shapes), an
    out-of-memory error or a 10× slower run far from its cause. The trainer makes dynamo raise
    instead, and names the knobs.
    """

    hint = (
        "Use fewer distinct shapes per process: a larger data.bucket (fewer context lengths), "
        "one batch size and anchor count, or raise torch._dynamo.config.recompile_limit."
    )


class TargetCompileFailed(TrainerError):
    """`torch.compile` could not compile the target's training forward (`run.compile_target`,
    on by default on CUDA): a model class or a torch build it cannot trace or lower."""

    hint = (
        "Set run.compile_target = false under [train.run] to run the target's forward eagerly "
        "(slower: the benchmark's loop took 82.8 against 65.6 ms a step on an H200)."
    )


class AttentionKernelsTooLarge(TrainerError):
    """The attention kernels' tiles need more shared memory per block than this GPU has.

    FlexAttention's default tile sizes for head dim 128 are sized for data-centre GPUs
    (~160-227 KiB of shared memory per block); workstation and consumer GPUs have ~100 KiB, and
    Triton then fails with "out of resource: shared memory" while compiling.
    """

    hint = (
        'Set run.attention_kernels = "small" in [train] (deploy.toml) or train.toml: tiles that '
        "fit 80 KiB of shared memory, about 1.2x slower than the large ones on an H200."
    )


class UnsupportedTarget(TrainerError):
    """The target has a setting the served drafter cannot follow (the engines' DFlash drafter is
    a Qwen3-style layer stack: SiLU MLP without bias, full-head RoPE of a few scaling types).

    Training a drafter that silently differs from the target's setting, or from what the
    engines would run, is worse than refusing: the message names the field and its value.
    """

    hint = (
        "docs/training.md lists the supported target families; a target with this setting "
        "cannot be trained for serving yet."
    )

    def __init__(self, field: str, value: object, why: str, *, hint: str | None = None) -> None:
        super().__init__(f"target config {field} = {value!r}: {why}", hint=hint)
        self.field = field
        self.value = value
