"""Shared by the integration tests: real Slurm daemons, a real headless Chromium,
real MPI ranks.

A missing tool skips a test on a developer machine but fails it under CI
(env CI set), where .ci/run has installed everything and the test must prove it.
"""
from __future__ import annotations

import os

import pytest


def require(ok: bool, what: str) -> None:
    """Skip (locally) or fail (under CI) when a needed tool is missing."""
    if ok:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{what} (CI is set, so this is a failure, not a skip)")
    pytest.skip(what)
