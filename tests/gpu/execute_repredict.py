"""Re-predict a recorded ``autotune execute`` GPU run with the current step model (offline, CPU).

    python tests/gpu/execute_repredict.py RUN_DIR

RUN_DIR is the ``execute`` folder of a ``tests/gpu/execute_check.sh`` run: its ``plans.json`` (whose
``meta.command`` gives the model, cluster and memory limit), ``profile.json`` (the compute figures
measured in that run) and ``exec/execute-*.json`` (the measurements). Each plan is rebuilt from its
layers' signatures and placements (not from strategy indices, which depend on the search space that
made it) and priced again; the table puts the recorded prediction, the new one and the measurement side
by side. This is a re-prediction of old measurements, not a new measurement: a model change tuned on a
run must be judged on the next run.
"""
from __future__ import annotations

import glob
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibrate.cli import run_cli  # noqa: E402
from calibrate.errors import UserError  # noqa: E402
from calibrate.profile import Profile  # noqa: E402
from models import load_model  # noqa: E402

from autotune.sbp.boxing import Coster  # noqa: E402
from autotune.sbp.cost import Problem  # noqa: E402
from autotune.sbp.mesh import Cluster  # noqa: E402
from autotune.plan.build import build  # noqa: E402

import execute_plans  # noqa: E402


def layer_sbp(s, cluster) -> dict:
    """A strategy's placements in the notation the recorded (version 1) plans wrote them."""
    return {**({"input": s.sbp(s.input, cluster)} if s.input else {}),
            **({"output": s.sbp(s.output, cluster)} if s.output else {}),
            "weights": {w.name: s.sbp(w, cluster) for w in s.weights}}


def assignment(problem: Problem, plan: dict) -> list[int]:
    """Strategy indices of ``plan``'s layers in ``problem``, matched by signature and placements."""
    out = []
    for v, layer in enumerate(plan["layers"]):
        want = (layer["signature"], layer["sbp"])
        for i, s in enumerate(problem.choices[v]):
            if (s.signature, layer_sbp(s, problem.cluster)) == want:
                out.append(i)
                break
        else:
            raise UserError(f"plan {plan['strategy']!r}: layer {layer['name']} has no matching strategy now")
    return out


def priced(problems: list[Problem], plan: dict) -> float:
    """The plan's predicted step time in the first of ``problems`` whose strategies it uses."""
    for problem in problems:
        try:
            return build(problem, assignment(problem, plan), plan["strategy"]).costs.step_s
        except UserError:
            continue
    raise UserError(f"plan {plan['strategy']!r} uses strategies no search space has now: re-run the plans")


def main(argv=None) -> int:
    run = Path((argv or sys.argv[1:])[0])
    plans = json.loads((run / "plans.json").read_text())
    cmd = shlex.split(plans["meta"]["command"])[1:]
    args = execute_plans.parser().parse_args(cmd)
    prof = Profile.load(str(run / "profile.json"))
    graph = load_model("gpt", None, {f: getattr(args, f) for f in execute_plans.FIELDS})
    limit = args.memory_limit * 2**30 if args.memory_limit else None
    coster = Coster(prof, Cluster(args.nodes, args.gpus_per_node))
    # the default search space, and SUMMA's (whose matmuls only execute_plans' SUMMA plan uses)
    problems = [Problem(graph, coster, limit, objective="step"),
                Problem(graph, coster, limit, objective="step", signatures=("summa",))]
    by_name = {p["strategy"]: p for p in [plans["best"]] + plans["baselines"]}
    print(f"{'plan':28s} {'recorded pred ms':>16s} {'new pred ms':>11s} {'step ms':>8s} {'err':>7s}")
    worst = 0.0
    for f in sorted(glob.glob(str(run / "exec" / "execute-*.json"))):
        r = json.loads(Path(f).read_text())
        new = priced(problems, by_name[r["strategy"]])
        err = r["measured"]["step_s"] / new - 1
        worst = max(worst, abs(err))
        print(f"{r['strategy'][:28]:28s} {r['predicted']['step_s'] * 1e3:16.2f} {new * 1e3:11.2f} "
              f"{r['measured']['step_s'] * 1e3:8.2f} {err:+7.1%}")
    print(f"worst step error {worst:.1%} (measured against the new prediction)")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="execute_repredict"))
