"""Our own reading of ssh_config, used only where the `ssh` client is absent.

It answers what `ssh -G` would print for the keys dflash uses (see `KEYS`), following OpenSSH
9.2's readconf.c: the first value obtained for a key wins (IdentityFile accumulates);
`Host` patterns match the name as typed (case-sensitive, `*` and `?` only, `[` is literal,
`!pattern` vetoes the line); `Match` takes `all`, `host`, `originalhost`, `user`, `localuser`
and `exec` (each may be negated with '!'; `exec` runs through $SHELL only when the criteria before
it matched), and `canonical`/`final`, true only in the second pass that `Match final` requests
(no hostname canonicalization here); `Include` reads files relative to ~/.ssh (globs, `~/`, absolute), also inside a
Host block, whose activity it inherits; arguments are split with quotes and backslashes as ssh
does, and a word starting with '#' ends the line.

The caller has checked the host and user names (`ssh_names`) before this runs: `Match exec`
substitutes them into a shell command.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dflash_ops.connect import ssh_tokens
from dflash_ops.errors import ConfigError

KEYS = (
    "hostname",
    "user",
    "port",
    "identityfile",
    "identitiesonly",
    "proxyjump",
    "proxycommand",
    "userknownhostsfile",
    "globalknownhostsfile",
    "hostkeyalias",
    "stricthostkeychecking",
    "hashknownhosts",
    "connecttimeout",
    "serveraliveinterval",
    "serveralivecountmax",
)
DEFAULT_IDENTITIES: tuple[str, ...] = (
    "id_rsa",
    "id_ecdsa",
    "id_ecdsa_sk",
    "id_ed25519",
    "id_ed25519_sk",
)
DEFAULT_IDENTITIES += ("id_xmss", "id_dsa")
SYSTEM_CONFIG = Path("/etc/ssh/ssh_config")
_MAX_INCLUDE_DEPTH = 16
_LINE = re.compile(r"\s*([^\s=]+)\s*=?\s*(.*)")
_YES_NO = {"yes": "yes", "true": "yes", "no": "no", "false": "no"}
_STRICT = {"yes": "true", "true": "true", "no": "false", "false": "false", "off": "false"}
_STRICT |= {"ask": "ask", "accept-new": "accept-new"}
_TIME = re.compile(r"(\d+)([sSmMhHdDwW]?)")
_TIME_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


@dataclass(kw_only=True)
class Request:
    """What the command line gave, as `ssh -G [-l user] [-p port] [-J jump] host` would."""

    host: str
    user: str | None = None
    port: int | None = None
    jump: str | None = None
    home: Path  # for `~` and the relative Include folder (~/.ssh)


@dataclass
class _State:
    request: Request
    values: dict[str, list[str]] = field(default_factory=dict)

    def first(self, key: str) -> str | None:
        found = self.values.get(key)
        return found[0] if found else None

    def set_once(self, key: str, args: list[str]) -> None:
        if key not in self.values:
            self.values[key] = args


def split_args(text: str, where: str) -> list[str]:
    """ssh's argv_split: whitespace-separated words, quotes group, '\\' escapes, '#' ends."""
    words: list[str] = []
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i].isspace():
            i += 1
        if i >= n or text[i] == "#":
            break
        word, quote = [], ""
        while i < n:
            char = text[i]
            if char == "\\" and i + 1 < n and text[i + 1] in "'\"\\" + ("" if quote else " "):
                word.append(text[i + 1])
                i += 2
                continue
            if quote:
                if char == quote:
                    quote = ""
                else:
                    word.append(char)
            elif char in "'\"":
                quote = char
            elif char.isspace():
                break
            else:
                word.append(char)
            i += 1
        if quote:
            raise ConfigError(f"{where}: unterminated quote.")
        words.append("".join(word))
    return words


def match_pattern(name: str, pattern: str) -> bool:
    """OpenSSH's match_pattern: `*` any run, `?` one character, everything else literal."""
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, name, flags=re.DOTALL) is not None


def match_list(name: str, patterns: list[str], *, fold: bool = False, commas: bool = True) -> bool:
    """Patterns (each split at commas, except on `Host` lines): one positive match and no
    negated one."""
    if fold:
        name = name.lower()
    matched = False
    groups = (group.split(",") if commas else [group] for group in patterns)
    for item in (p for group in groups for p in group if p):
        negated = item.startswith("!")
        pattern = item[1:] if negated else item
        if fold:
            pattern = pattern.lower()
        if match_pattern(name, pattern):
            if negated:
                return False
            matched = True
    return matched


class Parser:
    """Reads the config files for one request; `run_exec` runs `Match exec` commands."""

    def __init__(self, request: Request, *, run_exec: Callable[[str], bool] | None = None):
        self.state = _State(request)
        self.run_exec = run_exec or _run_in_shell
        self.final = False  # the second pass that `Match final` asks for
        self.want_final = False

    def read(self, path: Path, *, user_file: bool, depth: int = 0) -> None:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return
        except OSError as exc:
            raise ConfigError(f"Cannot read SSH config {path}: {exc}") from exc
        active = True
        for number, line in enumerate(text.splitlines(), 1):
            where = f"{path}:{number}"
            parsed = _LINE.match(line)
            if not line.strip() or line.lstrip().startswith("#") or parsed is None:
                continue
            keyword, raw = parsed.group(1).lower(), parsed.group(2).rstrip()
            if keyword == "proxycommand":  # ssh keeps the rest of the line as it is
                if active and raw:
                    self._apply(keyword, [raw], where)
                continue
            args = split_args(raw, where)
            if keyword == "host":
                active = match_list(self.state.request.host, args, commas=False)
            elif keyword == "match":
                active = self._match(args, where)
            elif keyword == "include":
                if active:
                    self._include(args, user_file=user_file, depth=depth, where=where)
            elif active:
                self._apply(keyword, args, where)

    def _include(self, args: list[str], *, user_file: bool, depth: int, where: str) -> None:
        if depth >= _MAX_INCLUDE_DEPTH:
            raise ConfigError(f"{where}: Include nested too deeply.")
        home = self.state.request.home
        for arg in args:
            if arg.startswith("~"):
                path = ssh_tokens.expand_tilde(arg, home)
            elif arg.startswith("/"):
                path = arg
            else:
                path = str((home / ".ssh" if user_file else SYSTEM_CONFIG.parent) / arg)
            for found in sorted(glob.glob(path)):
                self.read(Path(found), user_file=user_file, depth=depth + 1)

    def _apply(self, keyword: str, args: list[str], where: str) -> None:
        if keyword not in KEYS or not args:
            return
        if keyword == "identityfile":
            files = self.state.values.setdefault(keyword, [])
            if args[0] not in files:  # ssh ignores a duplicate key file
                files.append(args[0])
        elif keyword in ("userknownhostsfile", "globalknownhostsfile"):
            self.state.set_once(keyword, args)
        elif keyword in ("connecttimeout", "serveraliveinterval"):
            if args[0].lower() != "none":  # `none` leaves it unset: a later line still sets it
                self.state.set_once(keyword, [str(seconds(args[0], where))])
        elif keyword == "serveralivecountmax":
            if not args[0].isdigit():
                raise ConfigError(f"{where}: ServerAliveCountMax {args[0]!r} is not a count.")
            self.state.set_once(keyword, [str(int(args[0]))])
        elif keyword in ("proxyjump", "proxycommand"):
            if "proxyjump" not in self.state.values and "proxycommand" not in self.state.values:
                self.state.values[keyword] = [args[0]]
        else:
            self.state.set_once(keyword, [args[0]])

    def _match(self, args: list[str], where: str) -> bool:
        result, i = True, 0
        while i < len(args):
            criterion = args[i].lower()
            negate = criterion.startswith("!")
            criterion = criterion.removeprefix("!")
            if criterion in ("all", "canonical", "final"):
                i += 1
                # canonical/final hold only in ssh's final pass, which `final` requests
                self.want_final = self.want_final or criterion == "final"
                matched = criterion == "all" or self.final
            else:
                if i + 1 >= len(args):
                    raise ConfigError(f"{where}: Match {criterion} needs an argument.")
                value, i = args[i + 1], i + 2
                if criterion == "exec" and not result:
                    continue  # ssh skips exec once an earlier criterion failed
                matched = self._criterion(criterion, value, where)
            if matched == negate:
                result = False
        return result

    def _criterion(self, criterion: str, value: str, where: str) -> bool:
        request, state = self.state.request, self.state
        if criterion == "host":
            return match_list(self._host_so_far(), [value], fold=True)
        if criterion == "originalhost":
            return match_list(request.host, [value], fold=True)
        if criterion == "user":
            return match_list(self._user_so_far(), [value])
        if criterion == "localuser":
            return match_list(ssh_tokens.local_user(), [value])
        if criterion == "exec":
            tokens = ssh_tokens.tokens(
                host=self._host_so_far(),
                original=request.host,
                port=state.first("port") or "22",
                user=self._user_so_far(),
                home=request.home,
            )
            return self.run_exec(ssh_tokens.expand(value, tokens, where=where))
        raise ConfigError(f"{where}: unsupported Match criterion {criterion!r}.")

    def _host_so_far(self) -> str:
        hostname = self.state.first("hostname")
        host = self.state.request.host
        return host if hostname is None else hostname.replace("%h", host)

    def _user_so_far(self) -> str:
        return self.state.first("user") or ssh_tokens.local_user()


def seconds(text: str, where: str) -> int:
    """ssh's convtime: `90`, `1m30s`, `2h` (units s, m, h, d, w; a bare number is seconds)."""
    parts = _TIME.findall(text)
    if not text or "".join(n + u for n, u in parts) != text:
        raise ConfigError(f"{where}: invalid time value {text!r} (e.g. 30, 90s, 1m30s).")
    return sum(int(n) * _TIME_UNITS[u.lower()] for n, u in parts)


def _run_in_shell(command: str) -> bool:
    """`Match exec`: the command's exit status under the user's shell, as ssh runs it."""
    shell = os.environ.get("SHELL") or "/bin/sh"
    try:
        done = subprocess.run(
            [shell, "-c", command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def resolve(
    request: Request,
    files: list[tuple[Path, bool]],
    *,
    run_exec: Callable[[str], bool] | None = None,
) -> dict[str, list[str]]:
    """What `ssh -G` prints for `KEYS`, read from `files` ((path, is_user_file), in order)."""
    parser = Parser(request, run_exec=run_exec)
    if request.user is not None:  # command-line values come first, so they win
        parser.state.values["user"] = [request.user]
    if request.port is not None:
        parser.state.values["port"] = [str(request.port)]
    if request.jump is not None:
        parser.state.values["proxyjump"] = [request.jump]
    for path, user_file in files:
        parser.read(path, user_file=user_file)
    if parser.want_final:  # ssh reads everything once more; values already set stay
        parser.final = True
        for path, user_file in files:
            parser.read(path, user_file=user_file)
    return _finish(parser.state, request)


def _finish(state: _State, request: Request) -> dict[str, list[str]]:
    """Defaults and the expansions ssh applies before printing."""
    values = state.values
    out: dict[str, list[str]] = {}
    hostname = (state.first("hostname") or request.host).replace("%h", request.host).lower()
    out["hostname"] = [hostname]
    out["user"] = [state.first("user") or ssh_tokens.local_user()]
    out["port"] = [state.first("port") or "22"]
    out["identityfile"] = values.get("identityfile") or [
        f"~/.ssh/{name}" for name in DEFAULT_IDENTITIES
    ]
    for key, default in (("identitiesonly", "no"), ("hashknownhosts", "no")):
        out[key] = [_YES_NO.get((state.first(key) or default).lower(), default)]
    strict = (state.first("stricthostkeychecking") or "ask").lower()
    out["stricthostkeychecking"] = [_STRICT.get(strict, "ask")]
    out["connecttimeout"] = [state.first("connecttimeout") or "none"]
    out["serveraliveinterval"] = [state.first("serveraliveinterval") or "0"]
    out["serveralivecountmax"] = [state.first("serveralivecountmax") or "3"]
    for key in ("proxyjump", "proxycommand", "hostkeyalias"):
        value = state.first(key)
        if value is not None and value.lower() != "none":
            out[key] = [value]
    tokens = ssh_tokens.tokens(
        host=hostname,
        original=request.host,
        port=out["port"][0],
        user=out["user"][0],
        home=request.home,
    )
    defaults = {
        "userknownhostsfile": ["~/.ssh/known_hosts", "~/.ssh/known_hosts2"],
        "globalknownhostsfile": ["/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2"],
    }
    for key, fallback in defaults.items():
        files = values.get(key) or fallback
        out[key] = [
            ssh_tokens.expand(ssh_tokens.expand_tilde(f, request.home), tokens, where=key)
            for f in files
        ]
    return out
