"""What a place sends back, as text that is safe to show: every control character visible,
every line bounded.

A place is a machine dflash does not fully control: a job's log, tmux's or pct's error output,
a file name or nvidia-smi's answer can hold terminal escape sequences (retitle the window, clear
the screen, rewrite what was printed before), bytes that are not UTF-8, or megabytes on one
line. Text from a place is rendered here, as `less` and `cat -v` show it, before a terminal
sees it (`cli/output.py` renders everything the CLI prints):

- C0 controls and DEL in caret notation (ESC is `^[`, CR `^M`); newline and tab are kept;
- C1 controls (U+0080–U+009F: a terminal may read U+009B as ESC `[`) and bytes that are not
  UTF-8 as `\\xNN`;
- the format characters that reorder or break what is shown (bidirectional overrides and
  isolates, line and paragraph separators) as `<U+NNNN>`.

Rendering is idempotent (what it writes holds no control character), so text rendered twice
reads the same. `clip` bounds one line and `last_line` quotes the line that says what failed,
each saying how much was left out.
"""

from __future__ import annotations

import codecs

LINE = 500  # characters of a remote line quoted in a message

_FORMAT = (0x061C, 0x200E, 0x200F, 0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
_TABLE: dict[int, str] = {
    **{c: "^" + chr(c + 64) for c in range(0x20) if c not in (0x09, 0x0A)},
    0x7F: "^?",
    **{c: f"\\x{c:02x}" for c in range(0x80, 0xA0)},
    **{c: f"<U+{c:04X}>" for c in _FORMAT},
}


def visible(text: str) -> str:
    """`text` with its control characters made visible (see the module)."""
    return text.translate(_TABLE)


def decode(data: bytes) -> str:
    """Bytes from a place as visible text: UTF-8, other bytes as `\\xNN`."""
    return visible(data.decode("utf-8", "backslashreplace"))


class Renderer:
    """`decode` for a stream that arrives in chunks (a UTF-8 character may be split between
    two): `feed` each chunk, `end` once it is over."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("backslashreplace")

    def feed(self, data: bytes) -> str:
        return visible(self._decoder.decode(data))

    def end(self) -> str:
        return visible(self._decoder.decode(b"", final=True))


def more(count: int, unit: str = "bytes") -> str:
    """`… 1,234 bytes more`: what a bounded read or a clipped line left out."""
    return f"… {count:,} {unit} more"


def clip(line: str, limit: int = LINE) -> str:
    """`line` made visible and cut to its first `limit` characters, saying how many more."""
    shown = visible(line)
    if len(shown) <= limit:
        return shown
    return f"{shown[:limit]} {more(len(shown) - limit, 'characters')}"


def last_line(text: str, limit: int = LINE) -> str:
    """The last non-blank line of `text` (what a failing command said last), clipped; "no error
    output" when there is none."""
    for line in reversed(text.strip().splitlines()):
        if line.strip():
            return clip(line.strip(), limit)
    return "no error output"
