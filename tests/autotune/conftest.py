"""Fixtures the pipeline tests share: ``graph``, the small GPT they plan (``PIPELINE_GPT``), and ``profile``,
the profile they price it with. A test module's own fixture of the same name takes precedence."""
import pytest

from calibrate.profile import Profile
from models import load_model
from tiny_models import PIPELINE_GPT


@pytest.fixture(scope="module")
def graph():
    return load_model("gpt", "gpt3-1.3b", PIPELINE_GPT)


@pytest.fixture(scope="module")
def profile():
    """The embedded default without its host figures (a stand-in since issue 42): the closed forms here are of the
    devices' prices; the tests of the host's floor add their own (``with_host``)."""
    from dataclasses import replace
    p = Profile.load("h200-nvlink+ib400")
    return replace(p, compute=replace(p.compute, host_s={}))
