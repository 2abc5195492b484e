"""Shared test set-up: real parts only (sshd on loopback, a namespace-backed Proxmox stand-in,
real tmux, real torch). GPU tests are skipped on machines without CUDA; serving tests run only
under `make serve-test`, which sets `DFLASH_SERVE_PYTHON` to its vLLM environment's python."""

from __future__ import annotations

import os

import pytest

pytest_plugins = [
    "tests.fixtures.ssh",  # a real OpenSSH server on 127.0.0.1 and a client home that trusts it
    "tests.fixtures.proxmox",  # a `pct` stand-in whose containers are Linux namespaces
    "tests.fixtures.netns",  # a link a test can cut: sshd behind a veth pair in namespaces
]


def _cuda_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    count = _cuda_count()
    serve_python = os.environ.get("DFLASH_SERVE_PYTHON")
    for item in items:
        if "serve" in item.keywords and not serve_python:
            item.add_marker(pytest.mark.skip(reason="a real engine: run by make serve-test"))
        if "gpu2" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA GPUs, found {count}"))
        elif "gpu" in item.keywords and count < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
