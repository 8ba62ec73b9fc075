"""Activation communication of one attention layer (AutoDDL Fig. 3's measure): the
collectives a plan runs inside and between ln1 -> qkv -> attention -> proj -> ln2 per
micro-batch, forward and backward, and the elements one device sends for them (the ring
volumes of AutoDDL Table 2)."""
from __future__ import annotations

from autotune.sbp.cost import Problem, edge_steps, internal_steps

ATTENTION = ("ln1", "qkv", "attention", "proj", "ln2")
BLOCK = ATTENTION + ("fc1", "gelu", "fc2", "ln1")  # a whole transformer layer, ln1 to the next ln1


def attention_steps(pr: Problem, assign, chain=ATTENTION) -> list:
    """(step, item size) of the collectives of one attention layer per micro-batch, forward and backward: inside ln1
    (a split layer norm's statistics), qkv, attention and proj, and the boxings ln1 -> ... -> ln2.
    With Megatron these are the all-reduce after proj (forward) and the one of the layer input's
    gradient (backward; it reaches ln1's producer as a partial sum and shows on the edge into ln2
    of the block before, the same size)."""
    names = [op.layer.name for op in pr.ops]
    vs = [names.index(n) for n in chain]
    out = []
    for v in vs[:-1]:
        s = pr.choices[v][assign[v]]
        itemsize = {it.tensor: it.itemsize for it in s.internal}
        for tensor, _, steps in internal_steps(s, pr.cluster):
            out += [(st, itemsize[tensor]) for st in steps]
    for a, b in zip(vs, vs[1:]):
        fwd, bwd = edge_steps(pr.choices[a][assign[a]], pr.choices[b][assign[b]], pr.ops[a].out_shape, pr.cluster,
                              pr.act_bytes)
        out += [(st, pr.act_bytes) for st in fwd + bwd]
    return out


def attention_volume(pr: Problem, assign, chain=ATTENTION) -> float:
    """Elements one device sends (ring volumes of Table 2) in one attention layer per micro-batch."""
    return sum(pr.coster.volume(st, itemsize) for st, itemsize in attention_steps(pr, assign, chain))
