"""Host and user names checked before any use: before `ssh -G`, before any `Match exec`.

OpenSSH refuses a host name that contains a shell metacharacter, whitespace or a control
character, or that starts with '-' (`ssh -G 'a;b'`: "hostname contains invalid characters"),
because the name is expanded into `Match exec` commands and `ProxyCommand` lines that a shell
runs. Our own config parser runs such commands too, so the same rule applies to every name we
take from the command line or deploy.toml, and to the user name (`%r`).
"""

from __future__ import annotations

from dflash_ops.errors import InvalidHostName

# The characters OpenSSH 9.2 refuses in a host name (measured: `ssh -G -F /dev/null a?b`).
_FORBIDDEN = frozenset("\"$&'(),;<>\\`{|}")


def _bad_char(name: str) -> str | None:
    for char in name:
        if char in _FORBIDDEN or char.isspace() or ord(char) < 0x20 or ord(char) == 0x7F:
            return char
    return None


def check_host(name: str, *, where: str = "host") -> str:
    """`name` unchanged if OpenSSH would accept it as a host name; else `InvalidHostName`."""
    _check(name, what="host name", where=where)
    return name


def check_user(name: str, *, where: str = "user") -> str:
    """`name` unchanged if it is safe as a remote user name (it becomes `%r` in Match exec)."""
    _check(name, what="user name", where=where)
    return name


def _check(name: str, *, what: str, where: str) -> None:
    if not isinstance(name, str) or not name:
        raise InvalidHostName(f"{where}: the {what} is empty.")
    if name.startswith("-"):
        raise InvalidHostName(f"{where}: the {what} {name!r} starts with '-' (read as an option).")
    bad = _bad_char(name)
    if bad is not None:
        raise InvalidHostName(
            f"{where}: the {what} {name!r} contains {bad!r}, which ssh refuses "
            "(a shell would read it as a command)."
        )


def split_user_host(spec: str, *, where: str = "host") -> tuple[str | None, str]:
    """`[user@]host` → (user or None, host), both checked (ssh splits at the last '@')."""
    user, at, host = spec.rpartition("@")
    check_host(host, where=where)
    if at and user:
        check_user(user, where=where)
    return (user or None), host
