"""``python -m autotune explain``: the computations behind the explanations of
reports/records/sbp_reproduce.md, rerunnable:

    python -m autotune explain megatron-meshes CASE [--micro-batch N] [--classes N]
        every Megatron mesh of an AutoDDL case: communication, gradient sync, redistribution, memory
    python -m autotune explain papers-plan
        the paper's Fig. 3 strategy (its attention layer on 64 nodes, Megatron 4 x 16 elsewhere) against
        Megatron 4 x 16 and the searched plan, wide transformer at micro-batch 16
    python -m autotune explain summa CASE --micro-batch N
        why SUMMA has or has no plan: per 2D mesh, the layers without a strategy
    python -m autotune explain versus-data-parallel CASE [--micro-batch N]
        where the searched plan departs from data parallelism: each layer placed otherwise, with its
        gradient sync and redistribution in both plans, and the boxings the searched plan adds
"""
from __future__ import annotations

import math

import numpy as np

from calibrate.cli import command_parser
from calibrate.errors import OptionError, UserError

from autotune.sbp.baselines import _Index, data_parallel, megatron_assignment, summa_assignment
from autotune.sbp.mesh import RoleMesh, role_meshes
from autotune.plan.build import build
from autotune.reproduce import Config, _problem, breakdown, load_cases, papers_plan as drawn_plan
from autotune.sbp.search import auto_budget, make_search

GI = 2**30


def _case(cid: str) -> dict:
    for c in load_cases():
        if c["id"] == cid:
            return c
    raise UserError(f"unknown case {cid!r}: use one of {', '.join(c['id'] for c in load_cases())}")


def _line(name, pr, a) -> str:
    b = breakdown(pr, a)
    cost = pr.cost(a)
    return (f"{name}: {cost if math.isfinite(cost) else 'over memory'} s/step (raw {pr.raw_cost(a):.4g}); "
            f"sync {sum(b['grad_sync_s_by_kind'].values()):.4g} {b['grad_sync_s_by_kind']}; "
            f"redistribution {b['redistribution_s']:.4g}; {pr.memory_of(a) / GI:.2f} GiB")


def megatron_meshes(case: dict, over: dict) -> None:
    pr = _problem(case, over, Config())
    for m in role_meshes(pr.cluster, 2):
        if case["gpus"] > 1 and m.sizes[1][0] != 1:
            continue  # tensor parallel inside a node, as the paper tuned it on GCP
        a = megatron_assignment(pr, *m.sizes)
        print(_line(f"Megatron d={m.sizes[0]} t={m.sizes[1]}", pr, a) if a else f"Megatron {m.sizes}: no strategy")
    res = make_search("cd").run(pr, auto_budget(pr), np.random.default_rng(0))
    print(_line("searched", pr, res.assignment))


def papers_plan() -> None:
    case = _case("wide-daint-64")
    pr = _problem(case, {"micro_batch": 16}, Config())
    mega = megatron_assignment(pr, (4, 1), (16, 1))
    paper = drawn_plan(_case("attention-fig3"), pr, mega)
    res = make_search("cd").run(pr, auto_budget(pr), np.random.default_rng(0), mega)
    print(_line("Megatron 4 x 16", pr, mega))
    print(_line("paper's Fig. 3 plan", pr, paper) + f"; reduction {(1 - pr.cost(paper) / pr.cost(mega)) * 100:.1f}%")
    print(_line("searched", pr, res.assignment) + f"; reduction {(1 - res.cost / pr.cost(mega)) * 100:.1f}%")


def summa(case: dict, over: dict) -> None:
    pr = _problem(case, over, Config(), ("summa",))
    names = [op.layer.name for op in pr.ops]
    for m in role_meshes(pr.cluster, 2):
        a = summa_assignment(pr, *m.sizes)
        if a is not None:
            print(f"SUMMA {m.sizes}: {pr.cost(a)} s/step, {pr.memory_of(a) / GI:.2f} GiB")
            continue
        idx = _Index(pr)
        missing = [names[v] for v, op in enumerate(pr.ops)
                   if idx.get(v, ("summa" if op.layer.kind in ("matmul", "embedding") else op.layer.kind, RoleMesh(m.sizes)))
                   is None]
        print(f"SUMMA {m.sizes}: no strategy for {', '.join(missing)}")


def versus_data_parallel(case: dict, over: dict) -> None:
    pr = _problem(case, over, Config())
    res = make_search("cd").run(pr, auto_budget(pr), np.random.default_rng(0))
    ours, dp = build(pr, res.assignment, "searched"), build(pr, data_parallel(pr), "data parallel")

    def placed(lay):
        return (lay.input, lay.output, *(w.placements for w in lay.weights))
    for a, b in zip(ours.layers, dp.layers):
        if placed(a) != placed(b):
            print(f"{a.name} (x{a.count}): searched {placed(a)}; data parallel {placed(b)}; gradient sync "
                  f"{a.costs['grad_sync_s'] * a.count * 1e3:.3f} ms against {b.costs['grad_sync_s'] * b.count * 1e3:.3f} "
                  f"ms, redistribution inside {a.costs['redistribution_s'] * a.count * 1e3:.3f} ms against "
                  f"{b.costs['redistribution_s'] * b.count * 1e3:.3f} ms")
    for e in ours.edges:
        if e.costs["redistribution_s"] > 0:
            moves = ", ".join(f"{c.collective} {c.nbytes} B {c.direction}" for c in e.collectives)
            print(f"boxing {e.source} -> {e.target} (x{e.count}): {e.count * e.costs['redistribution_s'] * 1e3:.3f} ms "
                  f"({moves})")
    t, d = ours.costs.total_s, dp.costs.total_s
    print(f"searched {t:.6g} s/step, data parallel {d:.6g} s/step: {(1 - t / d) * 100:.1f}% less")


def main(argv=None) -> int:
    ap = command_parser("python -m autotune explain", __doc__.split("\n\n")[0], epilog=__doc__)
    ap.add_argument("what", choices=list(CASE_COMPUTATIONS) + ["papers-plan"], help="which computation")
    ap.add_argument("case", nargs="?", help="an AutoDDL case id (python -m autotune reproduce autoddl lists them)")
    ap.add_argument("--micro-batch", type=int, help="micro-batch (default: the case's)")
    ap.add_argument("--classes", type=int, help="VGG: pad the classes (as Megatron-LM pads its vocabulary)")
    args = ap.parse_args(argv)
    if args.what == "papers-plan":
        given = [f"the case {args.case!r}"] if args.case else []
        given += [f"--{n.replace('_', '-')}" for n in ("micro_batch", "classes") if getattr(args, n) is not None]
        if given:
            raise UserError(f"papers-plan computes one fixed case (wide-daint-64 at micro-batch 16): remove "
                            f"{' and '.join(given)}")
        papers_plan()
        return 0
    if not args.case:
        raise UserError(f"{args.what} needs a case id: e.g. python -m autotune explain {args.what} "
                        f"{load_cases()[0]['id']}")
    for name, value in (("micro_batch", args.micro_batch), ("classes", args.classes)):
        if value is not None and value < 1:
            raise OptionError(name, f"must be at least 1, got {value}")
    case = _case(args.case)
    over = dict(case.get("overrides", {}))
    if args.micro_batch is not None:
        over["micro_batch"] = args.micro_batch
    if args.classes is not None:
        over["classes"] = args.classes
    CASE_COMPUTATIONS[args.what](case, over)
    return 0


CASE_COMPUTATIONS = {"megatron-meshes": megatron_meshes, "summa": summa, "versus-data-parallel": versus_data_parallel}
