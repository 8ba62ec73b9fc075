"""The whole suite's fixtures."""
from __future__ import annotations

import os

import pytest

from autotune.sbp.steptime import UNPRICED


@pytest.fixture(autouse=True, scope="session")
def unpriced_overheads_allowed():
    """Multi-GPU planning refuses a profile without host and overlap figures (issue 42); until the embedded GPU
    profiles carry the overlap slowdown measured on H200 (tests/gpu/calib_module_check.sh), the suite's plans on
    them go on without it (the environment reaches the commands the tests start too). A test of the refusal
    removes the switch (monkeypatch.delenv)."""
    os.environ[UNPRICED] = "allow"
    yield
    os.environ.pop(UNPRICED, None)
