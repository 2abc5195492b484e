"""`with_target`: a command declares `where: TargetChoice` and typer sees the six target flags.

The decorated command is compared with the same command written out with the six flags by
hand (the declaration it replaces): same click parameters in the same order, same --help. The
TargetChoice it receives is read back from real invocations through typer.
"""

from __future__ import annotations

from typing import Annotated

import pytest
import typer
from typer.testing import CliRunner

from dflash_ops.cli import app as dflash_app
from dflash_ops.cli.options import (
    AcceptKeyOption,
    CtOption,
    HostOption,
    PortOption,
    TargetChoice,
    TargetOption,
    UserOption,
    with_target,
)
from dflash_ops.settings.deploy_config import TargetFlags

FLAGS = ["target", "host", "user", "port", "ct", "accept_new_host_key"]
JsonOption = Annotated[bool, typer.Option("--json", help="One JSON object.")]
KeepOption = Annotated[int, typer.Option("--keep", min=0, help="How many to keep.")]
TARGET_COMMANDS = [
    "deploy",
    "logs",
    "status",
    "stop",
    "restart",
    "releases",
    "rollback",
    "checkpoints",
    "checkpoints prune",
    "doctor",
    "eval",
    "plan",
]


def _app(command: object) -> typer.Typer:
    app = typer.Typer(rich_markup_mode=None)
    app.command()(command)  # type: ignore[arg-type]
    # A second command keeps typer from collapsing the app into its one command.
    app.command("other")(lambda: None)
    return app


def _described(command: typer.Typer) -> list[tuple[object, ...]]:
    """What the user sees of each option, in order (the click objects themselves differ)."""
    params = typer.main.get_command(command).commands["shown"].params  # type: ignore[attr-defined]
    return [
        (
            p.name,
            tuple(p.opts),
            tuple(p.secondary_opts),
            p.default,
            p.required,
            getattr(p, "help", None),
            getattr(p, "rich_help_panel", None),
            getattr(p, "is_flag", None),
            getattr(p, "min", None),
            getattr(p, "max", None),
        )
        for p in params
    ]


def test_params_are_the_hand_written_ones_at_the_place_of_where() -> None:
    def shown(
        keep: KeepOption,
        as_json: JsonOption = False,
        *,
        where: TargetChoice,
        force: bool = False,
    ) -> None:
        """Shown."""

    def by_hand(
        keep: KeepOption,
        as_json: JsonOption = False,
        target: TargetOption = None,
        host: HostOption = None,
        user: UserOption = None,
        port: PortOption = None,
        ct: CtOption = None,
        accept_new_host_key: AcceptKeyOption = False,
        force: bool = False,
    ) -> None:
        """Shown."""

    by_hand.__name__ = "shown"
    decorated, written = _app(with_target(shown)), _app(by_hand)
    got = _described(decorated)
    assert [row[0] for row in got] == ["keep", "as_json", *FLAGS, "force"]
    assert got == _described(written)
    runner = CliRunner()
    help_text = runner.invoke(decorated, ["shown", "--help"], terminal_width=100).output
    assert "--accept-new-host-key" in help_text
    assert help_text == runner.invoke(written, ["shown", "--help"], terminal_width=100).output


def _received(args: list[str]) -> tuple[int, list[tuple[TargetChoice, int, bool]]]:
    calls: list[tuple[TargetChoice, int, bool]] = []

    @with_target
    def shown(keep: KeepOption, *, where: TargetChoice, as_json: JsonOption = False) -> None:
        calls.append((where, keep, as_json))

    result = CliRunner().invoke(_app(shown), ["shown", *args])
    return result.exit_code, calls


def test_flags_given_become_one_target_choice() -> None:
    code, calls = _received(
        ["--keep", "3", "-t", "box", "-H", "gpu-box", "-u", "me", "-p", "2222", "--ct", "200"]
        + ["--accept-new-host-key", "--json"]
    )
    assert code == 0
    flags = TargetFlags(target="box", host="gpu-box", user="me", port=2222, ct=200)
    assert calls == [(TargetChoice(flags=flags, accept_new_host_key=True), 3, True)]


def test_no_flags_give_the_empty_choice() -> None:
    code, calls = _received(["--keep", "1"])
    assert code == 0
    assert calls == [(TargetChoice(flags=TargetFlags(), accept_new_host_key=False), 1, False)]


def test_option_checks_still_apply() -> None:
    code, calls = _received(["--keep", "1", "--port", "0"])
    assert code == 2 and calls == []


def test_direct_call_gets_the_defaults() -> None:
    @with_target
    def shown(*, where: TargetChoice) -> TargetChoice:
        return where

    assert shown(host="h", port=22) == TargetChoice(flags=TargetFlags(host="h", port=22))


def test_refuses_a_command_without_keyword_only_where() -> None:
    def positional(where: TargetChoice) -> None: ...

    def clashing(host: str, *, where: TargetChoice) -> None: ...

    with pytest.raises(TypeError, match="keyword-only"):
        with_target(positional)
    with pytest.raises(TypeError, match="host"):
        with_target(clashing)


@pytest.mark.parametrize("path", TARGET_COMMANDS)
def test_every_target_command_has_the_six_flags_in_one_run(path: str) -> None:
    command = typer.main.get_command(dflash_app)
    for name in path.split():
        command = command.commands[name]  # type: ignore[attr-defined]
    names = [p.name for p in command.params]
    at = names.index("target")
    assert names[at : at + 6] == FLAGS
    assert "where" not in names
