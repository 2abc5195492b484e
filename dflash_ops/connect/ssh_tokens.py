"""ssh_config's `%` tokens and `~`, expanded as OpenSSH does for the keys dflash reads."""

from __future__ import annotations

import hashlib
import os
import pwd
import socket
from pathlib import Path

from dflash_ops.errors import ConfigError


def local_user() -> str:
    """The account name, as ssh takes it (not $USER): OpenSSH's default remote user."""
    return pwd.getpwuid(os.getuid()).pw_name


def account_home() -> Path:
    """The account's home from the password database: the one `ssh` itself uses for `~`."""
    return Path(pwd.getpwuid(os.getuid()).pw_dir)


def tokens(*, host: str, original: str, port: str, user: str, home: Path) -> dict[str, str]:
    """The tokens ssh_config offers in Match exec, IdentityFile and known-hosts paths."""
    long_name = socket.gethostname()
    short = long_name.split(".", 1)[0]
    return {
        "%": "%",
        "h": host,
        "n": original,
        "p": port,
        "r": user,
        "u": local_user(),
        "l": long_name,
        "L": short,
        "d": str(home),
        "i": str(os.getuid()),
        "C": hashlib.sha1(f"{long_name}{host}{port}{user}".encode()).hexdigest(),
    }


def expand(text: str, values: dict[str, str], *, where: str) -> str:
    """Replace every `%x` in `text`; an unknown token is an error, as in ssh."""
    out, i = [], 0
    while i < len(text):
        char = text[i]
        if char != "%":
            out.append(char)
            i += 1
            continue
        key = text[i + 1 : i + 2]
        if key not in values:
            raise ConfigError(f"{where}: unknown token %{key} in {text!r}.")
        out.append(values[key])
        i += 2
    return "".join(out)


def expand_tilde(text: str, home: Path) -> str:
    """`~` and `~/x` → home; `~user/x` → that user's home (as ssh's tilde_expand_filename)."""
    if not text.startswith("~"):
        return text
    name, sep, rest = text[1:].partition("/")
    if not name:
        base = str(home)
    else:
        try:
            base = pwd.getpwnam(name).pw_dir
        except KeyError:
            raise ConfigError(f"No such user {name!r} in {text!r}.") from None
    return base.rstrip("/") + "/" + rest if sep or rest else base
