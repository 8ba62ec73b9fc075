"""The ranking model: the interpreter cost model (``interp_model``) of a candidate, an optional
per-protocol correction fitted to measurements, the GC3 cost simulation kept beside it for
reference, and Spearman's rank correlation.

- ``split`` is the runtime's own: one CUDA block per ``bytes_per_block`` of a
  chunk, at most ``max_split`` (kernels.interp.model.runtime_split).
- The GC3 simulation (kernels/gc3/simulate.py, reported as ``simulated_us``) sees
  the interpreter's split as the compiler's ``instances`` replication done at run
  time: every thread block replicated ``split`` times on distinct connections (same
  links) with chunks ``split`` times smaller (``split_program``), plus the input copy
  of an in-place program serving an out-of-place call at the simulation's local beta.
  It charges every tile NCCL's per-call sendrecv cost and has no per-CUDA-block
  bandwidth, so it does not rank the interpreter's candidates (2026-11-22 run:
  Spearman -0.89 at 1..16 KiB); the ranking uses the interpreter model.
- Correction (fitted when candidates were measured): per protocol,
  t = a + k * t_model with a, k >= 0, least squares on relative error. It is
  monotone within a protocol, so it reorders candidates only across protocols.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from calibrate.collectives import Collective
from calibrate.errors import UserError
from calibrate.profile import Group, Profile
from calibrate.records import check_header, header
from kernels.gc3.ir import Gpu, Program, Protocol, Step, ThreadBlock
from kernels.gc3.simulate import LOCAL_BETA_FRACTION, simulate
from kernels.interp.preset import Fifo

from kernels.interp import model as interp_model
from kernels.interp.model import Links, ModelParams, copy_bytes, runtime_split
from autotune.schedule.space import Built


def split_program(program: Program, split: int) -> Program:
    """``program`` with every thread block run as ``split`` copies, each on its own connection
    (channel c*split+j) and moving chunks ``split`` times smaller: for simulation only
    (offsets address the finer chunks approximately; sizes are exact)."""
    if split == 1:
        return program

    def step(st: Step, j: int, tb_base: dict[int, int]) -> Step:
        return dataclasses.replace(st, srcoff=st.srcoff * split + j if st.srcoff >= 0 else st.srcoff,
                                   dstoff=st.dstoff * split + j if st.dstoff >= 0 else st.dstoff,
                                   deps=[(tb_base[t] + j, s) for t, s in st.deps])

    gpus = []
    for g in program.gpus:
        tb_base = {tb.id: k * split for k, tb in enumerate(g.threadblocks)}
        tbs = [ThreadBlock(tb_base[tb.id] + j, tb.send, tb.recv, tb.chan * split + j,
                           [step(st, j, tb_base) for st in tb.steps])
               for tb in g.threadblocks for j in range(split)]
        gpus.append(Gpu(g.id, g.i_chunks * split, g.o_chunks * split, g.s_chunks * split, tbs))
    return dataclasses.replace(program, nchunksperloop=program.nchunksperloop * split,
                               nchannels=program.nchannels * split, gpus=gpus)


CORRECTION_KIND = "commtune.model-correction"
CORRECTION_VERSION = 1


@dataclass
class Correction:
    """Per protocol (a seconds, k): t = a + k * t_sim; identity where nothing was fitted."""

    terms: dict[str, tuple[float, float]] = field(default_factory=dict)
    source: str = ""

    def apply(self, protocol: str, seconds: float) -> float:
        a, k = self.terms.get(protocol, (0.0, 1.0))
        return a + k * seconds

    def to_dict(self) -> dict:
        return {**header(CORRECTION_KIND, CORRECTION_VERSION), "source": self.source,
                "terms": {p: {"a_us": a * 1e6, "k": k} for p, (a, k) in sorted(self.terms.items())}}

    @classmethod
    def from_dict(cls, d: dict, origin: str = "model correction") -> "Correction":
        if "kind" in d or "version" in d:  # corrections written before the header have neither
            check_header(d, CORRECTION_KIND, CORRECTION_VERSION, "model correction", "regenerate it with autotune schedule on GPUs",
                         origin)
        try:
            return cls({p: (float(v["a_us"]) * 1e-6, float(v["k"])) for p, v in d.get("terms", {}).items()},
                       str(d.get("source", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"model correction is malformed ({e!r}); regenerate it with autotune schedule on GPUs") \
                from None

    @classmethod
    def fit(cls, points: list[tuple[str, float, float]], source: str = "") -> "Correction":
        """Fit from (protocol, simulated s, measured s); a protocol needs 2 distinct simulated times."""
        from scipy.optimize import nnls

        terms = {}
        for proto in sorted({p for p, _, _ in points}):
            xs = np.array([x for p, x, y in points if p == proto and y > 0])
            ys = np.array([y for p, x, y in points if p == proto and y > 0])
            if len(xs) < 2 or np.ptp(xs) <= 0:
                continue
            a_mat = np.stack([1.0 / ys, xs / ys], axis=1)
            sol, _ = nnls(a_mat, np.ones(len(ys)))
            terms[proto] = (float(sol[0]), float(sol[1]))
        return cls(terms, source)


class Model:
    """Predicted seconds of candidates and of NCCL; simulations cached per (program, split, size)."""

    def __init__(self, profile: Profile, collective: str, ranks: int, nodes: int, gpus_per_node: int,
                 esize: int, fifo: dict[Protocol, Fifo], params: ModelParams, correction: Correction | None = None):
        self.profile, self.collective = profile, Collective.parse(collective)
        self.ranks, self.nodes, self.gpus_per_node, self.esize = ranks, nodes, gpus_per_node, esize
        self.fifo, self.params, self.links = fifo, params, Links.from_profile(profile)
        self.correction = correction or Correction()
        self._sim: dict[tuple, float] = {}

    def split(self, built: Built, nbytes: int) -> int:
        c = built.candidate
        return runtime_split(built.program, nbytes, self.esize, c.bytes_per_block, c.max_split)

    def simulated(self, built: Built, nbytes: int) -> float:
        """Seconds from the cost simulation alone (with the runtime's split and the input copy)."""
        split = self.split(built, nbytes)
        key = (built.candidate.program_key, split, nbytes)
        if key not in self._sim:
            t = simulate(split_program(built.program, split), nbytes, self.profile, self.gpus_per_node)
            copied = copy_bytes(built.program, nbytes)
            if copied:
                model, _ = self.profile.model(Collective.SENDRECV, Group(2, 1))
                t += copied * model.segment_for(copied).beta * LOCAL_BETA_FRACTION
            self._sim[key] = t
        return self._sim[key]

    def model_seconds(self, built: Built, nbytes: int) -> float:
        """Seconds from the interpreter cost model alone (no correction)."""
        c = built.candidate
        f = interp_model.features(built.program, nbytes, self.split(built, nbytes), c.tile_bytes, self.fifo,
                                  self.esize, self.gpus_per_node)
        return interp_model.predict(f, built.program.protocol, self.params, self.links)

    def predict(self, built: Built, nbytes: int) -> float:
        return self.correction.apply(built.candidate.protocol, self.model_seconds(built, nbytes))

    def nccl(self, nbytes: int) -> float:
        """NCCL's time from the profile's fit (the profile is a fit of NCCL itself)."""
        return self.profile.time(self.collective, nbytes, Group(self.ranks, self.nodes))
