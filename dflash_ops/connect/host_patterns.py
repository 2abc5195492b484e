"""OpenSSH's host patterns, as known_hosts lines use them: `*` any run, `?` one character,
everything else literal; a list matches on one positive pattern and no negated (`!`) one."""

from __future__ import annotations

import re


def match_pattern(name: str, pattern: str) -> bool:
    """OpenSSH's match_pattern."""
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, name, flags=re.DOTALL) is not None


def match_list(name: str, patterns: str, *, fold: bool = True) -> bool:
    """OpenSSH's match_hostname over a comma-separated list (`fold`: case-insensitive, as host
    names are)."""
    if fold:
        name = name.lower()
    matched = False
    for item in (p for p in patterns.split(",") if p):
        negated = item.startswith("!")
        pattern = item[1:] if negated else item
        if match_pattern(name, pattern.lower() if fold else pattern):
            if negated:
                return False
            matched = True
    return matched
