"""Helpers of the in-process bad-record suite (test_bad_records.py): a real results directory
written through the project's own writer, broken copies of records, and one command run
in this process through its package's ``main(argv)``, its output captured."""
from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib
import io
import json
import math
import time
import traceback
from pathlib import Path

import numpy as np

from calibrate.collectives import Collective, busbw_factor, ring_coefficients
from calibrate.records import header
from calibrate.results import KIND, VERSION, ResultsDir
from calibrate.measure.stats import summarize

ROOT = Path(__file__).resolve().parents[2]
MAINS = {"calibrate": "calibrate.__main__:main", "autotune": "autotune.__main__:main",
         "kernels": "kernels.__main__:main", "reports": "reports.__main__:main"}
ALPHA, BETA = 5e-6, 1e-10        # the closed form the synthetic directory is measured on
SIZES = [1 << k for k in range(10, 23)]


def make_results(path: Path, collectives=("allreduce", "allgather"), ranks: int = 2) -> Path:
    """A results directory of ``ranks`` ranks on one node, written by ``ResultsDir`` as ``calibrate run``
    writes one, each size's samples the alpha-beta time of ``ALPHA``, ``BETA`` with 1% spread."""
    rng = np.random.default_rng(7)
    label = f"world:{ranks}x1"
    meta = {**header(KIND, VERSION), "created": "2026-11-25T00:00:00", "command": "synthetic",
            "config": {"backend": "mpi", "mode": "host", "dtype": "float32", "iters": 2, "warmup": 1, "reps": 5,
                       "min_batch_s": 0.001, "world_size": ranks, "hosts": ["h"], "collectives": list(collectives),
                       "sizes": SIZES, "groups": ["world"], "phase": "sweep"},
            "ranks": [{"rank": r, "host": "h", "device": None, "cores": [r]} for r in range(ranks)],
            "nodes": 1, "env": {}}
    rd = ResultsDir(path)
    rd.prepare(meta, resume=False)
    for name in collectives:
        coll = Collective.parse(name)
        a, b = ring_coefficients(coll, ranks)
        for n in SIZES:
            t = (a * ALPHA + b * n * BETA) * (1 + 0.01 * rng.standard_normal(5))
            st = summarize(t)
            base = {"group": label, "tier": "intra", "ranks": ranks, "nodes": 1, "collective": name, "mode": "host",
                    "dtype": "float32", "bytes": n, "count": n // 4}
            algbw = n / st["median_s"] / 1e9
            rd.append([dict(base, rep=i, time_s=float(x)) for i, x in enumerate(t)],
                      dict(base, **st, algbw_GBps=algbw, busbw_GBps=algbw * busbw_factor(coll, ranks), wrong=0),
                      {"group": label, "collective": name, "bytes": n, "phase": "sweep", "wall_s": 0.01})
    rd.close()
    return path


def run_main(argv: list[str]) -> tuple[int, str, float, str]:
    """(exit status, stdout and stderr, CPU seconds, traceback or "") of ``python -m argv...`` run in this
    process through the package's main (``reports`` through ``run_cli``, as its ``__main__`` does)."""
    from calibrate.cli import run_cli

    module, func = MAINS[argv[0]].split(":")
    main = getattr(importlib.import_module(module), func)
    out = io.StringIO()
    t0 = time.process_time()
    tb = ""
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            rc = run_cli(main, argv[1:], prog="reports") if argv[0] == "reports" else main(argv[1:])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001  (what the test reports as a traceback)
            rc, tb = -1, traceback.format_exc()
    return rc, out.getvalue(), time.process_time() - t0, tb


def digest(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` -> its SHA-256."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- broken profiles: (name, mutation of a parsed embedded profile, what the error names) ----------------
def _segs(d):
    return [s for tier in d["tiers"].values() for models in tier.values() for m in models.values()
            for s in m["segments"]]


def _first_model(d):
    return next(iter(next(iter(d["tiers"].values())).values()))


def _first_seg(d):
    return _segs(d)[0]


def _set(getter, key, value):
    def mutate(d):
        getter(d)[key] = value
    return mutate


def _drop(getter, key):
    def mutate(d):
        del getter(d)[key]
    return mutate


def _all_segs(key, value):
    def mutate(d):
        for s in _segs(d):
            s[key] = value
    return mutate


def _text(text):
    return lambda d: text


def _first_p(d):
    return next(iter(_first_model(d).values()))


PROFILE_CASES = [
    ("drop-kind", _drop(lambda d: d, "kind"), "not a commtune profile|kind"),
    ("drop-version", _drop(lambda d: d, "version"), "version"),
    ("version-99", _set(lambda d: d, "version", 99), "version"),
    ("version-text", _set(lambda d: d, "version", "2"), "version"),
    ("kind-other", _set(lambda d: d, "kind", "commtune.sbp-plan"), "kind"),
    ("drop-name", _drop(lambda d: d, "name"), "name"),
    ("drop-provenance", _drop(lambda d: d, "provenance"), "provenance"),
    ("drop-tiers", _drop(lambda d: d, "tiers"), "tiers"),
    ("name-number", _set(lambda d: d, "name", 3), "name"),
    ("name-dict", _set(lambda d: d, "name", {"a": 1}), "name"),
    ("provenance-text", _set(lambda d: d, "provenance", "measured"), "provenance"),
    ("provenance-list", _set(lambda d: d, "provenance", []), "provenance"),
    ("hardware-text", _set(lambda d: d, "hardware", "H200"), "hardware"),
    ("software-list", _set(lambda d: d, "software", [1]), "software"),
    ("timing-mode-number", _set(lambda d: d, "timing_mode", 5), "timing_mode"),
    ("tiers-text", _set(lambda d: d, "tiers", "intra"), "tiers"),
    ("tiers-list", _set(lambda d: d, "tiers", []), "tiers"),
    ("tier-text", _set(lambda d: d["tiers"], "intra", "x"), "tiers"),
    ("tier-unknown", _set(lambda d: d["tiers"], "orbit", {}), "orbit"),
    ("collective-unknown", _set(lambda d: next(iter(d["tiers"].values())), "allreduse", {}), "allreduse"),
    ("collective-list", _set(lambda d: next(iter(d["tiers"].values())), "allreduce", []), "tiers"),
    ("group-size-text", _set(_first_model, "two", {"segments": []}), "group size"),
    ("group-size-one", _set(_first_model, "1", {"segments": []}), "group size"),
    ("model-text", _set(_first_model, "2", "segments"), "tiers|model"),
    ("segments-text", _set(_first_p, "segments", "x"), "segments"),
    ("segments-empty", _set(_first_p, "segments", []), "no segments"),
    ("segment-text", _set(_first_p, "segments", ["x"]), "segment"),
    ("segment-missing-alpha", _drop(_first_seg, "alpha"), "segment needs"),
    ("segment-missing-max", _drop(_first_seg, "max_bytes"), "segment needs"),
    ("segment-extra-key", _set(_first_seg, "gamma", 1), "segment needs"),
    ("alpha-text", _set(_first_seg, "alpha", "fast"), "alpha"),
    ("beta-text", _set(_first_seg, "beta", "wide"), "beta"),
    ("alpha-bool", _set(_first_seg, "alpha", True), "alpha"),
    ("alpha-null", _set(_first_seg, "alpha", None), "alpha"),
    ("alpha-list", _set(_first_seg, "alpha", [1e-6]), "alpha"),
    ("alpha-nan", _set(_first_seg, "alpha", math.nan), "alpha"),
    ("alpha-inf", _set(_first_seg, "alpha", math.inf), "alpha"),
    ("beta-nan", _set(_first_seg, "beta", math.nan), "beta"),
    ("beta-minus-inf", _set(_first_seg, "beta", -math.inf), "beta"),
    ("alpha-negative", _set(_first_seg, "alpha", -1e-6), "alpha"),
    ("beta-negative", _set(_first_seg, "beta", -1e-12), "beta"),
    ("alpha-1e300", _set(_first_seg, "alpha", 1e300), "alpha"),
    ("beta-huge", _set(_first_seg, "beta", 5.0), "beta"),
    ("alpha-beta-zero", lambda d: (_first_seg(d).update(alpha=0, beta=0)), "not both 0"),
    ("all-alpha-beta-zero", lambda d: [s.update(alpha=0.0, beta=0.0) for s in _segs(d)], "not both 0"),
    ("min-above-max", lambda d: _first_seg(d).update(min_bytes=1e6, max_bytes=10), "min_bytes < max_bytes"),
    ("min-equals-max", lambda d: _first_seg(d).update(min_bytes=64, max_bytes=64), "min_bytes < max_bytes"),
    ("min-negative", _set(_first_seg, "min_bytes", -5), "min_bytes"),
    ("max-inf", _all_segs("max_bytes", math.inf), "max_bytes"),
    ("max-beyond-2-62", _all_segs("max_bytes", 1e30), "2\\*\\*62"),
    ("max-text", _set(_first_seg, "max_bytes", "big"), "max_bytes"),
    ("segments-overlap", lambda d: _first_p(d).update(segments=[
        {"min_bytes": 0, "max_bytes": 1 << 20, "alpha": 1e-6, "beta": 1e-10},
        {"min_bytes": 1 << 10, "max_bytes": 2 ** 62, "alpha": 1e-6, "beta": 1e-10}]), "overlap"),
    ("fit-text", _set(_first_seg, "fit", "good"), "fit"),
    ("fit-last-zero", _set(_first_seg, "fit", {"first_bytes": 1024, "last_bytes": 0}), "last_bytes"),
    ("fit-first-zero", _set(_first_seg, "fit", {"first_bytes": 0, "last_bytes": 1024}), "first_bytes"),
    ("fit-last-text", _set(_first_seg, "fit", {"last_bytes": "end"}), "last_bytes"),
    ("fit-first-above-last", _set(_first_seg, "fit", {"first_bytes": 1 << 20, "last_bytes": 1024}), "first_bytes"),
    ("points-text", _set(_first_p, "points", "many"), "points"),
    ("points-triples", _set(_first_p, "points", [[1, 2, 3]]), "points"),
    ("points-nan", _set(_first_p, "points", [[1024, math.nan]]), "points"),
    ("points-negative", _set(_first_p, "points", [[1024, -1e-6]]), "points"),
    ("validation-text", _set(_first_p, "validation", "fine"), "validation"),
    ("method-unknown", _set(_first_p, "method", "magic"), "method"),
    ("switches-text", _set(_first_p, "switches", "none"), "switches"),
    ("switches-numbers", _set(_first_p, "switches", [1, 2]), "switches"),
    ("whole-list", _text("[1, 2, 3]"), "not a commtune profile|kind"),
    ("whole-string", _text('"profile"'), "not a commtune profile|kind"),
    ("whole-null", _text("null"), "not a commtune profile|kind"),
    ("whole-number", _text("42"), "not a commtune profile|kind"),
    ("empty-file", _text(""), "not valid JSON"),
    ("compute-launch-nan", _set(lambda d: d["compute"], "launch_s", math.nan), "launch_s nan"),
    ("compute-memory-inf", _set(lambda d: d["compute"], "memory_Bps", math.inf), "memory_Bps inf"),
    ("compute-peak-nan", _set(lambda d: d["compute"]["matmul"]["2"], "peak_flops", math.nan), "peak_flops"),
    ("compute-peak-inf", _set(lambda d: d["compute"]["attention"]["4"], "peak_flops", math.inf), "peak_flops"),
    ("compute-op-inf", _set(lambda d: d["compute"], "op_Bps", {"elementwise": math.inf}), "op_Bps"),
    ("compute-matmul-list", _set(lambda d: d["compute"], "matmul", [1, 2]), r"compute section matmul is '\[1, 2\]'"),
    ("compute-attention-text", _set(lambda d: d["compute"], "attention", "fast"), "compute section attention is 'fast'"),
    ("compute-matmul-key", _set(lambda d: d["compute"]["matmul"], "fp16", {"peak_flops": 1e15}),
     "matmul has the key 'fp16', not an element size"),
    ("compute-points-number", _set(lambda d: d["compute"]["matmul"]["2"], "points", 5), "has points 5, not a list"),
    ("truncated", lambda d: json.dumps(d)[:200], "not valid JSON"),
    ("binary", lambda d: b"\x89PNG\r\n\x1a\n\x00\xff\xfe" * 40, "not valid JSON|not text"),
    ("utf16-garbage", lambda d: "\ufeff{".encode("utf-16"), "not valid JSON|not text"),
]


def broken_profile(base: dict, mutate) -> str | bytes:
    """The text of a copy of ``base`` after ``mutate`` (which edits it in place or returns the text)."""
    d = copy.deepcopy(base)
    out = mutate(d)
    if isinstance(out, (str, bytes)):
        return out
    return json.dumps(d)  # NaN and Infinity as Python's json writes them: what a careless writer leaves


# ---- broken results directories: (name, edit of a copy, what the error names) --------------------------
def _meta_edit(edit):
    def mutate(folder: Path):
        meta = json.loads((folder / "meta.json").read_text())
        edit(meta)
        (folder / "meta.json").write_text(json.dumps(meta))
    return mutate


def _write(name, data):
    def mutate(folder: Path):
        p = folder / name
        if p.is_dir():
            p.rmdir()
        (p.write_bytes if isinstance(data, bytes) else p.write_text)(data)
    return mutate


def _csv_edit(name, edit):
    def mutate(folder: Path):
        lines = (folder / name).read_text().splitlines(keepends=True)
        (folder / name).write_text("".join(edit(lines)))
    return mutate


def _cell(name, column, value, row=1):
    def edit(lines):
        cols = lines[0].rstrip("\r\n").split(",")
        cells = lines[row].rstrip("\r\n").split(",")
        cells[cols.index(column)] = value
        return lines[:row] + [",".join(cells) + "\r\n"] + lines[row + 1:]
    return _csv_edit(name, edit)


def _replace_by_dir(name):
    def mutate(folder: Path):
        (folder / name).unlink()
        (folder / name).mkdir()
    return mutate


def _remove(name):
    return lambda folder: (folder / name).unlink()


RESULTS_CASES = [
    ("meta-missing", _remove("meta.json"), "meta.json"),
    ("meta-dir", _replace_by_dir("meta.json"), "meta.json"),
    ("meta-empty", _write("meta.json", ""), "meta.json|JSON"),
    ("meta-binary", _write("meta.json", bytes(range(256)) * 4), "meta.json|JSON|not text"),
    ("meta-truncated", lambda f: (f / "meta.json").write_text((f / "meta.json").read_text()[:50]), "JSON"),
    ("meta-list", _write("meta.json", "[]"), "calibration|kind"),
    ("meta-string", _write("meta.json", '"calibration"'), "calibration|kind"),
    ("meta-wrong-kind", _meta_edit(lambda m: m.update(kind="commtune.profile")), "calibration|kind"),
    ("meta-no-kind", _meta_edit(lambda m: m.pop("kind")), "calibration|kind"),
    ("meta-version", _meta_edit(lambda m: m.update(version=7)), "version"),
    ("meta-config-text", _meta_edit(lambda m: m.update(config="host")), "config"),
    ("meta-config-missing", _meta_edit(lambda m: m.pop("config")), "config"),
    ("meta-world-text", _meta_edit(lambda m: m["config"].update(world_size="two")), "world_size"),
    ("meta-world-zero", _meta_edit(lambda m: m["config"].update(world_size=0)), "world_size"),
    ("meta-collectives-text", _meta_edit(lambda m: m["config"].update(collectives="allreduce")), "collectives"),
    ("meta-min-batch-nan", _meta_edit(lambda m: m["config"].update(min_batch_s=math.nan)), "min_batch_s"),
    ("meta-iters-float", _meta_edit(lambda m: m["config"].update(iters=2.5)), "iters"),
    ("meta-ranks-text", _meta_edit(lambda m: m.update(ranks="all")), "ranks"),
    ("meta-ranks-numbers", _meta_edit(lambda m: m.update(ranks=[0, 1])), "ranks"),
    ("meta-env-list", _meta_edit(lambda m: m.update(env=[])), "env"),
    ("stats-missing", _remove("stats.csv"), "stats.csv"),
    ("stats-dir", _replace_by_dir("stats.csv"), "stats.csv"),
    ("stats-empty", _write("stats.csv", ""), "stats.csv"),
    ("stats-binary", _write("stats.csv", bytes(range(256)) * 8), "stats.csv"),
    ("stats-header-only", _csv_edit("stats.csv", lambda ls: ls[:1]), "no measurements"),
    ("stats-wrong-header", _csv_edit("stats.csv", lambda ls: ["a,b,c\r\n"] + ls[1:]), "stats.csv"),
    ("stats-torn-row", _csv_edit("stats.csv", lambda ls: ls[:-1] + [ls[-1][:15]]), "stats.csv"),
    ("stats-bytes-text", _cell("stats.csv", "bytes", "lots"), "bytes"),
    ("stats-bytes-zero", _cell("stats.csv", "bytes", "0"), "bytes"),
    ("stats-bytes-negative", _cell("stats.csv", "bytes", "-1024"), "bytes"),
    ("stats-median-text", _cell("stats.csv", "median_s", "fast"), "median_s"),
    ("stats-median-nan", _cell("stats.csv", "median_s", "nan"), "median_s|torn"),
    ("stats-median-inf", _cell("stats.csv", "median_s", "inf"), "median_s"),
    ("stats-median-zero", _cell("stats.csv", "median_s", "0"), "median_s"),
    ("stats-median-negative", _cell("stats.csv", "median_s", "-1e-5"), "median_s"),
    ("stats-ci-text", _cell("stats.csv", "ci_lo_s", "low"), "ci_lo_s"),
    ("stats-ranks-text", _cell("stats.csv", "ranks", "two"), "ranks"),
    ("stats-n-zero", _cell("stats.csv", "n", "0"), "n must|median_s and n"),
    ("stats-collective-unknown", _cell("stats.csv", "collective", "allreduse"), "allreduse"),
    ("stats-tier-unknown", _cell("stats.csv", "tier", "orbit"), "orbit|tier"),
]


# ---- broken plans (plan.json of the SBP search) ---------------------------------------------------------
def _best(d):
    return d["best"]


def _layer0(d):
    return d["best"]["layers"][0]


def _costs(d):
    return d["best"]["costs"]


PLAN_CASES = [
    ("no-best", _drop(lambda d: d, "best"), "best: NoneType is not an object"),
    ("best-text", _set(lambda d: d, "best", "fast"), "best: str is not"),
    ("best-list", _set(lambda d: d, "best", []), "best: list is not"),
    ("baselines-dict", _set(lambda d: d, "baselines", {}), "baselines"),
    ("baseline-text", lambda d: d["baselines"].append("dp"), "baseline \\d+"),
    ("traces-list", _set(lambda d: d, "traces", []), "traces"),
    ("meta-text", _set(lambda d: d, "meta", "x"), "meta"),
    ("plan-kind", _set(lambda d: d, "kind", "commtune.profile"), "kind"),
    ("plan-version", _set(lambda d: d, "version", 1), "version 1.*re-run python -m autotune --out DIR"),
    ("strategy-number", _set(_best, "strategy", 1), "strategy"),
    ("model-text", _set(_best, "model", "gpt"), "model"),
    ("model-batch-zero", _set(lambda d: d["best"]["model"], "batch", 0), "model.batch"),
    ("model-micro-batch-text", _set(lambda d: d["best"]["model"], "micro_batch", "8"), "model.micro_batch"),
    ("model-layers-float", _set(lambda d: d["best"]["model"], "layers", 2.5), "model.layers"),
    ("model-kind-missing", _drop(lambda d: d["best"]["model"], "kind"), "model.kind"),
    ("cluster-missing", _drop(_best, "cluster"), "cluster"),
    ("cluster-nodes-zero", _set(lambda d: d["best"]["cluster"], "nodes", 0), "nodes"),
    ("cluster-nodes-text", _set(lambda d: d["best"]["cluster"], "nodes", "4"), "nodes"),
    ("cluster-gpus-float", _set(lambda d: d["best"]["cluster"], "gpus_per_node", 8.5), "gpus_per_node"),
    ("micro-batches-zero", _set(_best, "micro_batches", 0), "micro_batches"),
    ("memory-limit-inf", _set(_best, "memory_limit_bytes", math.inf), "memory_limit_bytes"),
    ("memory-limit-negative", _set(_best, "memory_limit_bytes", -1), "memory_limit_bytes"),
    ("search-text", _set(_best, "search", "cd"), "search"),
    ("apply-path-unknown", _set(_best, "apply_path", "magic"), "apply_path"),
    ("costs-missing", _drop(_best, "costs"), "costs"),
    ("costs-text", _set(_best, "costs", "fast"), "costs"),
    ("total-missing", _drop(_costs, "total_s"), "total_s"),
    ("total-nan", _set(_costs, "total_s", math.nan), "total_s"),
    ("total-inf", _set(_costs, "total_s", math.inf), "total_s"),
    ("total-negative", _set(_costs, "total_s", -1.0), "total_s"),
    ("total-text", _set(_costs, "grad_sync_s", "slow"), "grad_sync_s"),
    ("fits-text", _set(_costs, "fits_memory", "yes"), "fits_memory"),
    ("fits-missing", _drop(_costs, "fits_memory"), "fits_memory"),
    ("memory-text", _set(_costs, "memory", "lots"), "memory"),
    ("layers-missing", _drop(_best, "layers"), "layers"),
    ("layers-empty", _set(_best, "layers", []), "layers.*empty"),
    ("layers-dict", _set(_best, "layers", {}), "layers"),
    ("layer-text", lambda d: d["best"]["layers"].__setitem__(0, "ln"), "layer 0"),
    ("layer-name-missing", _drop(_layer0, "name"), "name"),
    ("layer-count-zero", _set(_layer0, "count", 0), "count"),
    ("layer-input-long", lambda d: _layer0(d)["output"].append("B"), "placements for a mesh of"),
    ("layer-input-unknown", lambda d: _layer0(d).update(output=["X"] * len(_layer0(d)["output"])), "placement 'X'"),
    ("layer-collectives-text", _set(_layer0, "collectives", "ring"), "collectives"),
    ("layer-cost-nan", lambda d: _layer0(d)["costs"].update(grad_sync_s=math.nan), "grad_sync_s"),
    ("layer-memory-negative", lambda d: _layer0(d)["costs"].update(memory_bytes=-5), "memory_bytes"),
    ("baseline-total-nan", lambda d: d["baselines"][0]["costs"].update(total_s=math.nan), "baseline 0"),
    ("baseline-mesh-15", lambda d: d["baselines"][0]["mesh"].update(sizes=[15]), "baseline 0"),
    ("plan-whole-list", _text("[]"), "not a|kind"),
    ("plan-empty", _text(""), "not valid JSON"),
    ("plan-truncated", lambda d: json.dumps(d)[:300], "not valid JSON"),
    ("plan-binary", lambda d: bytes(range(256)) * 3, "not valid JSON|not text"),
]


# ---- broken execute results (execute-*.json of python -m autotune execute) ---------------------------
def execute_record(name: str, step: float) -> dict:
    """A result record as python -m autotune execute writes one."""
    return {"kind": "commtune.execute-result", "version": 1, "strategy": name, "model": {"name": "gpt"},
            "cluster": {"nodes": 1, "gpus_per_node": 2}, "device": "cpu", "backend": "gloo", "dtype": "float64",
            "predicted": {"step_s": step, "total_s": step / 10, "memory_bytes": 1e9},
            "measured": {"step_s": step * 1.05, "comm_alone_s": step / 9, "comm_s": step / 5,
                         "peak_memory_bytes": [1.1e9, 1.0e9], "losses": [2.0, 1.5]}}


def _measured(d):
    return d["measured"]


EXECUTE_CASES = [
    ("no-strategy", _drop(lambda d: d, "strategy"), "strategy"),
    ("strategy-list", _set(lambda d: d, "strategy", ["a"]), "strategy"),
    ("wrong-kind", _set(lambda d: d, "kind", "commtune.sbp-plan"), "kind"),
    ("version-2", _set(lambda d: d, "version", 2), "version"),
    ("no-measured", _drop(lambda d: d, "measured"), "measured"),
    ("measured-text", _set(lambda d: d, "measured", "fast"), "measured"),
    ("step-missing", _drop(_measured, "step_s"), "step_s"),
    ("step-text", _set(_measured, "step_s", "1 s"), "step_s"),
    ("step-zero", _set(_measured, "step_s", 0), "step_s"),
    ("step-nan", _set(_measured, "step_s", math.nan), "step_s"),
    ("step-inf", _set(_measured, "step_s", math.inf), "step_s"),
    ("losses-missing", _drop(_measured, "losses"), "losses"),
    ("losses-empty", _set(_measured, "losses", []), "losses"),
    ("losses-nan", _set(_measured, "losses", [2.0, math.nan]), "losses"),
    ("losses-text", _set(_measured, "losses", "down"), "losses"),
    ("comm-negative", _set(_measured, "comm_alone_s", -1.0), "comm_alone_s"),
    ("comm-text", _set(_measured, "comm_s", "lots"), "comm_s"),
    ("peak-text", _set(_measured, "peak_memory_bytes", "1 GiB"), "peak_memory_bytes"),
    ("peak-nan", _set(_measured, "peak_memory_bytes", [math.nan]), "peak_memory_bytes"),
    ("predicted-list", _set(lambda d: d, "predicted", []), "predicted"),
    ("predicted-step-nan", _set(lambda d: d["predicted"], "step_s", math.nan), "predicted/step_s"),
    ("predicted-memory-negative", _set(lambda d: d["predicted"], "memory_bytes", -1), "memory_bytes"),
    ("model-text", _set(lambda d: d, "model", "gpt"), "model"),
    ("cluster-missing", _drop(lambda d: d, "cluster"), "cluster"),
    ("device-number", _set(lambda d: d, "device", 0), "device"),
    ("error-number", _set(lambda d: d, "error", 5), "error"),
    ("whole-list", _text("[]"), "kind"),
    ("binary", lambda d: bytes(range(256)), "not valid JSON|not text"),
    ("truncated", lambda d: json.dumps(d)[:40], "not valid JSON"),
]


# ---- broken schedule results (schedule.json of python -m autotune schedule, read by --rescore) -----------
def schedule_record() -> dict:
    return {"kind": "schedule-tune", "version": 1, "date": "2026-11-25", "ranks": 2, "nodes": 1, "gpus_per_node": 2,
            "profile": "gcp-a100", "dtype": "float32", "space": "default", "measured": False,
            "collectives": [{"collective": "allreduce", "candidates": {}, "bands": [],
                             "table": [{"lo": 0, "hi": 1024, "choice": "nccl"}]}]}


def _coll0(d):
    return d["collectives"][0]


SCHEDULE_CASES = [
    ("ranks-zero", _set(lambda d: d, "ranks", 0), "ranks"),
    ("ranks-text", _set(lambda d: d, "ranks", "2"), "ranks"),
    ("nodes-missing", _drop(lambda d: d, "nodes"), "nodes"),
    ("measured-text", _set(lambda d: d, "measured", "no"), "measured"),
    ("collectives-text", _set(lambda d: d, "collectives", "allreduce"), "collectives"),
    ("collective-number", _set(lambda d: d, "collectives", [5]), "collectives"),
    ("candidates-list", _set(_coll0, "candidates", []), "candidates"),
    ("bands-text", _set(_coll0, "bands", "x"), "bands"),
    ("band-rows-text", _set(_coll0, "bands", [{"rows": "x"}]), "rows"),
    ("band-row-nan", _set(_coll0, "bands", [{"rows": [{"measured_us": math.nan}]}]), "measured_us"),
    ("table-reversed", _set(_coll0, "table", [{"lo": 4096, "hi": 1024, "choice": "nccl"}]), "table/0"),
    ("table-negative", _set(_coll0, "table", [{"lo": -1, "hi": 0, "choice": "nccl"}]), "table/0"),
    ("table-text", _set(_coll0, "table", ["nccl"]), "table/0"),
    ("schedule-kind", _set(lambda d: d, "kind", "commtune.profile"), "kind"),
]
