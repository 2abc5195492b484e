"""Text from a place rendered safe to show (`dflash_ops/untrusted.py`), and what the CLI's
consoles and log writer print of it (`dflash_ops/cli/output.py`): every control character
visible as `less` shows it, newline and tab kept, bytes that are not UTF-8 as `\\xNN`, quoted
lines bounded saying how much more there was."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console
from rich.table import Table

from dflash_ops.cli import output
from dflash_ops.untrusted import Renderer, clip, decode, last_line, more, visible

# C0 but newline and tab, DEL, C1, and what reorders a line: none may reach a terminal
RAW = {*range(0x20), 0x7F, *range(0x80, 0xA0), 0x202E, 0x2066, 0x2028} - {0x09, 0x0A}


def shown_raw(text: str) -> set[int]:
    return {ord(c) for c in text if ord(c) in RAW}


def test_controls_are_shown_as_less_shows_them() -> None:
    title = "\x1b]0;PWNED\x07\x1b[2J\r\x08\x7f"
    assert visible(title) == "^[]0;PWNED^G^[[2J^M^H^?"
    assert visible("tab\tand\nnewline") == "tab\tand\nnewline"
    assert visible("\x9b31m \u202eevil") == "\\x9b31m <U+202E>evil"
    assert decode(b"ok \xff\xfe \xc2\x9b") == "ok \\xff\\xfe \\x9b"


@given(st.text() | st.binary().map(lambda b: b.decode("latin-1")))
def test_rendering_leaves_no_control_character_and_is_idempotent(text: str) -> None:
    shown = visible(text)
    assert not shown_raw(shown)
    assert visible(shown) == shown


@given(st.binary(max_size=64), st.integers(min_value=0, max_value=64))
def test_a_stream_renders_as_its_whole_would(data: bytes, cut: int) -> None:
    renderer = Renderer()
    parts = renderer.feed(data[:cut]) + renderer.feed(data[cut:]) + renderer.end()
    assert parts == decode(data)


def test_long_lines_are_clipped_saying_how_much_more() -> None:
    assert clip("x" * 600) == "x" * 500 + " … 100 characters more"
    assert clip("\x1b" * 300, 10) == "^[" * 5 + " " + more(590, "characters")
    assert last_line("first\n\nlast \x1b[2J\n  \n") == "last ^[[2J"
    assert last_line("  \n") == "no error output"


@pytest.mark.parametrize(
    "what",
    [
        lambda c: c.print("[bold]job[/bold] " + "\x1b]0;T\x07\x9b\u202e"),
        lambda c: c.print(table_of("name\x1b[2J", "\x07bell")),
        lambda c: c.print_json('{"line": "\\u001b[2J\\u009b"}'),
    ],
)
def test_the_consoles_print_no_control_character_but_their_own_colours(
    what: Callable[[Console], None],
) -> None:
    buffer = io.StringIO()
    console = output._Console(stderr=False)
    console.file = buffer
    console._force_terminal = True  # colours on: its own escape sequences are expected
    what(console)
    written = buffer.getvalue()
    assert "^[" in written or "\\u001b" in written
    # ESC appears only as the start of an SGR colour sequence of rich's own (ESC [ … m)
    for piece in written.split("\x1b")[1:]:
        assert piece.startswith("[") and "m" in piece[:16], repr(piece[:20])
    assert not shown_raw(written.replace("\x1b", ""))


def table_of(*cells: str) -> Table:
    table = Table()
    table.add_column("c")
    for cell in cells:
        table.add_row(cell)
    return table


def test_log_bytes_go_out_rendered_unless_raw(capfdbinary: pytest.CaptureFixture[bytes]) -> None:
    shown = output.RemoteBytes()
    for chunk in (b"\x1b[31mred\xe2", b"\x82\xac \xff\n"):
        shown(chunk)
    shown.end()
    raw = output.RemoteBytes(raw=True)
    raw(b"\x1b[31m")
    raw.end()
    assert capfdbinary.readouterr().out == "^[[31mred€ \\xff\n".encode() + b"\x1b[31m"
