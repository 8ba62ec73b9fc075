"""Schedule autotuner end to end on the model alone (the CI path): candidates, outputs the
interpreter's selection loads, NCCL tuner CSV, result JSON round trip, bad input."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.schedule.cli import main
from autotune.schedule.result import NCCL, TuneResult
from autotune.schedule.space import enumerate_candidates, load_space
from calibrate.errors import UserError
from kernels.gc3.xml_io import read_xml
from kernels.interp.preset import load_preset
from kernels.interp.select import choose
from kernels.nccl_tuner.table import SIZE_MAX, load_table

ROOT = Path(__file__).resolve().parents[2]


def small_space(tmp_path: Path, **over) -> Path:
    data = json.loads((ROOT / "autotune/schedule/presets/spaces.json").read_text())
    data.update({"channels": [1, 2], "instances": [1], "blocks": [{"bytes_per_block": 65536, "max_split": 8}]})
    data.update(over)
    path = tmp_path / "space.json"
    path.write_text(json.dumps(data))
    return path


def test_enumeration_dedupes_and_explains_skips(tmp_path):
    space = load_space(str(small_space(tmp_path, protocols=["Simple", "LL", "LL128"])))
    built, notes = enumerate_candidates(space, "allreduce", 2, 1)
    keys = [b.candidate.key for b in built]
    assert len(keys) == len(set(keys))
    assert {b.candidate.protocol for b in built} == {"Simple", "LL"}
    assert any("LL128 skipped" in n for n in notes)
    assert any("hierarchical_allreduce skipped" in n for n in notes)
    assert any("rdh_allreduce c1i1: the same program as ring_allreduce c1i1" in n for n in notes)
    assert any(b.candidate.source == "file" for b in built)


def test_space_errors_are_one_line(tmp_path):
    with pytest.raises(UserError, match="unknown algorithm"):
        load_space(str(small_space(tmp_path, collectives={"allreduce": {"algorithms": ["nope"]}})))
    with pytest.raises(UserError, match="version"):
        load_space(str(small_space(tmp_path, version=9)))
    with pytest.raises(UserError, match="no search space"):
        load_space("missing-space")


def test_model_only_run_writes_a_table_the_interpreter_selects_from(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["--collective", "allreduce,allgather", "--gpus", "2", "--profile", "gcp-a100", "--sizes",
               "1K,64K,16M", "--space", str(small_space(tmp_path)), "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "nothing was measured" in text

    result = TuneResult.load(out)
    assert not result.measured and result.not_measured_reason
    assert TuneResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    preset = load_preset(str(out / "manifest.json"))
    loaded = [(e, read_xml(e.path())) for e in preset.entries]
    for (e, prog), res_entry in zip(loaded, [t for c in result.collectives for t in c.table]):
        assert (prog.min_bytes, prog.max_bytes) == (e.min_bytes, e.max_bytes) == (res_entry.lo, res_entry.hi)
    for coll in result.collectives:
        assert coll.summary["basis"] == "predicted"
        for band in coll.bands:
            assert band.measured_rows() == []
            esize, ranks = 4, 2
            count = band.rep // esize // (ranks if coll.collective == "allgather" else 1)
            c = choose(loaded, coll.collective, count, "float32", ranks, preset.max_split)
            if band.choice == NCCL:
                assert c.uses_nccl, c.reason
            else:
                cand = coll.candidates[band.choice]
                assert not c.uses_nccl and c.protocol.value == cand.protocol
                assert c.entry.bytes_per_block == cand.bytes_per_block
    rows = load_table(out / "nccl_tuner.conf", allow_empty=True)  # NCCL may keep every band
    for r in rows:
        assert r.ranks == 2 and r.nodes == 1 and r.protocol in ("simple", "ll")
        assert r.min_bytes <= r.max_bytes <= SIZE_MAX


def test_every_chosen_ring_band_is_exported_to_nccl(tmp_path):
    """A space of rings only: every band the table serves has an NCCL row, max inclusive."""
    space = small_space(tmp_path, collectives={"allreduce": {"algorithms": ["ring_allreduce"], "programs": []}})
    out = tmp_path / "out"
    params = tmp_path / "free.json"     # an interpreter with no fixed costs: only the link counts
    params.write_text(json.dumps({"version": 1, "hop_us": 0.0, "protocols": {
        p: {"launch_us": 0.0, "tile_us": 0.0, "block_gbs": 1e6} for p in ("Simple", "LL")}}))
    assert main(["--gpus", "2", "--profile", "gcp-a100", "--sizes", "1K,1M,256M", "--space", str(space),
                 "--model-params", str(params), "--out", str(out)]) == 0
    table = TuneResult.load(out).collectives[0].table
    assert table    # without fixed costs the ring beats the profile's NCCL
    rows = load_table(out / "nccl_tuner.conf")
    assert [(r.min_bytes, r.max_bytes, r.algorithm) for r in rows] == \
        [(t.lo, (t.hi - 1) if t.hi else SIZE_MAX, "ring") for t in table]


@pytest.mark.parametrize("argv, msg", [
    (["--gpus", "3", "--nodes", "2"], "not a multiple"),
    (["--gpus", "1"], "at least 2"),
    (["--collective", "broadcast"], "cannot be tuned"),
    (["--collective", "nope"], "unknown collective"),
    (["--sizes", "1K:1G"], "min:max:factor"),
    (["--candidates", "0"], "--candidates"),
    (["--budget", "4"], "is now --candidates"),
    (["--profile", "nope"], "unknown profile"),
])
def test_bad_input_is_one_line_exit_2(argv, msg):
    proc = subprocess.run([sys.executable, "-m", "autotune", "schedule", "--model-only", *argv],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert msg in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_help():
    proc = subprocess.run([sys.executable, "-m", "autotune", "schedule", "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 0 and "--candidates" in proc.stdout and "nccl_tuner.conf" in proc.stdout
