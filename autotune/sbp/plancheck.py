"""The schema of plan.json's body, checked on load: every reader (the report, validate, execute)
gets a plan whose fields have the types and ranges it relies on, or one ``UserError`` naming
the file, the field and the fix.

Checked: ``best`` and each of ``baselines`` is a plan (strategy, model, cluster, totals,
layers; optional fields typed where present; the model's integer fields counts >= 1), totals are finite and not negative, every
layer's mesh spans the cluster's devices exactly (a pipelined plan's: its stages' submesh); ``traces`` and ``meta`` are objects.
Fields a plan gains later (recomputation, sharding, stages) are left to their readers."""
from __future__ import annotations

import math

from calibrate.errors import UserError
from models import FIELDS

FIX = "give a plan.json written by python -m autotune, or re-run the search"
TOTALS = ("redistribution_s", "grad_sync_s", "total_s", "memory_bytes")
COUNTS = sorted({name for fields in FIELDS.values() for name, typ in fields.items() if typ == "int"})  # model fields


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Check:
    def __init__(self, origin: str):
        self.origin = origin

    def fail(self, where: str, problem: str):
        raise UserError(f"{self.origin}: {where} {problem}: {FIX}")

    def kind(self, d: dict, key: str, kind: type, where: str, required: bool = True):
        path = f"{where}/{key}" if where else key
        if key not in d:
            if required:
                self.fail(path, "is missing")
            return None
        if not isinstance(d[key], kind) or isinstance(d[key], bool) and kind is not bool:
            name = {dict: "an object", list: "a list", str: "a string", bool: "true or false"}[kind]
            self.fail(path, f"is {_short(d[key])}, not {name}")
        return d[key]

    def plan(self, p, where: str) -> None:
        if not isinstance(p, dict):
            self.fail(where, f"is {_short(p)}, not an object")
        self.kind(p, "strategy", str, where)
        model = self.kind(p, "model", dict, where)
        if not isinstance(model.get("name"), str):
            self.fail(f"{where}/model/name", f"is {_short(model.get('name'))}, not a string")
        for key in COUNTS:
            if key in model and not (_whole(model[key]) and model[key] >= 1):
                self.fail(f"{where}/model/{key}", f"is {_short(model[key])}, not a count >= 1")
        cluster = self.kind(p, "cluster", dict, where)
        for key in ("nodes", "gpus_per_node"):
            if not (_whole(cluster.get(key)) and cluster[key] >= 1):
                self.fail(f"{where}/cluster/{key}", f"is {_short(cluster.get(key))}, not a count >= 1")
        devices = cluster["nodes"] * cluster["gpus_per_node"]
        for key, kind in (("profile", str), ("search", dict), ("assignment", list), ("objective", str),
                          ("edges", list)):
            self.kind(p, key, kind, where, required=False)
        if "micro_batches" in p and not (_whole(p["micro_batches"]) and p["micro_batches"] >= 1):
            self.fail(f"{where}/micro_batches", f"is {_short(p['micro_batches'])}, not a count >= 1")
        limit = p.get("memory_limit_bytes")  # None: the search ran without a memory limit
        if limit is not None and not (_number(limit) and limit > 0):
            self.fail(f"{where}/memory_limit_bytes", f"is {_short(limit)}, not a positive finite number or null")
        self.totals(self.kind(p, "totals", dict, where), f"{where}/totals")
        layers = self.kind(p, "layers", list, where)
        if not layers:
            self.fail(f"{where}/layers", "is empty")
        sub = (p.get("pipeline") or {}).get("submesh") if isinstance(p.get("pipeline"), dict) else None
        if isinstance(sub, dict) and _whole(sub.get("nodes")) and _whole(sub.get("gpus_per_node")):
            devices = sub["nodes"] * sub["gpus_per_node"]  # a pipelined plan: each stage's layers span its submesh
        for i, layer in enumerate(layers):
            self.layer(layer, f"{where}/layers/{i}", devices)

    def totals(self, t: dict, where: str) -> None:
        for key in TOTALS:
            if key not in t:
                self.fail(f"{where}/{key}", "is missing")
        for key, v in t.items():
            if key == "fits_memory":
                if not isinstance(v, bool):
                    self.fail(f"{where}/{key}", f"is {_short(v)}, not true or false")
            elif key == "memory":
                # the workspace may be negative: the gradients not yet made at the peak (autotune.sbp.memory)
                if not isinstance(v, dict) or not all(_number(x) and (x >= 0 or k == "workspace_bytes")
                                                      for k, x in v.items()):
                    self.fail(f"{where}/{key}", "is not an object of byte counts")
            elif not (_number(v) and v >= 0):
                self.fail(f"{where}/{key}", f"is {_short(v)}, not a finite number >= 0")
        if "fits_memory" not in t:
            self.fail(f"{where}/fits_memory", "is missing")

    def layer(self, layer, where: str, devices: int) -> None:
        if not isinstance(layer, dict):
            self.fail(where, f"is {_short(layer)}, not an object")
        self.kind(layer, "name", str, where)
        self.kind(layer, "kind", str, where)
        if "count" in layer and not (_whole(layer["count"]) and layer["count"] >= 1):
            self.fail(f"{where}/count", f"is {_short(layer['count'])}, not a count >= 1")
        mesh = self.kind(layer, "mesh", list, where)
        flat = [x for axis in mesh for x in (axis if isinstance(axis, list) else [axis])]
        if not flat or not all(_whole(x) and x >= 1 for x in flat):
            self.fail(f"{where}/mesh", f"is {_short(mesh)}, not lists of device counts >= 1")
        if math.prod(flat) != devices:
            self.fail(f"{where}/mesh", f"spans {math.prod(flat)} devices, the plan's cluster has {devices}")
        shape = layer.get("dtensor", {}).get("mesh_shape") if isinstance(layer.get("dtensor"), dict) else None
        if "dtensor" in layer and not isinstance(layer["dtensor"], dict):
            self.fail(f"{where}/dtensor", f"is {_short(layer['dtensor'])}, not an object")
        if shape is not None and (not isinstance(shape, list) or not all(_whole(x) and x >= 1 for x in shape)
                                  or math.prod(shape) != devices):
            self.fail(f"{where}/dtensor/mesh_shape", f"is {_short(shape)}, not a mesh of the cluster's {devices} "
                                                     f"devices")
        for key in ("sbp", "nd_sbp"):
            self.kind(layer, key, dict, where, required=False)
        self.kind(layer, "collectives", list, where, required=False)
        for key, v in layer.items():
            if (key.endswith("_s") or key.endswith("_bytes")) and not (_number(v) and v >= 0):
                self.fail(f"{where}/{key}", f"is {_short(v)}, not a finite number >= 0")


def check_plan(d: dict, origin: str) -> dict:
    """``d`` (a plan.json whose header is checked) when its body is a plan; one ``UserError`` otherwise."""
    c = _Check(origin)
    if "best" not in d:
        c.fail("best", "is missing")
    c.plan(d["best"], "best")
    baselines = c.kind(d, "baselines", list, "", required=False) or []
    for i, b in enumerate(baselines):
        c.plan(b, f"baselines/{i}")
    c.kind(d, "traces", dict, "", required=False)
    c.kind(d, "meta", dict, "", required=False)
    return d
