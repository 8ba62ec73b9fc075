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
    return Profile.load("h200-nvlink+ib400")
