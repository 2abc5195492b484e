"""The evaluation benchmark's code corpus: Python sources split into what the target learns,
what is kept from it for the drafter's prompts, and what is held out for the evaluation.

The split is by file and sorted by path, so that every machine with the same Python gets the
same one. The standard library is the corpus (it ships with every Python). Files past the
corpus cap can join the kept ones (`past_cap` bytes): first the rest of the standard library,
then, where that ends first (Python builds without the test suite hold less than the cap),
installed packages' sources. Those never go to the target or the evaluation, and a package
file that repeats a held-out file (vendored copies and backports of standard modules exist)
is left out, so that the drafter never trains on the evaluation's code.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

MIN_CHARS = 200  # shorter files are stubs and `__init__` lines
MAX_PACKAGE_CHARS = 1_000_000  # larger package files are generated tables, not code
SHARED_LINE_CHARS = 30  # lines at least this long count towards overlap with held-out files
MAX_SHARED = 0.1  # a package file with more of its long lines in held-out files is left out


@dataclass(frozen=True)
class Corpus:
    """Python sources in three parts: `train` (the target learns them), `unseen` (kept from the
    target: prompts for the drafter's data that the target answers as it answers new code, not
    by reciting a file it has memorised) and `held` (the evaluation's prompts, never seen by
    the target or the drafter)."""

    train: list[str]
    unseen: list[str]
    held: list[str]
    past_cap_bytes: int = 0  # of `unseen`: the files past the cap (`past_cap`)
    package_bytes: int = 0  # of those: installed packages' sources
    packages_left_out: int = 0  # package files that repeat held-out code

    def describe(self, cap: int, past_cap: int) -> str:
        """The log's line: the parts' sizes and where the files past the cap came from."""
        line = (
            f"corpus: {len(self.train)} training files ({_mb(self.train)}), {len(self.unseen)} "
            f"kept from the target ({_mb(self.unseen)}), {len(self.held)} held out"
        )
        if not past_cap:
            return line
        if not self.past_cap_bytes:
            return line + f"; nothing past --corpus-bytes {cap:,} could be kept"
        stdlib = (self.past_cap_bytes - self.package_bytes) / 1e6
        return line + (
            f"; past --corpus-bytes: {stdlib:.1f} MB of the standard library, "
            f"{self.package_bytes / 1e6:.1f} MB of installed packages' sources "
            f"({self.packages_left_out} package files left out as copies of held-out code)"
        )


def corpus(max_bytes: int, holdout_every: int, unseen_every: int = 0, past_cap: int = 0) -> Corpus:
    """Every `holdout_every`-th standard-library file held out; of the others, every
    `unseen_every`-th unseen (0: none), up to `max_bytes`. Then `past_cap` bytes of files past
    the cap join the unseen ones (those in a held-out place are skipped), then packages'
    sources where the standard library ends first (the module docstring)."""
    parts: dict[str, list[str]] = {"train": [], "unseen": [], "held": []}
    total = kept = extra = 0
    for i, text in _readable(_stdlib_files()):
        if total >= max_bytes:  # past the cap
            if extra >= past_cap:
                break
            if i % holdout_every:
                parts["unseen"].append(text)
                extra += len(text)
            continue
        if i % holdout_every == 0:
            parts["held"].append(text)
        else:
            unseen = unseen_every > 0 and kept % unseen_every == unseen_every - 1
            parts["unseen" if unseen else "train"].append(text)
            kept += 1
        total += len(text)
    packages: list[str] = []
    left_out = 0
    if extra < past_cap:
        packages, left_out = package_sources(past_cap - extra, parts["held"])
        parts["unseen"] += packages
    package_bytes = sum(map(len, packages))
    return Corpus(
        **parts,
        past_cap_bytes=extra + package_bytes,
        package_bytes=package_bytes,
        packages_left_out=left_out,
    )


def package_sources(
    budget: int, held: list[str], root: Path | None = None
) -> tuple[list[str], int]:
    """About `budget` characters of `.py` files under `root` (default: this Python's
    site-packages) in an order spread across packages (by a hash of the path, not by name, so
    that no single package fills the budget), skipping files that repeat held-out code;
    returns (texts, how many were skipped as copies)."""
    root = root or Path(sysconfig.get_paths()["purelib"])
    files = sorted(
        (p for p in root.rglob("*.py") if p.is_file()),
        key=lambda p: hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest(),
    )
    held_lines = {line for text in held for line in _long_lines(text)}
    texts: list[str] = []
    taken = left_out = 0
    for _, text in _readable(files):
        if taken >= budget:
            break
        if len(text) > MAX_PACKAGE_CHARS:
            continue
        if shared_fraction(text, held_lines) > MAX_SHARED:
            left_out += 1
            continue
        texts.append(text)
        taken += len(text)
    return texts, left_out


def shared_fraction(text: str, held_lines: set[str]) -> float:
    """The share of `text`'s long lines (stripped) that also occur in held-out files."""
    lines = list(_long_lines(text))
    return sum(line in held_lines for line in lines) / len(lines) if lines else 0.0


def _long_lines(text: str) -> Iterator[str]:
    for line in text.splitlines():
        line = line.strip()
        if len(line) >= SHARED_LINE_CHARS:
            yield line


def _stdlib_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p
        for p in stdlib.rglob("*.py")
        if not {"site-packages", "dist-packages"} & set(p.parts) and p.is_file()
    )


def _readable(files: Iterable[Path]) -> Iterator[tuple[int, str]]:
    """(index in `files`, text) of each UTF-8 file of at least `MIN_CHARS` characters; the index
    counts every file, so that a split by index does not move when a file is unreadable."""
    for i, path in enumerate(files):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) >= MIN_CHARS:
            yield i, text


def _mb(texts: list[str]) -> str:
    return f"{sum(map(len, texts)) / 1e6:.1f} MB"
