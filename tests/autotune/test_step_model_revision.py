"""The step model's revision (``autotune.plan.hostpace.STEP_MODEL``) moves with its predictions: the residuals
``autotune tune`` writes divide the predictions of one revision, and are left out under another. These figures
are the model's prices of fixed plans (a small Llama on one and on two devices, with and without a measured module
and its slowdown beside collectives, FSDP on two, and a pipeline stage with two micro-batches in flight), recorded
at the revision. Where a change moves them, bump ``STEP_MODEL`` and record the new figures under it."""
import pytest

from calibrate.module import ModulePoint, ModuleSection
from calibrate.profile import Profile
from models import load_model

from autotune.pipeline.stage import StageProblem, figures
from autotune.plan.hostpace import STEP_MODEL
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.memory import NONE, Mode
from autotune.sbp.mesh import Cluster

MODEL = {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocabulary": 256, "sequence": 32,
         "batch": 8, "micro_batch": 2}
SECTION = ModuleSection("test", "transformers:LlamaForCausalLM",
                        {"hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocabulary": 256},
                        (ModulePoint(1, 2, 32, {"forward_s": 1e-3, "backward_s": 2e-3, "recompute_s": None,
                                                "optimizer_s": 1e-4, "activation_bytes": 3e5},
                                     {"forward_s": 5e-4, "backward_s": 7e-4, "optimizer_s": 3e-4}),),
                        overlap={"all_reduce": 1.05, "all_gather": 1.2, "reduce_scatter": 1.25, "peer": "nccl"})
# The figures on the embedded h200-nvlink profile as it is now: re-recorded, under the same revisions, when that
# profile's own figures move and the step model does not (2026-12-01: its SDPA grid and layer pieces measured)
G = [0.0102517, 4281340.0, 0.0160579, 2178050.0, 0.0185475, 2173950.0, 0.00536937, 0.0126882, 0.000363508, 5243900.0,
     0.0101781, 0.0545881, 4363140.0, 0.0607852, 2218940.0, 0.0633221, 2214850.0, 0.0059297, 0.0121279, 0.0007,
     5407490.0, 0.0541348]
FIGURES = {  # revision -> the figures of ``prices()``, 6 significant digits
    "2026-11-30g": G,
    "2026-11-30h": G,  # sequence parallelism's copies: a built plan's path work, which these layer prices leave out
    "2026-11-30i": G,  # the DTensor path's FSDP in series: a built plan's path, which these layer prices leave out
    "2026-11-30j": G,  # FSDP with the embedding by columns on fully_shard: a built plan's path likewise
}


def prices() -> list[float]:
    out = []
    for module in (None, SECTION):
        profile = Profile.load("h200-nvlink")
        profile.module = module
        graph = load_model("llama", None, dict(MODEL))
        profile = profile.for_model(graph.config)  # as the search prices it: the module's own overlap
        for devices, mode in ((1, NONE), (2, NONE), (2, Mode(fsdp_axes=(0,)))):
            pr = Problem(graph, Coster(profile, Cluster(1, devices)), None, require_fit=False, objective="step",
                         mode=mode)
            a = pr.min_memory_assignment()
            out += [pr.raw_cost(a), pr.peak_memory(a)]
        st = StageProblem(graph, Coster(profile, Cluster(1, 1)), None).in_flight(2)
        a = [0] * len(st.choices)
        f = figures(st, a)
        out += [f.forward, f.backward, f.optimizer, f.memory, st.raw_cost(a)]
    return [float(f"{x:.6g}") for x in out]


def test_the_revision_names_the_figures_it_prices():
    assert STEP_MODEL in FIGURES, f"record the figures of step model revision {STEP_MODEL}"
    assert prices() == pytest.approx(FIGURES[STEP_MODEL], rel=1e-5), (
        "the step model's prices moved: bump autotune.plan.hostpace.STEP_MODEL (residuals fitted against the old "
        "predictions are then left out) and record the new figures under it")
