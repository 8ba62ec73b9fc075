"""Context parallelism priced (``autotune.sbp.layers.Attention``'s "attention-cp", Megatron-LM's
--context-parallel-size, Llama 3's all-gather attention): closed forms of its compute and its K/V collectives,
Megatron's plan with it, and bad input."""
import pytest

from calibrate.errors import UserError
from models import load_model
from autotune.sbp.baselines import megatron_assignment
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem, internal_steps
from autotune.sbp.mesh import Cluster
from autotune.sbp.steptime import _core, layer_seconds
from autotune.sbp.techniques import context_parallel, context_parallel_of

SMALL = {"layers": 2, "hidden": 512, "heads": 8, "kv_heads": 4, "ffn": 1024, "vocabulary": 1024,
         "sequence": 1024, "batch": 2, "micro_batch": 2}


def _problem(profile, cp, cluster=Cluster(4, 2), **over):
    g = context_parallel(load_model("llama", "llama3-8b", dict(SMALL, **over)), cp)
    return Problem(g, Coster(profile, cluster), None, runnable=False)  # its layers split each sequence over c


def _attention(pr):
    return next(v for v, op in enumerate(pr.ops) if op.layer.kind == "attention")


def test_cp_attention_is_the_whole_sequences_work_over_c_and_its_kv_gathered(profile):
    pr = _problem(profile, 4)
    v = _attention(pr)
    op, cl = pr.ops[v], pr.cluster
    cps = [s for s in pr.choices[v] if s.signature == "attention-cp"]
    assert cps and all(s.mesh.role_size(1) == 4 for s in cps)  # (d / c, c, t): the group on role 1
    for s in cps:
        r0, r1 = s.mesh.role_size(0), s.mesh.role_size(2)  # sequences, heads
        # a quarter of the causal attention of the rank's sequences (its heads): the closed form
        for bwd in (False, True):
            assert _core(op, s, cl, pr.compute, pr.act_bytes, bwd) == pytest.approx(pr.compute.sdpa_seconds(
                SMALL["micro_batch"] // r0, 8 // r1, 4 // r1, SMALL["sequence"], 512 // 8, pr.act_bytes,
                backward=bwd) / 4 * pr.compute.context_core_ratio(4, SMALL["sequence"], pr.act_bytes), rel=1e-12)
        # forward: K and V (2 kv_heads x head_dim columns) all-gathered over the 4 ranks of the group; backward
        # their gradients reduce-scattered; each of the gathered bytes a rank holds
        steps = {d: st for _, d, st in internal_steps(s, cl)}
        kv = SMALL["batch"] * SMALL["sequence"] // r0 * (2 * 4 // r1) * (512 // 8) * 2
        ag, rs = steps["fwd"], steps["bwd"]
        assert {x.op for x in ag} == {"allgather"} and {x.op for x in rs} == {"reducescatter"}
        assert ag[-1].nbytes == rs[0].nbytes == kv  # in one step, or a tier at a time
        assert sorted(a for x in ag for a in x.axes) == sorted(a for x in rs for a in x.axes) and \
            len([a for x in ag for a in x.axes]) == 2  # the cp role's fine axes (2 x 2)


def test_megatron_with_context_parallelism_changes_the_attention_core_alone(profile):
    pr = _problem(profile, 2, batch=4, micro_batch=4)  # 4 sequences: the plain plan's 4 data ranks take one each
    d, t = (4, 1), (1, 2)
    plain = megatron_assignment(pr, d, t)
    cp = megatron_assignment(pr, d, t, context=(2, 1))
    v = _attention(pr)
    assert pr.choices[v][cp[v]].signature == "attention-cp" and pr.choices[v][plain[v]].signature == "attention"
    assert [a for i, a in enumerate(plain) if i != v] == [a for i, a in enumerate(cp) if i != v]
    # a planted bug (the core priced whole, not over c) would make the CP plan's attention dearer than this
    assert pr.cost(cp) != pr.cost(plain)


def test_context_parallel_is_kept_by_the_graph_and_bad_sizes_are_one_line_errors():
    g = load_model("llama", "llama3-8b", dict(SMALL))
    assert context_parallel_of(g) == 1 and context_parallel_of(context_parallel(g, 4)) == 4
    with pytest.raises(UserError, match="does not split into 6 equal chunks"):
        context_parallel(g, 3)
    gpt = load_model("gpt", "gpt2", {"layers": 2, "attention": "naive"})
    with pytest.raises(UserError, match="flash attention"):
        context_parallel(gpt, 2)
