"""The one place where an argv becomes a shell string, and where remote-bound values are checked.

An SSH server never receives an argv: it receives one string and hands it to the user's login
shell (`$SHELL -c STRING`). `quote_argv` turns an argv into such a string in which every element
is a single literal word for any POSIX shell (sh, dash, bash, zsh): each element is wrapped in
single quotes, inside which nothing is special except the closing quote, which is written as
`'"'"'`. Newlines, `$()`, backticks, `;`, globs and unicode therefore reach the program unchanged.
The one thing no shell word can carry is a NUL byte (argv strings are C strings), so it is refused.

The validators below are for values whose role demands more than "passes literally": a tmux
session name, an environment key, a container id, a path that a command will write to or delete.
Each returns the value in its canonical form or raises `UnsafeValue` naming the role and showing
the offending value with `repr()` (so invisible characters are visible).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from dflash_ops.errors import UnsafeValue

# Characters that never need quoting in a POSIX shell word; anything else gets single quotes.
_PLAIN_WORD = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")
_SESSION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CONTAINER_ID = re.compile(r"[0-9]+")
CONTAINER_IDS = (100, 999_999_999)  # Proxmox's pve-vmid range


def _refuse(role: str, value: object, why: str) -> UnsafeValue:
    return UnsafeValue(f"Refusing {role} {value!r}: {why}.")


def quote(word: str) -> str:
    """Quote one argv element so that a POSIX shell reads it back as exactly `word`."""
    if not isinstance(word, str):
        raise TypeError(f"argv elements must be str, got {type(word).__name__}: {word!r}")
    if "\x00" in word:
        raise _refuse("argument", word, "it contains a NUL byte, which no command line can carry")
    if _PLAIN_WORD.fullmatch(word):
        return word
    return "'" + word.replace("'", "'\"'\"'") + "'"


def quote_argv(argv: Sequence[str]) -> str:
    """Join `argv` into one shell command line in which every element is a literal word.

    `sh -c quote_argv(argv)` runs `argv[0]` with exactly `argv[1:]` as its arguments.
    """
    if isinstance(argv, str):
        raise TypeError("quote_argv takes a sequence of arguments, not a string")
    if not argv:
        raise UnsafeValue("Refusing an empty command: there is no program to run.")
    return " ".join(quote(word) for word in argv)


def session_name(name: str) -> str:
    """A tmux session name: 1-64 of `[A-Za-z0-9_.-]`, not starting with '-'.

    tmux itself rewrites ':' and '.' in targets and treats a leading '-' as an option, so a strict
    alphabet is the only way to be sure `-t NAME` addresses the session we created.
    """
    if not isinstance(name, str) or not _SESSION_NAME.fullmatch(name):
        raise _refuse("session name", name, "use 1-64 letters, digits, '.', '_' or '-'")
    if name.startswith("-"):
        raise _refuse("session name", name, "it must not start with '-'")
    return name


def env_key(key: str) -> str:
    """An environment variable name as POSIX shells accept it: `[A-Za-z_][A-Za-z0-9_]*`."""
    if not isinstance(key, str) or not _ENV_KEY.fullmatch(key):
        raise _refuse(
            "environment variable name",
            key,
            "use letters, digits and '_', not starting with a digit",
        )
    return key


def env_value(value: str) -> str:
    """An environment value: any text without NUL (it is passed literally, never interpreted)."""
    if not isinstance(value, str):
        raise _refuse("environment value", value, "it must be text")
    if "\x00" in value:
        raise _refuse("environment value", value, "it contains a NUL byte")
    return value


def container_id(value: int | str) -> int:
    """A Proxmox container id (vmid): an integer in 100..999999999, given as int or decimal str."""
    if isinstance(value, bool):
        raise _refuse("container id", value, "it must be an integer, not a boolean")
    if isinstance(value, int):
        ct = value
    elif isinstance(value, str) and _CONTAINER_ID.fullmatch(value):
        ct = int(value)
    else:
        raise _refuse("container id", value, "it must be a whole number such as 200")
    low, high = CONTAINER_IDS
    if not low <= ct <= high:
        raise _refuse("container id", value, f"it must be between {low} and {high}")
    return ct


def remote_path(path: str) -> str:
    """An absolute path at a place that commands may write to or delete.

    Refuses relative paths, NUL and newlines (a path is also printed into logs and lock files),
    `..` components (the path must mean what it reads), and `/` itself. Returns the path with
    repeated slashes and `.` components removed.
    """
    if not isinstance(path, str):
        raise _refuse("remote path", path, "it must be text")
    if "\x00" in path or "\n" in path or "\r" in path:
        raise _refuse("remote path", path, "it contains a NUL byte or a line break")
    if not path.startswith("/"):
        raise _refuse("remote path", path, "it must be absolute (start with '/')")
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise _refuse("remote path", path, "it must not contain '..'")
    if not parts:
        raise _refuse("remote path", path, "it must not be the root folder '/'")
    return "/" + "/".join(parts)
