"""What ``apply`` needs of a plan, checked on the CPU without torch: every plan the search returns (the
best and each baseline, every stage of a pipelined one) must pass (``tests/autotune/test_plan_runnable.py``).

- the batch is whole micro-batches: the model's batch is its micro-batch times the plan's micro-batches;
- each activation, as a user's module holds it (batch, sequence, features), splits as placed: the devices of
  its S0 (the batch dimension) divide the micro-batch (a micro-batch of 1 or 2 is not split over more
  devices), those of its S1 divide its features (vocabulary, hidden, ffn, qkv width); on the tensor-parallel
  axes of a plan with sequence parallelism (``autotune.plan.layouts``: torch's ``SequenceParallel`` splits the
  sequence there) the S0 devices divide the sequence instead;
- the attention's feature split keeps heads whole: its devices divide the heads and the K/V heads (where q,
  k and v come from one fused projection, ``qkv_fused`` of the attention's dims, as GPT-2's ``c_attn``, each
  third splits by heads);
- each weight splits as placed: the devices of each S<d> divide dimension d (the vocabulary of the embedding
  and the head, the ffn of fc1 and fc2, the heads' columns of qkv): a ``TypedPlan`` holds no other.
"""
from __future__ import annotations

import math

from models.graph import Layer

from autotune.plan.layouts import sequence_axes
from autotune.plan.typed import TypedPlan
from autotune.sbp.layers import make_op


def _parts(placements, sizes, p: str, skip: tuple[int, ...] = ()) -> int:
    return math.prod(n for a, (q, n) in enumerate(zip(placements, sizes)) if q == p and a not in skip)


def unrunnable(plan: TypedPlan) -> list[str]:
    """Each way ``plan`` breaks a rule of the module doc, in words; empty where apply can take it."""
    sizes, model = plan.mesh.sizes, plan.model
    batch, micro = model.get("batch"), model.get("micro_batch")
    out, seq_axes, seq = [], sequence_axes(plan), model.get("sequence")
    t = math.prod(sizes[a] for a in seq_axes)
    if seq is not None and seq % t:
        out.append(f"sequence {seq} over {t} sequence-parallel devices")
    if batch is not None and micro is not None and batch != micro * plan.micro_batches:
        out.append(f"batch {batch} is not {plan.micro_batches} micro-batches of {micro}")
    for lay in plan.layers:
        op = make_op(Layer(lay.name, lay.kind, tuple(lay.dims.items())), 2)
        for what, fine, shape in (("input", lay.input, op.in_shape), ("output", lay.output, op.out_shape)):
            if fine is None or shape is None:
                continue
            rows = micro if model.get("sequence") is not None and micro is not None else shape[0]
            for d, size in ((0, rows), (1, shape[-1])):
                n = _parts(fine, sizes, f"S{d}", seq_axes if d == 0 and rows == micro else ())
                if size % n:
                    out.append(f"layer {lay.name} {what}: {('micro-batch', 'features')[d]} {size} over {n} devices")
        if lay.kind == "attention" and lay.input is not None:
            n = _parts(lay.input, sizes, "S1")
            for key in ("heads", "kv_heads"):
                if lay.dims[key] % n:
                    out.append(f"layer {lay.name}: {key} {lay.dims[key]} over {n} devices"
                               f"{' (fused qkv)' if lay.dims.get('qkv_fused') else ''}")
    return out
