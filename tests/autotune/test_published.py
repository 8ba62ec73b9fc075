"""Published runs as regression tests (issue 43): the published steps from the papers' figures, the forced
configurations priced, the comparison with the previous record."""
import json

import pytest

from calibrate.errors import UserError
from autotune import published
from autotune.sbp import techniques
from autotune.cli.reproduce import main
from autotune.reproduce import worse_figures

CASES = {c["id"]: c for c in published.load_cases()}


@pytest.mark.parametrize("cid", sorted(CASES))
def test_published_step_follows_from_the_papers_figures(cid):
    """The data file's stated step is the arithmetic on the paper's figures (TFLOP/s per GPU, FLOP count)."""
    lo, hi = published.published_step(CASES[cid])
    want = CASES[cid]["published"]["step_s"]
    assert lo == pytest.approx(want[0], rel=2e-3) and hi == pytest.approx(want[1], rel=2e-3)


def test_megatron_count_closed_form():
    """Megatron-LM's 18.4 B row: 96 B s l h^2 (1 + s/6h + V/16lh) / (256 x 135 TFLOP/s) = 9.40 s."""
    b, s, l, h, v = 1024, 2048, 40, 6144, 51200
    flops = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    assert published.published_step(CASES["megatron-18.4b"])[0] == pytest.approx(flops / (256 * 135e12))


def test_forced_plan_is_the_papers_configuration():
    row = published.run_case(CASES["megatron-145.6b"], with_search=False)
    f = row["forced"]
    assert f["micro_batches"] == 2304 // (24 * 2) and f["fits"]
    assert "--num-virtual-stages-per-pipeline-rank 2" in f["config"] and "--micro-batch-size 2" in f["config"]
    assert 0 < f["mfu"] < row["gemm_ceiling"] < 1
    assert row["forced_ratio"] == pytest.approx(f["step_s"] / row["published_s"][0])


def test_llama_techniques_priced_and_context_parallelism_too():
    """Llama 3's configurations are priced with their techniques (no technique left unpriced), the 131,072-token
    row with context parallelism 16 (the attention core over the group, its K and V all-gathered); a degree
    that does not make the GPUs is a one-line error (a sequence it does not split: test_context_parallel)."""
    row = published.run_case(CASES["llama3-405b-8k"], with_search=False)
    assert "over the" in row["reason"]  # priced; its memory over the limit
    assert "--sequence-parallel" in row["forced"]["config"] and "--use-distributed-optimizer" in row["forced"]["config"]
    row = published.run_case(CASES["llama3-405b-cp16"], with_search=False)
    assert "--context-parallel-size 16" in row["forced"]["config"]
    assert row["forced"]["step_s"] > published.published_step(CASES["llama3-405b-cp16"])[0]
    case = dict(CASES["llama3-405b-8k"], plan=dict(CASES["llama3-405b-8k"]["plan"], context_parallel=16))
    with pytest.raises(UserError, match="is not the 8192 GPUs"):
        published.run_case(case, with_search=False)


def test_worse_flags_a_step_that_grew():
    old = [{"id": "a", "forced": {"step_s": 10.0}, "searched": {"step_s": 5.0}}]
    assert published.worse([{"id": "a", "forced": {"step_s": 10.0}, "searched": {"step_s": 5.01}}], old) == []
    assert published.worse([{"id": "a", "forced": {"step_s": 10.0}, "searched": {"step_s": 5.2}}], old) \
        == ["a searched 5 s -> 5.2 s"]
    assert published.worse([{"id": "a", "forced": {"step_s": None}, "searched": {"step_s": 5.0}}], old) \
        == ["a forced 10 s -> none"]


def test_autoddl_flags_a_searched_figure_that_got_worse():
    """The pipeline-wide-64 case of the issue: the same verdict, a step 129.5 s against the recorded 113.3 s."""
    prev = [{"id": "pipeline-wide-64", "searched_s": 113.3, "status": "pass"}]
    assert worse_figures([{"id": "pipeline-wide-64", "searched_s": 129.5, "status": "pass"}], prev) \
        == ["pipeline-wide-64 113.3 s -> 129.5 s"]
    assert worse_figures([{"id": "pipeline-wide-64", "searched_s": 113.3, "status": "pass"}], prev) == []


def test_bad_previous_record_and_case_are_one_line_errors(tmp_path):
    bad = tmp_path / "reproduce.json"
    bad.write_text(json.dumps({"kind": "something-else", "version": 1, "rows": []}))
    with pytest.raises(UserError):
        published.previous_rows(bad)
    with pytest.raises(UserError, match="unknown case"):
        main(["published", "--case", "nope", "--out", str(tmp_path / "o")])


def test_autoddl_compares_each_case_with_its_newest_recorded_row():
    """A record file may hold a few cases only: each case is compared with the newest row recorded for it, so
    Table 3's pipeline-wide-64 is compared at all: with its newest row (session 35's Table 3 file: 110.00 s, its
    one stage priced as the single-stage step in the autoddl recipe; re-baselined once at 129.5 s, the 113.26 s
    before priced a step torch does not run), the other cases with their own newest rows (session 35's file holds
    the four Table 3 cases only); pipeline-wide-128 re-baselined there at 110.02 s (was 107.96 s: the autoddl
    recipe), pipeline-deep-64 at 50.84 s with no re-baseline. Before session 35 (the 2026-11-29 files and older):
    pipeline-wide-128 and pipeline-deep-64 re-baselined at 107.96 and 50.80 s (fully_shard's copies priced, the
    same plans)."""
    from autotune.reproduce import rebaselined, recorded_rows, records
    rows = {r["id"]: r for r in recorded_rows(records())}
    assert rows["pipeline-wide-64"]["searched_s"] == pytest.approx(110.00, abs=0.01)
    assert rows["pipeline-wide-128"]["searched_s"] == pytest.approx(110.02, abs=0.01)
    assert rows["pipeline-deep-64"]["searched_s"] == pytest.approx(50.84, abs=0.01)
    assert [line.split(" (was ")[1][:6] for line in rebaselined(
        [{"id": "pipeline-wide-128"}, {"id": "pipeline-deep-64"}], list(rows.values()))] == ["108 s:"]
    upto = {r["id"]: r for r in recorded_rows([p for p in records() if p.name < "sbp_reproduce_2026-12"])}
    assert [line.split(" (was ")[1][:8] for line in rebaselined(
        [{"id": "pipeline-wide-128"}, {"id": "pipeline-deep-64"}], list(upto.values()))] == ["105.8 s:", "49.79 s:"]
    before = {r["id"]: r for r in recorded_rows([p for p in records() if "session18" not in p.name
                                                 and p.name <= "sbp_reproduce_2026-11-29_table3.json"])}
    assert before["pipeline-wide-64"]["searched_s"] == pytest.approx(110.57, abs=0.01)
    assert before["pipeline-wide-128"]["searched_s"] == pytest.approx(105.80, abs=0.01)
    assert worse_figures([{"id": "pipeline-wide-64", "searched_s": 110.0}], list(rows.values())) == []
    assert worse_figures([{"id": "pipeline-wide-64", "searched_s": 113.3}], list(rows.values())) \
        == ["pipeline-wide-64 110 s -> 113.3 s"]
    assert rebaselined([{"id": "pipeline-wide-64"}], list(rows.values())) == []  # the newest row is no re-baseline
    older = recorded_rows([p for p in records() if "2026-11-29" not in p.name and p.name < "sbp_reproduce_2026-12"])
    assert "torch's PipelineStage does not run" in rebaselined([{"id": "pipeline-wide-64"}], older)[0]


def test_local_ddp_leaves_the_whole_gradient_sync_exposed_and_the_parts_add_up():
    """Megatron-LM 2021's local DDP all-reduces after the pipeline flush (``overlap_grad_reduce`` false in the
    145.6 B case): the binding stage's exposed sync is its whole sync, where with the reduce overlapped (each
    chunk's from its own last backward) it is less; the step's parts add up to it either way."""
    case = CASES["megatron-145.6b"]
    assert case["plan"]["overlap_grad_reduce"] is False
    flush = published.forced(case)
    overlapped = published.forced(dict(case, plan=dict(case["plan"], overlap_grad_reduce=True)))
    for f in (flush, overlapped):
        p = f["parts"]
        assert sum(v for k, v in p.items() if k.endswith("_s") and k != "grad_sync_s") == pytest.approx(f["step_s"])
    assert flush["parts"]["exposed_sync_s"] == flush["parts"]["grad_sync_s"] > 0
    assert overlapped["parts"]["exposed_sync_s"] < 0.5 * overlapped["parts"]["grad_sync_s"]
    assert flush["step_s"] - overlapped["step_s"] == pytest.approx(
        flush["parts"]["exposed_sync_s"] - overlapped["parts"]["exposed_sync_s"], rel=1e-9)
    assert "--overlap-grad-reduce" in overlapped["config"] and "--overlap-grad-reduce" not in flush["config"]


def test_the_command_finds_this_repositorys_newest_record():
    """``reproduce published`` compares with the newest published_reproduce_*.json of the repository's
    reports/records (it once looked one folder above the repository and compared with nothing)."""
    from pathlib import Path
    path = published.latest_record()
    assert path is not None and path.parent == Path(published.__file__).resolve().parents[1] / "reports" / "records"
    assert published.previous_rows(path)
    # by the time it was written, not by name: a stamped record is newer than every one before the stamp (the
    # 2026-11-29 records sort by name out of the order they were made in)
    assert json.loads(path.read_text()).get("recorded")


def test_a_rebaselined_row_is_what_the_case_is_compared_with_and_says_why():
    from autotune.reproduce import rebaselined, recorded_rows
    old = {"id": "pipeline-wide-64", "searched_s": 113.3, "status": "fail"}
    new = {"id": "pipeline-wide-64", "searched_s": 129.5, "status": "fail",
           "rebaseline": {"was_s": 113.3, "reason": "priced a step torch does not run"}}
    prev = [old, new]  # oldest first, as ``recorded_rows`` reads the records
    assert worse_figures([{"id": "pipeline-wide-64", "searched_s": 129.5}], prev[1:]) == []
    assert worse_figures([{"id": "pipeline-wide-64", "searched_s": 131.0}], prev[1:]) == [
        "pipeline-wide-64 129.5 s -> 131 s"]
    assert rebaselined([{"id": "pipeline-wide-64"}], prev) == [
        "pipeline-wide-64 compared with its re-baselined record 129.5 s (was 113.3 s: priced a step torch does not "
        "run)"]
    assert rebaselined([{"id": "other"}], prev) == [] and rebaselined([{"id": "pipeline-wide-64"}], [old]) == []


def test_a_schedule_the_model_lacks_is_a_one_line_error():
    """A published configuration on a schedule the step model does not have names it and the ones it has."""
    case = dict(CASES["llama3-405b-8k"], plan=dict(CASES["llama3-405b-8k"]["plan"], schedule="zero-bubble-v"))
    with pytest.raises(UserError, match="'zero-bubble-v' is not a pipeline schedule: use one of .*interleaved-1f1b"):
        published.run_case(case, with_search=False)


def test_the_free_search_takes_context_parallelism_for_a_long_sequence(monkeypatch):
    """A sequence of LONG_SEQUENCE tokens or more: the free search tries the attention context-parallel over each
    of CONTEXT_CHOICES ranks (the 3-D plans' groups inside their data-parallel ranks) and keeps it where it is
    faster, in Megatron-LM's flags; a shorter sequence is not offered it."""
    small = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 8, "head_dim": 128, "ffn": 2048,
             "vocabulary": 4096, "sequence": 65536, "batch": 8, "micro_batch": 8}
    case = dict(CASES["llama3-405b-cp16"], overrides=small, nodes=4, gpus=8)
    monkeypatch.setattr(techniques, "CONTEXT_CHOICES", (8,))
    with_cp = published.free(case)
    assert "--context-parallel-size 8" in with_cp["plan"]
    short = published.free(dict(case, overrides=dict(small, sequence=8192)))
    assert "--context-parallel-size" not in short["plan"]
    monkeypatch.setattr(techniques, "CONTEXT_CHOICES", ())
    assert with_cp["step_s"] < published.free(case)["step_s"]
