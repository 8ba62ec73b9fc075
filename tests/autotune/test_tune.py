"""``autotune tune`` on gloo (2 processes, a tiny Llama): a planted slow candidate is not returned, the residuals
go into the profile and the next search reads them, and a profile without host figures and a factory that fails
are refused in one line."""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from calibrate.errors import UserError  # noqa: E402
from calibrate.profile import Profile  # noqa: E402

from tests.autotune.gloo_runner import run_on_gloo  # noqa: E402

MODEL = {"kind": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocabulary": 256,
         "sequence": 32, "batch": 8, "micro_batch": 4}
SLOW_S = 0.4
OVERLAP = {"all_reduce": 1.1, "all_gather": 1.1, "reduce_scatter": 1.1, "peer": "nccl"}


def slow_when_sharded(config):
    """The reference Llama, planted slow wherever its parameters are DTensors (FSDP, tensor parallel): of the
    candidates only data parallel on DDP (plain parameters) runs at full speed."""
    from torch.distributed.tensor import DTensor

    from models.modules import build
    model = build(config)
    plain = model.forward

    def forward(ids, targets):
        if any(isinstance(p, DTensor) for p in model.parameters()):
            time.sleep(SLOW_S)
        return plain(ids, targets)
    model.forward = forward
    return model


def _tune(argv):
    """``autotune tune`` on this rank: its refusal's line, or None."""
    from autotune.execute.tunecli import main
    try:
        main(argv)
    except UserError as e:
        return str(e)


def tune(tmp_path, profile, module: str | None = "tests.autotune.test_tune:slow_when_sharded", search=(), model=MODEL):
    path = tmp_path / "model.json"
    path.write_text(json.dumps(model))
    out = tmp_path / "out"
    argv = ["--model", str(path), *(["--module", module] if module else []), "--profile", str(profile),
            "--k", "3", "--steps", "2", "--warmup", "1", "--device", "cpu", "--out", str(out), "--",
            "--budget", "0.3", "--compare", "none", *search]
    ranks = run_on_gloo(_tune, [(argv,)], 2, init=False)
    return out, [error for (error,) in ranks if error is not None]


def test_tune_returns_the_measured_fastest_and_writes_the_residuals_back(tmp_path):
    """The profile's device is the run's (the CPU here), so its residuals are written back; a profile of another
    device keeps none (``test_a_config_json_tunes_on_its_own_transformers_class``)."""
    base = Profile.load("h200-nvlink")
    profile = tmp_path / "profile.json"
    replace(base, compute=replace(base.compute, overlap=OVERLAP), device=replace(base.device, name="CPU")).save(profile)
    out, errors = tune(tmp_path, profile)
    assert not errors
    pf = json.loads((out / "plan.json").read_text())
    rows = pf["meta"]["tune"]["candidates"]
    ran = [r for r in rows if r["status"] == "ok"]
    assert len(ran) >= 2 and {r["kind"] for r in rows} >= {"data parallel", "FSDP"}
    chosen = min(ran, key=lambda r: r["measured_step_s"])
    assert pf["meta"]["tune"]["returned"] == chosen["strategy"] == pf["best"]["strategy"]
    slow = [r for r in ran if r["apply_path"] in ("fully_shard", "dtensor")]  # DTensor parameters: planted slow
    assert slow and all(r["measured_step_s"] > SLOW_S for r in slow)
    assert chosen not in slow
    assert all(r["predicted_step_s"] and r["predicted_bytes"] for r in rows)
    assert "| candidate |" in (out / "tune.md").read_text()
    # the residuals: measured / predicted per path, in the profile the next search reads
    res = Profile.load(profile).residuals
    for path in ("ddp", "fully_shard"):
        ratios = [r["measured_step_s"] / r["predicted_uncorrected_s"] for r in ran if r["apply_path"] == path]
        assert ratios and res.paths[path] == pytest.approx(statistics.median(ratios), rel=1e-6)
    from autotune.cli.search import main as search_main
    from calibrate.residuals import Residuals
    from autotune.plan.hostpace import STEP_MODEL
    p = Profile.load(profile)  # a pipelined candidate's residual, as a tune whose K reached it writes it
    assert res.model == STEP_MODEL  # fitted against this revision of the step model
    p.residuals = Residuals({**res.paths, "pipeline": 1.5}, res.source, res.runs, res.model)
    p.save(profile)
    again = tmp_path / "again"
    assert search_main(["--model", str(tmp_path / "model.json"), "--profile", str(profile), "--nodes", "1",
                        "--gpus-per-node", "2", "--objective", "step", "--budget", "0.3", "--compare", "none",
                        "--out", str(again)]) == 0
    plans = json.loads((again / "plan.json").read_text())
    dp = next(p for p in [plans["best"], *plans["baselines"]] if p["strategy"].startswith("data parallel"))
    assert dp["costs"]["residual"] == pytest.approx(res.paths["ddp"])
    assert dp["costs"]["step_s"] == pytest.approx(dp["costs"]["step_uncorrected_s"] * res.paths["ddp"])
    piped = [p for p in [plans["best"], *plans["baselines"]] if p.get("stages")]
    assert piped and all(p["costs"]["residual"] == 1.5 and p["costs"]["step_s"] == pytest.approx(
        p["costs"]["step_uncorrected_s"] * 1.5) for p in piped)


def test_tune_refuses_a_profile_without_host_figures(tmp_path):
    base = Profile.load("h200-nvlink")
    profile = tmp_path / "bare.json"
    replace(base, compute=replace(base.compute, host_s={}, overlap=OVERLAP)).save(profile)
    out, errors = tune(tmp_path, profile)
    assert len(errors) == 2 and all("host_s" in e and "python -m calibrate compute" in e and "\n" not in e
                                    for e in errors)
    assert not (out / "tune.md").exists()
    # a search option after -- is named as the user spelled it
    replace(base, compute=replace(base.compute, overlap=OVERLAP)).save(profile)
    out, errors = tune(tmp_path, profile, search=("--memory-limit", "0.00001"))
    assert len(errors) == 2 and all(e.startswith("--memory-limit 1e-05 GiB per device: no plan fits") for e in errors)


HF_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 256,
            "max_position_embeddings": 32, "tie_word_embeddings": False}


def test_a_config_json_tunes_on_its_own_transformers_class(tmp_path):
    """With --model config.json and no --module, the candidates run transformers' class of that config (what
    calibrate module timed), not the reference modules; a plan of another shape is refused in one line."""
    from autotune.execute.usermodule import load_factory
    from models.hf import DEFAULT_MODULE, default_module
    base = Profile.load("h200-nvlink")
    profile = tmp_path / "profile.json"
    replace(base, compute=replace(base.compute, overlap=OVERLAP)).save(profile)
    out, errors = tune(tmp_path, profile, None, ("--sequence", "32", "--batch", "8", "--micro-batch", "4"), HF_LLAMA)
    assert not errors
    pf = json.loads((out / "plan.json").read_text())
    assert pf["meta"]["tune"]["module"] == str(tmp_path / "model.json")
    assert sum(r["status"] == "ok" for r in pf["meta"]["tune"]["candidates"]) >= 2
    assert Profile.load(profile).residuals == Profile.load(base.name).residuals  # an H200's: CPU ratios not written
    build = load_factory(default_module(str(tmp_path / "model.json")))
    stage = build(dict(pf["best"]["model"], layers=1))
    assert type(stage).__name__ == "LlamaForCausalLM" and stage.config.num_hidden_layers == 1
    with pytest.raises(UserError, match=r"^the plan's model is not .*model.json's: hidden 128 \(config.json: 64\)"):
        build(dict(pf["best"]["model"], hidden=128))
    (tmp_path / "mine.json").write_text(json.dumps(MODEL))
    assert default_module(str(tmp_path / "mine.json")) == DEFAULT_MODULE == default_module("llama")


def failing_factory(config):
    raise RuntimeError("no such layer")


def test_a_failing_factory_stops_tune_in_one_line(tmp_path):
    """The factory's error is the same for every candidate: the first one's stops the command, naming the fix,
    instead of every candidate failing and "no candidate ran ... try a smaller micro-batch"."""
    base = Profile.load("h200-nvlink")
    profile = tmp_path / "profile.json"
    replace(base, compute=replace(base.compute, overlap=OVERLAP)).save(profile)
    out, errors = tune(tmp_path, profile, "tests.autotune.test_tune:failing_factory")
    assert len(errors) == 2 and all(e.startswith("tests.autotune.test_tune:failing_factory(config) raised "
                                                 "RuntimeError: no such layer") and "make it build" in e
                                    for e in errors), errors
    assert not (out / "tune.md").exists()


def _tune_stopped_at_the_second(argv):
    """``autotune tune``'s exit code on this rank, its second candidate stopped on every rank by a SIGTERM (what
    ``timeout`` sends torchrun, and torchrun its workers)."""
    import os
    import signal

    import autotune.execute.tune as tune_module
    from autotune.execute.tunecli import main
    run, calls = tune_module.run_candidate, []

    def stopping(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler raises in here
        return run(*a, **k)
    tune_module.run_candidate = stopping
    return main(argv)


def test_a_tune_stopped_part_way_keeps_the_candidates_it_ran(tmp_path):
    """tune.md is written after each candidate; stopped by a SIGTERM in the second, the command writes plan.json
    with the first (the measured fastest of those run), says it was interrupted, and exits 130 on every rank."""
    base = Profile.load("h200-nvlink")
    profile = tmp_path / "profile.json"
    replace(base, compute=replace(base.compute, overlap=OVERLAP)).save(profile)
    argv = ["--model", "llama", "--module", "models.modules:build", "--profile", str(profile), "--k", "3", "--steps",
            "2", "--warmup", "1", "--device", "cpu", "--out", str(tmp_path / "out"), "--", "--budget", "0.3",
            "--compare", "none", *[f"--{k.replace('_', '-')}={v}" for k, v in MODEL.items() if k != "kind"]]
    assert [r for (r,) in run_on_gloo(_tune_stopped_at_the_second, [(argv,)], 2, init=False)] == [130] * 2
    md = (tmp_path / "out" / "tune.md").read_text()
    assert md.startswith("# autotune tune (interrupted after 1 of 3 candidates)")
    rows = [line for line in md.splitlines() if line.startswith("| ") and "candidate |" not in line and "---" not in line]
    assert len(rows) == 1 and float(rows[0].split(" | ")[4]) > 0  # its measured ms
    pf = json.loads((tmp_path / "out" / "plan.json").read_text())
    (ran,) = pf["meta"]["tune"]["candidates"]
    assert pf["meta"]["tune"]["interrupted"] == "interrupted after 1 of 3 candidates"
    assert pf["best"]["strategy"] == ran["strategy"] == pf["meta"]["tune"]["returned"]
    from reports.sections.sbp import build  # the report shows the candidates measured, as tune.md does
    page = "".join(build([tmp_path / "out" / "plan.json"])[0].blocks)
    assert "Measured by autotune tune" in page and "interrupted after 1 of 3 candidates: of those run" in page
    assert f"{ran['measured_step_s'] * 1e3:.2f}" in page and "(returned)" in page


def tied_llama(config):
    """transformers' Llama with its embedding and head tied (what to_empty unties)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    c = config
    return LlamaForCausalLM(LlamaConfig(vocab_size=c["vocabulary"], hidden_size=c["hidden"], intermediate_size=c["ffn"],
                                        num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                                        num_key_value_heads=c["kv_heads"], tie_word_embeddings=True))


def meta_refusing(config):
    """The reference Llama, built by a factory that reads a value (impossible on the meta device)."""
    from models.modules import build
    float(torch.ones(1).sum())
    return build(config)


@pytest.mark.parametrize("spec", ["tests.autotune.test_tune:tied_llama", "tests.autotune.test_tune:meta_refusing",
                                  "tests.autotune.test_tune:slow_when_sharded"])
def test_tune_builds_the_model_once_and_gives_each_candidate_the_same_fresh_model(spec):
    """``BuildOnce``: every candidate's model holds the first build's values in tensors of its own, the ties of
    the first build (the head tied to the embedding again), its non-persistent buffers, whatever the candidate's
    micro-batches; a factory that cannot
    build on the meta device, or a host without room for the copy, builds each time (the same values)."""
    pytest.importorskip("transformers")
    from autotune.execute.moduletrain import BuildOnce, _filled, build_module
    fresh = build_module(spec, MODEL, 0, torch.float32, "cpu")
    for room in (2**40, 0):
        once = BuildOnce(2, available=lambda: room, init="cpu" if room else None)  # init: the first build's device
        # the third a pipelined candidate's config: the same model, other micro-batches (the same copy)
        models = [once(spec, config, 0, torch.float32, "cpu") for config in (MODEL, MODEL, dict(MODEL, micro_batch=1))]
        assert len(once.kept) == (room > 0)
        for m in models:
            got = [*m.named_parameters(remove_duplicate=False), *m.named_buffers(remove_duplicate=False)]
            want = [*fresh.named_parameters(remove_duplicate=False), *fresh.named_buffers(remove_duplicate=False)]
            assert [n for n, _ in got] == [n for n, _ in want]
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want))
        assert len({id(p) for m in models for p in m.parameters()}) == 3 * len(list(fresh.parameters()))
        if spec.endswith("tied_llama"):
            assert all(m.lm_head.weight is m.model.embed_tokens.weight for m in models)
        if room:  # the later ones filled from the copy, but for the factory the meta device refuses
            assert (_filled(spec, MODEL, torch.float32, *once.kept.values()) is None) == spec.endswith("refusing")


def test_a_pipelined_candidates_memory_is_its_worst_stages():
    """Each stage's prediction beside the peak of its own ranks (the largest over them), and the row's the stage
    farthest off: not the largest prediction beside the largest measurement, which can be two stages."""
    from types import SimpleNamespace as NS

    from autotune.execute.tune import stage_memory, tune_table
    from autotune.sbp.mesh import Cluster
    two = NS(cluster=Cluster(1, 2), stages=[NS(memory_bytes=50.0, plan=NS(cluster=Cluster(1, 1))),
                                            NS(memory_bytes=45.0, plan=NS(cluster=Cluster(1, 1)))])
    assert stage_memory(two, [51.0, 55.0]) == {"stage_bytes": [[50.0, 51.0], [45.0, 55.0]], "predicted_bytes": 45.0,
                                              "measured_bytes": 55.0}
    four = NS(cluster=Cluster(1, 4), stages=[NS(memory_bytes=10.0, plan=NS(cluster=Cluster(1, 2))),
                                             NS(memory_bytes=20.0, plan=NS(cluster=Cluster(1, 2)))])
    got = stage_memory(four, [9.0, 12.0, 20.0, 19.0])
    assert got["stage_bytes"] == [[10.0, 12.0], [20.0, 20.0]] and got["measured_bytes"] == 12.0
    assert stage_memory(four, [9.0, 12.0]) == {}  # fewer peaks than ranks: nothing said
    from autotune.execute.result import stage_peaks
    assert stage_peaks([1.0, 2.0], [1.0, 2.0, 3.0]) is None  # ranks that do not divide into the stages
    row = dict(strategy="p", kind="pipelined", status="ok", predicted_step_s=1.0, measured_step_s=1.0, **got)
    assert "the stage whose measured peak" in tune_table([row], row)


def test_the_table_gives_tau_with_how_close_the_measured_steps_are():
    """Kendall's tau beside the spread of the measured steps: four candidates within 1.9% of each other (Llama 3
    8B's shape on 2 x H200) order by less than the predictions' errors."""
    from autotune.execute.tune import tune_table
    rows = [dict(strategy=n, kind="k", status="ok", predicted_step_s=p, measured_step_s=m)
            for n, p, m in (("a", 17.20, 18.41), ("b", 17.32, 18.23), ("c", 17.55, 18.06), ("d", 18.22, 18.20))]
    assert tune_table(rows, rows[2]).endswith("Kendall tau of the predicted against the measured order: -0.67 over "
                                              "4 plans (their measured steps within 1.9% of the fastest)")


def test_the_table_says_which_pairs_the_runs_own_noise_cannot_order():
    """Held-out Qwen2.5 7B's four candidates on 2 x H200 (session 33, timed steps in s): three pairs are measured
    apart by more than half of each one's range of timed steps, added (the searched plan against each other, all
    out of the predicted order), the other three are ties at that noise; with a single timed step per row,
    nothing is said."""
    from autotune.execute.tune import tune_notes
    rows = [dict(strategy=n, kind="k", status="ok", predicted_step_s=p, measured_step_s=m, measured_steps_s=t)
            for n, p, m, t in (("searched", 15.717, 16.4786, [16.4441, 16.4803, 16.4786]),
                               ("FSDP", 15.845, 16.1938, [16.0897, 16.1938, 16.2028]),
                               ("pipelined", 15.989, 16.0847, [15.9589, 16.0847, 16.2268]),
                               ("Megatron", 16.112, 16.2101, [16.2103, 15.8548, 16.3001]))]
    assert tune_notes(rows)[-1] == ("Of its 6 pairs, 3 are measured apart by more than their own steps' spread (half "
                                    "the range of each one's timed steps, added): tau over those -1.00; the others "
                                    "are ties at this run's noise")
    assert "Of its" not in tune_notes([dict(r, measured_steps_s=[r["measured_step_s"]]) for r in rows])[-1]


def test_a_run_whose_allocator_retried_says_so_in_its_row_and_its_record_is_checked(tmp_path):
    """The caching allocator's retries (each frees its cache and synchronises the device) go into the row's note, where
    a step slower than priced may come from them; none, no note; a record with a malformed figure is refused."""
    from autotune.execute import result
    from autotune.execute.tune import allocator_row
    row = allocator_row({"allocator": {"retries": 3, "reserved_bytes": 2**30}})
    assert row["alloc_retries"] == 3 and row["note"].startswith("the allocator retried 3 times")
    assert allocator_row({"allocator": {"retries": 0, "reserved_bytes": 1}}) == allocator_row({"allocator": None}) == {}
    rec = {"kind": result.KIND, "version": result.VERSION, "strategy": "s", "model": {}, "cluster": {}, "device": "H200",
           "backend": "nccl", "dtype": "bfloat16", "predicted": {},
           "measured": {"step_s": 1.0, "losses": [1.0], "allocator": {"retries": 3, "reserved_bytes": 2**30}}}
    result.write_record(tmp_path, 0, rec)
    assert result.load_records(tmp_path)[0]["measured"]["allocator"]["retries"] == 3
    rec["measured"]["allocator"] = {"retries": -1, "reserved_bytes": 0}
    result.write_record(tmp_path, 0, rec)
    with pytest.raises(UserError, match="measured/allocator"):
        result.load_records(tmp_path)


def test_candidates_take_the_primary_kinds_before_per_layer_placements():
    """K = 4 after a data-parallel searched plan: FSDP, tensor parallel and pipelined, each its fastest predicted
    that fits, before a per-layer (SUMMA) plan predicted faster than all of them; with K = 5 that one too."""
    from types import SimpleNamespace

    from autotune.execute.tune import candidates

    def plan(name, path, step, fits=True, stages=()):
        return SimpleNamespace(strategy=name, apply_path=path, stages=stages, layer=lambda name: None,
                               costs=SimpleNamespace(step_s=step, fits_memory=fits))
    best = plan("searched", "ddp", 1.0)
    others = [plan("SUMMA", "dtensor", 1.1), plan("Megatron SP", "tensor", 1.6), plan("Megatron", "tensor", 1.5),
              plan("FSDP big", "fully_shard", 1.05, fits=False), plan("FSDP", "fully_shard", 1.2),
              plan("pipelined", "", 1.4, stages=(1, 2)), plan("data parallel", "ddp", 1.0)]
    assert [c.strategy for c in candidates(best, others, 4)] == ["searched", "FSDP", "pipelined", "Megatron"]
    assert [c.strategy for c in candidates(best, others, 5)][-1] == "SUMMA"


def test_a_model_it_cannot_read_is_refused_before_the_devices_start(monkeypatch, tmp_path):
    import autotune.execute.env as env
    from autotune.execute.tunecli import main
    monkeypatch.setattr(env, "start", lambda *a: pytest.fail("the devices started"))
    for model, line in (("nosuch.json", "model file 'nosuch.json' does not exist: give a JSON file or one of gpt"),
                        ("llamaa", "unknown model 'llamaa': use one of gpt")):
        with pytest.raises(UserError, match=f"^{line}"):
            main(["--model", model, "--out", str(tmp_path / "out")])
