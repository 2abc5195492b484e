"""shell.py: argv → shell string round-trips through real shells; validators refuse clearly."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_ops.connect import shell
from dflash_ops.errors import UnsafeValue

CANARY = "dflash-canary"
# Fragments that would run `touch CANARY` if any shell ever interpreted them.
HOSTILE = [
    f"$(touch {CANARY})",
    f"`touch {CANARY}`",
    f"; touch {CANARY}",
    f"&& touch {CANARY}",
    f"| touch {CANARY}",
    f"\ntouch {CANARY}\n",
    f"'; touch {CANARY}; '",
    f'"; touch {CANARY}; "',
    f"'\"'\"'; touch {CANARY} #",
    f"$(IFS=_;touch_{CANARY})",
    f"${{IFS}}touch${{IFS}}{CANARY}",
    f">{CANARY}",
    "-rf",
    "--",
    "*",
    "~",
    "$HOME",
    "!!",
    "\\",
    "",
    " ",
    "ünïcødé ✓ 日本",
    "\t\r\x1b[31m",
]
characters = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
hostile_word = st.one_of(
    st.sampled_from(HOSTILE),
    st.text(characters, max_size=20),
    st.lists(st.sampled_from(HOSTILE + ["'", '"', "$", "`", ";", "\n", "-"]), max_size=4).map(
        "".join
    ),
)


def _roundtrip(shell_path: str, argv: list[str], cwd: Path) -> list[str]:
    command = shell.quote_argv(["printf", "%s\\0", *argv])
    out = subprocess.run(
        [shell_path, "-c", command], cwd=cwd, capture_output=True, check=True
    ).stdout
    return out.decode().split("\0")[:-1]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(argv=st.lists(hostile_word, min_size=1, max_size=5))
def test_quote_argv_roundtrips_through_bash_and_sh(argv: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        for shell_path in ("/bin/bash", "/bin/sh"):
            assert _roundtrip(shell_path, argv, cwd) == argv, shell_path
        assert not (cwd / CANARY).exists()
        assert not (cwd / f"_{CANARY}").exists()


def test_plain_words_stay_readable() -> None:
    assert shell.quote_argv(["tmux", "new-session", "-d", "-s", "dflash"]) == (
        "tmux new-session -d -s dflash"
    )
    assert shell.quote_argv(["echo", "a b"]) == "echo 'a b'"
    assert shell.quote_argv(["echo", "it's"]) == "echo 'it'\"'\"'s'"
    assert shell.quote_argv(["echo", ""]) == "echo ''"


def test_quote_argv_refuses_nul_and_empty() -> None:
    with pytest.raises(UnsafeValue, match=r"argument 'a\\x00b'.*NUL"):
        shell.quote_argv(["echo", "a\x00b"])
    with pytest.raises(UnsafeValue, match="empty command"):
        shell.quote_argv([])
    with pytest.raises(TypeError):
        shell.quote_argv("echo hi")  # a string is not an argv
    with pytest.raises(TypeError):
        shell.quote_argv(["echo", 3])  # type: ignore[list-item]


@pytest.mark.parametrize("name", ["dflash", "run-2.b_c", "a" * 64, "A.1"])
def test_session_name_accepts(name: str) -> None:
    assert shell.session_name(name) == name


@pytest.mark.parametrize(
    "name", ["", "-dflash", "a b", "a:b", "x;rm", "a" * 65, "$(id)", "ä", "a\n", 7]
)
def test_session_name_refuses(name: object) -> None:
    with pytest.raises(UnsafeValue) as info:
        shell.session_name(name)  # type: ignore[arg-type]
    assert "session name" in str(info.value)
    assert repr(name) in str(info.value)


def test_env_key() -> None:
    assert shell.env_key("PYTORCH_CUDA_ALLOC_CONF") == "PYTORCH_CUDA_ALLOC_CONF"
    assert shell.env_key("_x1") == "_x1"
    for bad in ["1X", "A-B", "A B", "", "A=B", "$(id)", "Ä"]:
        with pytest.raises(UnsafeValue, match="environment variable name") as info:
            shell.env_key(bad)
        assert repr(bad) in str(info.value)


def test_env_value() -> None:
    for good in ["expandable_segments:True", "a b", "$(id)", "line\nbreak", "", "ü"]:
        assert shell.env_value(good) == good
    with pytest.raises(UnsafeValue, match=r"environment value 'a\\x00'"):
        shell.env_value("a\x00")


@pytest.mark.parametrize(("given_", "expected"), [(200, 200), ("200", 200), (100, 100)])
def test_container_id_accepts(given_: int | str, expected: int) -> None:
    assert shell.container_id(given_) == expected


@pytest.mark.parametrize(
    "bad",
    [True, False, -200, 99, 0, 1_000_000_000, "200; rm -rf /", " 200", "2e2", "", 200.0, None],
)
def test_container_id_refuses(bad: object) -> None:
    with pytest.raises(UnsafeValue) as info:
        shell.container_id(bad)  # type: ignore[arg-type]
    assert "container id" in str(info.value)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize(
    ("given_", "expected"),
    [
        ("/root/dflash", "/root/dflash"),
        ("/workspace//checkpoints/", "/workspace/checkpoints"),
        ("/a/./b", "/a/b"),
        ("/with space/ü", "/with space/ü"),
    ],
)
def test_remote_path_accepts(given_: str, expected: str) -> None:
    assert shell.remote_path(given_) == expected


@pytest.mark.parametrize(
    "bad", ["/", "//", "/./", "", "relative/x", "~/x", "/a/../b", "/a/..", "/a\nb", "/a\x00", 5]
)
def test_remote_path_refuses(bad: object) -> None:
    with pytest.raises(UnsafeValue) as info:
        shell.remote_path(bad)  # type: ignore[arg-type]
    assert "remote path" in str(info.value)
    assert repr(bad) in str(info.value)
