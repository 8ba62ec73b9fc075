"""The commit a record names: never another repository's."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from calibrate.measure import provenance

ROOT = Path(__file__).resolve().parents[2]


def test_the_environment_names_the_commit_of_a_copy_without_git(monkeypatch):
    monkeypatch.setenv("COMMTUNE_COMMIT", "abc123")
    assert provenance.commit() == "abc123"


def test_a_copy_inside_another_repository_names_no_commit(tmp_path, monkeypatch):
    """A lent machine's copy of the tree sat inside another repository, whose commit the records named."""
    monkeypatch.delenv("COMMTUNE_COMMIT", raising=False)
    outer = tmp_path / "outer"
    outer.mkdir()
    git = ["git", "-C", str(outer), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "outer"], check=True)
    copy = outer / "main"
    shutil.copytree(ROOT / "calibrate", copy / "calibrate")
    code = "from calibrate.measure.provenance import commit; print(repr(commit()))"
    r = subprocess.run([sys.executable, "-c", code], cwd=copy, capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(copy)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "''"
