"""python -m autotune execute and calibrate compute on bad input: one line naming the fix."""
import json
import subprocess
import sys

import pytest

from autotune.__main__ import main

TINY = ["--layers", "1", "--hidden", "8", "--heads", "4", "--sequence", "4", "--vocabulary", "16", "--batch", "4",
        "--micro-batch", "4", "--ffn", "32", "--budget", "50steps", "--compare", "none"]


@pytest.fixture(scope="module")
def plan4(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    assert main(["--nodes", "2", "--gpus-per-node", "2", *TINY, "--out", str(out)]) == 0
    return out / "plan.json"


@pytest.fixture(scope="module")
def plan1(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan1")
    assert main(["--nodes", "1", "--gpus-per-node", "1", *TINY, "--out", str(out)]) == 0
    return out / "plan.json"


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_plan_for_another_mesh(plan4, capsys):
    assert main(["execute", str(plan4)]) == 2  # one process launched, the plan wants 4
    line = _err(capsys)
    assert "4 devices but 1 processes" in line and "--nproc-per-node 4" in line


def test_model_flags_that_differ_from_the_plan(plan4, capsys):
    assert main(["execute", str(plan4), "--hidden", "16"]) == 2
    line = _err(capsys)
    assert "hidden 8" in line and "--hidden 16" in line
    assert main(["execute", str(plan4), "--model", "mlp"]) == 2
    assert "gpt model" in _err(capsys)


def test_older_schema(plan4, tmp_path, capsys):
    d = json.loads(plan4.read_text())
    d["version"] = 0
    old = tmp_path / "old.json"
    old.write_text(json.dumps(d))
    assert main(["execute", str(old)]) == 2
    assert "version 0; this tool reads version 2: re-run python -m autotune --out DIR" in _err(capsys)


def test_a_plan_larger_than_the_hosts_memory_is_refused_on_the_cpu_before_it_is_built(plan1, tmp_path, capsys,
                                                                                       monkeypatch):
    """A plan priced for a GPU run on the CPU (autotune tune or execute on a machine without one) would be killed by
    the kernel part-way: its predicted bytes a process against the host's available memory, one line first."""
    import os

    from calibrate.run_limits import host_available_bytes
    d = json.loads(plan1.read_text())
    d["best"]["costs"]["memory_bytes"] = 1e15
    big = tmp_path / "big.json"
    big.write_text(json.dumps(d))
    assert main(["execute", str(big), "--device", "cpu", "--out", str(tmp_path / "out")]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]  # after the run's progress lines
    assert "predicted 9.313e+05 GiB a process x 1 process(es) on the CPU is more than this host's available" in line
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24000000 kB\nMemAvailable:   2048 kB\n")
    assert host_available_bytes(str(info)) == 2048 * 1024
    pages = {"SC_AVPHYS_PAGES": 3, "SC_PAGE_SIZE": 4096}  # no meminfo: the free pages
    monkeypatch.setattr(os, "sysconf", pages.__getitem__)
    assert host_available_bytes(str(tmp_path / "no")) == 3 * 4096


def test_unknown_baseline(plan4, capsys):
    assert main(["execute", str(plan4), "--which", "baseline:zero"]) == 2
    assert "Megatron" in _err(capsys)


def test_torch_missing_names_the_extra(plan4, tmp_path):
    """Without torch (blocked here), execute and calibrate compute say how to install it."""
    block = "import sys; sys.modules['torch'] = None; "
    for call in (f"from autotune.__main__ import main; sys.exit(main(['execute', r'{plan4}']))",
                 f"from calibrate.__main__ import main; sys.exit(main(['compute', '--out', r'{tmp_path / 'p.json'}']))"):
        r = subprocess.run([sys.executable, "-c", block + call], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "pip install -e '.[torch]'" in lines[0], lines


def test_summarize_without_results(tmp_path, capsys):
    assert main(["execute", "--summarize", str(tmp_path)]) == 2
    assert "no execute-" in _err(capsys)



@pytest.mark.parametrize("spec,words", [("models.modules", "package.module:factory"),
                                        ("no_such_package.mod:build", "cannot import 'no_such_package.mod'"),
                                        ("models.modules:no_such_factory", "no callable 'no_such_factory'"),
                                        ("json:loads", "json:loads(config) raised TypeError")])
def test_bad_module_factory(plan1, spec, words, capsys):
    assert main(["execute", str(plan1), "--module", spec]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # a factory that raises is found when it is called: after
    line = err[-1]                                      # the run's first progress lines, one error line, last
    assert [ln for ln in err if "error" in ln] == [line] and not any("Traceback" in ln for ln in err)
    assert line.startswith("autotune execute: error:") and words in line


def test_a_profile_of_another_device_is_warned_of():
    from types import SimpleNamespace

    from autotune.execute.cli import device_warning
    from calibrate.profile import DEFAULT_PROFILE, Profile
    name = Profile.load(DEFAULT_PROFILE).device.name
    assert "measured on" in device_warning(SimpleNamespace(profile=DEFAULT_PROFILE), "CPU")
    assert device_warning(SimpleNamespace(profile=DEFAULT_PROFILE), name) is None
    assert device_warning(SimpleNamespace(profile="no-such-profile"), "CPU") is None


def test_an_out_locked_by_another_host_is_refused_before_any_step(plan1, tmp_path, capsys):
    """Two runs into one --out: the second is refused (the lock of a run on another host included)."""
    from calibrate.lock import LOCK_NAME
    (tmp_path / LOCK_NAME).write_text("otherhost 4242 1700000000\n")
    assert main(["execute", str(plan1), "--out", str(tmp_path), "--steps", "2", "--warmup", "1"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "in use by process 4242 on otherhost" in line and not list(tmp_path.glob("*.json"))


def test_a_layer_placement_the_plan_cannot_hold(plan1, tmp_path, capsys):
    bad = json.loads(plan1.read_text())
    bad["best"]["layers"][0]["output"] = ["X"] * len(bad["best"]["layers"][0]["output"])
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    assert main(["execute", str(tmp_path / "bad.json"), "--out", str(tmp_path / "o"), "--steps", "2", "--warmup", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [ln for ln in err if "error" in ln] == [err[-1]] and "placement 'X'" in err[-1]
    import autotune
    from calibrate.errors import UserError
    torch = pytest.importorskip("torch")
    with pytest.raises(UserError, match="placement 'X'"):  # autotune.apply reads it alike
        autotune.apply(str(tmp_path / "bad.json"), torch.nn.Linear(2, 2))
