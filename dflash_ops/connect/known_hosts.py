"""known_hosts read and judged as `ssh -o StrictHostKeyChecking=yes` does.

A line is `[@marker] patterns keytype base64 [comment]`. Patterns are comma-separated names
(`*`/`?` wildcards, `!` negation, `[host]:port` off port 22) or one hashed name
`|1|base64(salt)|base64(HMAC-SHA1(salt, name))`. The name looked up is `HostKeyAlias` if set,
else `host` or `[host]:port`. For the key the server presents:
1. a matching `@revoked` line with that key → refused (`HostKeyRevoked`), whatever else says;
2. a matching plain line with that key → accepted (other lines for the host do not matter, so a
   stale key listed first is no "change");
3. any other matching plain line (another key of this type, or only keys of other types: ssh
   then negotiated a type it does not know for the host) → `HostKeyChanged`;
4. nothing matches: off port 22 (without HostKeyAlias) the bare host name is tried as ssh does
   ("checking without port identifier"), and only a match or a revocation there counts;
   otherwise the key is unknown (`HostKeyUnknown`).
`@cert-authority` lines vouch for host certificates only; we never ask for a certificate host
key, so they are skipped, as are lines ssh would skip as malformed (never a crash).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import struct
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from dflash_ops.connect.host_patterns import match_list
from dflash_ops.errors import ConfigError

REVOKED = "@revoked"
CERT_AUTHORITY = "@cert-authority"
_HASH_MAGIC = "|1|"


class Verdict(Enum):
    OK = "ok"
    REVOKED = "revoked"
    CHANGED = "changed"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Entry:
    """One usable known_hosts line."""

    path: Path
    line: int
    marker: str | None  # None, REVOKED or CERT_AUTHORITY
    patterns: str
    blob: bytes  # the public key as the server sends it

    @property
    def key_type(self) -> str:
        return blob_type(self.blob)

    def matches(self, name: str) -> bool:
        if self.patterns.startswith(_HASH_MAGIC):
            return _hashed_matches(self.patterns, name)
        return match_list(name, self.patterns)


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    entry: Entry | None = None  # the line that decided (revoked, changed) or accepted


def blob_type(blob: bytes) -> str:
    """The key type named inside a public key blob (its first SSH string)."""
    if len(blob) < 4:
        return ""
    (length,) = struct.unpack(">I", blob[:4])
    return blob[4 : 4 + length].decode("ascii", errors="replace")


def _hashed_matches(field: str, name: str) -> bool:
    try:
        _, _, salt_b64, digest_b64 = field.split("|", 3)
        salt, digest = base64.b64decode(salt_b64), base64.b64decode(digest_b64)
    except (ValueError, binascii.Error):
        return False
    mine = hmac.new(salt, name.encode(), hashlib.sha1).digest()
    return hmac.compare_digest(mine, digest)


def hashed_name(name: str, *, salt: bytes | None = None) -> str:
    """`|1|salt|hash` for `name`, as `HashKnownHosts yes` writes it."""
    salt = os.urandom(20) if salt is None else salt
    digest = hmac.new(salt, name.encode(), hashlib.sha1).digest()
    return f"{_HASH_MAGIC}{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()}"


def parse_line(text: str, path: Path, number: int) -> Entry | None:
    """One line → an Entry, or None for comments, blanks and lines ssh would skip."""
    fields = text.split()
    if not fields or fields[0].startswith("#"):
        return None
    marker = None
    if fields[0].startswith("@"):
        marker = fields.pop(0)
        if marker not in (REVOKED, CERT_AUTHORITY):
            return None
    if len(fields) < 3:
        return None
    patterns, key_type, key_b64 = fields[:3]
    try:
        blob = base64.b64decode(key_b64, validate=True)
    except (ValueError, binascii.Error):
        return None
    if blob_type(blob) != key_type:
        return None
    return Entry(path=path, line=number, marker=marker, patterns=patterns, blob=blob)


def load(paths: tuple[Path, ...] | list[Path]) -> list[Entry]:
    """Every usable line of the files that exist, in order."""
    entries: list[Entry] = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise ConfigError(f"Cannot read known hosts file {path}: {exc}") from None
        for number, line in enumerate(text.splitlines(), 1):
            entry = parse_line(line, path, number)
            if entry is not None:
                entries.append(entry)
    return entries


def judge(
    entries: list[Entry], name: str, blob: bytes, *, portless: str | None = None
) -> Judgement:
    """The verdict on the server key `blob` for the known_hosts name `name` (see module doc).

    `portless`: the bare host name, tried as ssh does when `[host]:port` knows nothing."""
    judged = _judge_name(entries, name, blob)
    if judged.verdict is Verdict.UNKNOWN and portless is not None:
        bare = _judge_name(entries, portless, blob)
        if bare.verdict in (Verdict.OK, Verdict.REVOKED):
            return bare
    return judged


def _judge_name(entries: list[Entry], name: str, blob: bytes) -> Judgement:
    mine = [e for e in entries if e.marker != CERT_AUTHORITY and e.matches(name)]
    for entry in mine:
        if entry.marker == REVOKED and entry.blob == blob:
            return Judgement(Verdict.REVOKED, entry)
    plain = [e for e in mine if e.marker is None]
    for entry in plain:
        if entry.blob == blob:
            return Judgement(Verdict.OK, entry)
    if plain:  # ssh: a recorded key of any type that is not this one is a change
        same_type = [e for e in plain if e.key_type == blob_type(blob)]
        return Judgement(Verdict.CHANGED, (same_type or plain)[0])
    return Judgement(Verdict.UNKNOWN)


def known_types(entries: list[Entry], name: str) -> list[str]:
    """Key types recorded (plain lines) for `name`, in file order: negotiate these first."""
    found = (e.key_type for e in entries if e.marker is None and e.matches(name))
    return list(dict.fromkeys(found))


def append(path: Path, name: str, key_type: str, key_b64: str, *, hashed: bool) -> str:
    """Add a line for `name` to `path` (hashed if asked); return the name as written."""
    written = hashed_name(name) if hashed else name
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    prefix = ""
    if path.is_file() and path.stat().st_size > 0:
        with path.open("rb") as handle:
            handle.seek(-1, os.SEEK_END)
            prefix = "" if handle.read(1) == b"\n" else "\n"
    with path.open("a") as handle:
        handle.write(f"{prefix}{written} {key_type} {key_b64}\n")
    os.chmod(path, 0o600)
    return written
