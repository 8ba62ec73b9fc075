"""Schedule autotuner: the interpreter cost model (closed form, fit, shipped parameters), the
offline re-scoring of a recorded run, and manifests that load from any working directory."""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

from kernels.interp import model as im
from autotune.schedule.cli import main
from autotune.schedule.rescore import fit_record
from autotune.schedule.result import TuneResult
from calibrate import profile as profiles
from calibrate.errors import UserError
from kernels.gc3.algorithms import build
from kernels.gc3.compiler import compile_program
from kernels.gc3.ir import Protocol
from kernels.gc3.xml_io import read_xml
from kernels.interp.preset import PROGRAM_DIR, load_preset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from msccl_reference import msccl_dir, reference_xml_files  # noqa: E402  (the reference XML, tests only)

ROOT = Path(__file__).resolve().parents[2]
FIFO = load_preset("h200x2").fifo
LINKS = im.Links(intra_beta=1 / 400e9, inter_beta=1 / 50e9)
PARAMS = im.ModelParams({"Simple": im.ProtocolParams(launch_us=5.0, tile_us=2.0, block_gbs=20.0, grid_block_us=0.01),
                         "LL": im.ProtocolParams(launch_us=3.0, tile_us=0.5, block_gbs=10.0, grid_block_us=0.004)},
                        hop_us=1.5)


def direct(protocol: Protocol):
    return dataclasses.replace(read_xml(PROGRAM_DIR / "direct_allreduce_2r.xml"), protocol=protocol)


@pytest.mark.parametrize("n, split, tile", [(1 << 20, 16, 65536), (1 << 30, 32, 131072), (4096, 1, 65536)])
def test_one_send_closed_form(n, split, tile):
    """Direct 2-rank allreduce: one message of n bytes each way, each of the split CUDA blocks moves
    n/split bytes in ceil(n/split/tile) tiles: t = launch + n beta + tiles tile_us + (n/split)/block_bw."""
    f = im.features(direct(Protocol.SIMPLE), n, split, tile, FIFO, 4)
    assert (f.hops, f.link_bytes, f.inter_link_bytes, f.block_bytes, f.copy_bytes) == (1, n, 0, n / split, 0)
    assert f.block_tiles == math.ceil(n / split / tile)
    assert f.blocks == 2 * split                # a sending and a receiving thread block, split each
    want = 5e-6 + n / 400e9 + f.block_tiles * 2e-6 + n / split / 20e9 + 2 * split * 0.01e-6
    assert im.predict(f, Protocol.SIMPLE, PARAMS, LINKS) == pytest.approx(want, rel=1e-12)
    # LL: half-rate payload on the link, its own fixed costs
    fl = im.features(direct(Protocol.LL), n, split, 0, FIFO, 4)
    want_ll = 3e-6 + 2 * n / 400e9 + fl.block_tiles * 0.5e-6 + n / split / 10e9 + 2 * split * 0.004e-6
    assert im.predict(fl, Protocol.LL, PARAMS, LINKS) == pytest.approx(want_ll, rel=1e-12)


def test_hops_and_copy_of_a_ring():
    ring = compile_program(build("ring_allreduce", 2, 1, 1, Protocol.SIMPLE, 1))
    f = im.features(ring, 1 << 20, 1, 0, FIFO, 4)
    assert f.hops == 2                          # reduce-scatter step, then all-gather step
    assert f.copy_bytes == (1 << 20 if ring.inplace else 0)
    assert im.hops(direct(Protocol.SIMPLE)) == 1


def test_fit_recovers_exact_parameters():
    samples = []
    for proto in (Protocol.SIMPLE, Protocol.LL):
        for n in (1 << 12, 1 << 18, 1 << 22, 1 << 26):
            for split, tile in ((1, 65536), (8, 8192), (32, 131072)):
                f = im.features(direct(proto), n, split, tile, FIFO, 4)
                samples.append(im.Sample(direct(proto), proto, n, split, tile, im.predict(f, proto, PARAMS, LINKS)))
    got = im.fit(samples, FIFO, 4, LINKS, PARAMS.hop_us)
    for p, want in PARAMS.protocols.items():
        g = got.protocols[p]
        assert (g.launch_us, g.tile_us, g.block_gbs) == pytest.approx(
            (want.launch_us, want.tile_us, want.block_gbs), rel=1e-6)
    assert im.ModelParams.from_json(got.to_json()).protocols == got.protocols


def test_fit_recovers_the_hop_cost_from_multi_hop_programs():
    """With two-hop programs among the samples the per-hop cost is fitted too (the given one is ignored)."""
    ring = compile_program(build("ring_allreduce", 2, 1, 1, Protocol.SIMPLE, 1))
    samples = []
    for proto in (Protocol.SIMPLE, Protocol.LL):
        for prog in (direct(proto), dataclasses.replace(ring, protocol=proto)):
            for n in (1 << 12, 1 << 18, 1 << 22, 1 << 26):
                for split, tile in ((1, 65536), (8, 8192), (32, 131072)):
                    f = im.features(prog, n, split, tile, FIFO, 4)
                    samples.append(im.Sample(prog, proto, n, split, tile, im.predict(f, proto, PARAMS, LINKS)))
    got = im.fit(samples, FIFO, 4, LINKS, hop_us=99.0)
    assert got.hop_us == pytest.approx(PARAMS.hop_us, rel=1e-6)
    for p, want in PARAMS.protocols.items():
        assert dataclasses.astuple(got.protocols[p]) == pytest.approx(dataclasses.astuple(want), rel=1e-6)


@pytest.mark.skipif(not reference_xml_files(), reason=f"no MSCCL XML files in {msccl_dir()}: the recorded sweep's "
                    f"multi-hop programs are read from them (set COMMTUNE_MSCCL_DIR)")
def test_shipped_parameters_are_the_fit_of_the_recorded_sweep():
    """kernels/interp/fitted/interp_model.json is what --fit-model derives from the interpreter sweep it names
    (whose multi-hop programs are MSCCL's reference XML: without them the refit leaves them out and differs)."""
    shipped = im.load_params()
    refit = fit_record(str(ROOT / shipped.provenance["source"]),
                       profiles.Profile.load(shipped.provenance["profile"]), load_preset("h200x2"),
                       reference_dir=msccl_dir())
    assert shipped.hop_us == refit.hop_us
    for p, v in refit.protocols.items():
        assert dataclasses.astuple(shipped.protocols[p]) == pytest.approx(dataclasses.astuple(v), rel=1e-9)


def test_bad_parameters_are_one_line(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"version": 1, "hop_us": 0, "protocols": {"LL": {"launch_us": 1}}}))
    with pytest.raises(UserError, match="malformed"):
        im.load_params(str(bad))
    with pytest.raises(UserError, match="no parameters for protocol LL128"):
        PARAMS.for_protocol("LL128")


@pytest.fixture
def tuned(tmp_path):
    """A model-only run whose table is not empty (an interpreter without fixed costs)."""
    space = json.loads((ROOT / "autotune/schedule/presets/spaces.json").read_text())
    space.update({"channels": [1], "instances": [1], "blocks": [{"bytes_per_block": 65536, "max_split": 8}],
                  "tile_bytes": {"Simple": [65536], "LL": [0]}})
    (tmp_path / "space.json").write_text(json.dumps(space))
    params = im.ModelParams({p: im.ProtocolParams(0.0, 0.0, 1e6) for p in ("Simple", "LL")}, 0.0)
    (tmp_path / "params.json").write_text(json.dumps(params.to_json()))
    out = tmp_path / "out"
    assert main(["--gpus", "2", "--sizes", "1K,1M,64M", "--space", str(tmp_path / "space.json"),
                 "--model-params", str(tmp_path / "params.json"), "--out", str(out)]) == 0
    return out


def test_rescore_of_a_synthetic_run(tuned, tmp_path, capsys):
    """Measured times made a monotone function of the shipped model's prediction: every band ranks
    perfectly; the printout shows prediction, measurement and error per row."""
    res = TuneResult.load(tuned)
    res.measured, res.device = True, "synthetic"
    shipped = im.load_params()
    from autotune.schedule.model import Model
    from autotune.schedule.space import build_candidate
    coll = res.collectives[0]
    model = Model(profiles.Profile.load(res.profile), coll.collective, 2, 1, 2, 4, FIFO, shipped)
    for b in coll.bands:
        for r in b.rows:
            if r.selected:
                t = model.model_seconds(build_candidate(coll.candidates[r.key], 2), b.rep) * 1e6
                r.measured_us, r.correct = 3.0 + 1.5 * t, True
    res.save(tmp_path / "run.json")
    capsys.readouterr()
    assert main(["--rescore", str(tmp_path / "run.json")]) == 0
    text = capsys.readouterr().out
    assert "nothing was measured: a re-scoring" in text
    model_line = next(line for line in text.splitlines() if "Spearman per band, model:" in line)
    assert all(v in ("'1.00'", "'-'") for v in model_line.split("[")[1].rstrip("]").split(", "))
    assert "error" in text and "split" in text


def test_manifest_programs_are_relative_and_load_from_another_cwd(tuned, tmp_path, monkeypatch):
    data = json.loads((tuned / "manifest.json").read_text())
    assert data["programs"] and all(not Path(e["program"]).is_absolute() for e in data["programs"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    preset = load_preset(str(tuned / "manifest.json"))
    for e in preset.entries:
        assert e.path().is_file() and e.path().parent == (tuned / "programs").resolve()
        read_xml(e.path())
    shipped = load_preset("h200x2")     # shipped presets still name programs of the package
    assert shipped.entries[0].program == "direct_allreduce_2r.xml"
    assert shipped.entries[0].path() == PROGRAM_DIR / "direct_allreduce_2r.xml"
