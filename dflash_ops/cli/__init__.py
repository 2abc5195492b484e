"""The `dflash` command: deploy the trainer to a place and run, watch and stop its job.

    dflash init [--host H [--ct N]] [--model PATH] [--force]
    dflash doctor [--host H [--ct N] | --target NAME] [--json] [--no-gpu-smoke]
    dflash setup                 (build the job's venv at the place: [venv] of deploy.toml)
    dflash deploy [--host H [--ct N] | --target NAME] [--resume]
    dflash logs [--follow] [--tail N]
    dflash status [--json]
    dflash restart [--clean]
    dflash stop
    dflash releases
    dflash rollback [--to ID]
    dflash checkpoints [prune --keep N]
    dflash eval --prompts PATH [--checkpoint NAME] [--max-new-tokens N] [--limit N] [--json]
                [--batch-tokens N]
    dflash plan [--gpus G] [--steps N] [--warmup N] [--json] [--force]
    dflash generate --prompts PATH --out DIR [--max-new-tokens N] [--temperature T] …
    dflash exec -- CMD…
    dflash attach

Every failure is one message, a hint and a non-zero exit (`main` catches `DflashError`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Annotated

import typer

from dflash_ops.cli import (
    attach,
    checkpoints,
    control,
    deploy,
    doctor,
    eval,
    execute,
    export,
    generate,
    init,
    logs,
    output,
    plan,
    releases,
    setup,
    status,
)
from dflash_ops.cli.context import Globals
from dflash_ops.cli.options import ConfigOption, VerboseOption
from dflash_ops.errors import DflashError, Interrupted

app = typer.Typer(
    name="dflash",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish)
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
for group in (
    init,
    doctor,
    setup,
    deploy,
    logs,
    status,
    control,
    releases,
    checkpoints,
    eval,
    export,
    generate,
    plan,
    execute,
    attach,
):
    app.add_typer(group.app)


def _version(shown: bool) -> None:
    """`--version`: the installed distribution's version, then stop."""
    if shown:
        from importlib import metadata

        try:
            version = metadata.version("dflash")
        except metadata.PackageNotFoundError:  # run from a checkout that is not installed
            version = "unknown (not installed)"
        print(f"dflash {version}")
        raise typer.Exit()


@app.callback()
def root(
    ctx: typer.Context,
    config: ConfigOption = None,
    verbose: VerboseOption = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print dflash's version and exit."
        ),
    ] = False,
) -> None:
    """Train DFlash drafters on your own GPU boxes: deploy the trainer, run and watch the job.

    \b
    Quick start (in the project folder, next to deploy.toml):
      dflash deploy            # ship trainer/ and start the job ([target] in deploy.toml)
      dflash logs --follow     # watch it; exits with the job's exit code
      dflash status            # running? loss? throughput?

    \b
    First time: dflash init (writes deploy.toml), then dflash doctor (checks the place).
    Shell completion (bash, zsh, fish): dflash --install-completion
    """
    ctx.obj = Globals(config=config, verbose=verbose)
    output.setup_logging(verbose)


_SHELLS = ("bash", "zsh", "fish", "powershell", "pwsh")


def _completion_shell(args: list[str]) -> str | None:
    """The shell named after `--show-completion` (`--show-completion zsh` or `=zsh`), if any."""
    for i, arg in enumerate(args):
        if arg.startswith("--show-completion=") and arg.partition("=")[2] in _SHELLS:
            return arg.partition("=")[2]
        if arg == "--show-completion" and i + 1 < len(args) and args[i + 1] in _SHELLS:
            return args[i + 1]
    return None


def _swallowed_interrupt(exc: SystemExit) -> bool:
    """typer ends a command that a Ctrl-C reached with exit 130 and no word (`Exit(130) from`
    the KeyboardInterrupt); a command that handled it said what it did (`Exit(…) from None`)."""
    inner = exc.__context__
    return isinstance(inner, typer.Exit) and isinstance(inner.__cause__, KeyboardInterrupt)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `dflash` console script and of `python -m dflash_ops`."""
    args = list(sys.argv[1:] if argv is None else argv)
    shell = _completion_shell(args)
    if shell is not None:  # typer's own flag detects the shell and would ignore the name
        from typer._completion_shared import get_completion_script

        print(
            get_completion_script(prog_name="dflash", complete_var="_DFLASH_COMPLETE", shell=shell)
        )
        return
    try:
        app(args=args, prog_name="dflash")
    except Interrupted as exc:  # what was left at the place, said as it is
        output.info(str(exc))
        output.hint(exc.hint)
        sys.exit(130)
    except DflashError as exc:
        output.error(exc)
        sys.exit(1)
    except KeyboardInterrupt:
        output.info("Interrupted.")
        sys.exit(130)
    except SystemExit as exc:
        if _swallowed_interrupt(exc):
            output.info("Interrupted.")
        raise
    except Exception as exc:  # a bug: still one message, the traceback only when asked for
        output.internal(exc, verbose="--verbose" in args or "-v" in args)
        sys.exit(70)
