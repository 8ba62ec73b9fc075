"""The plan's model on this device: the local pieces of every layer's weights (one
set per position in the chain: tied layers share a plan, not weights) and the
forward of one micro-batch through the chain with the plan's boxings between
layers. The residual stream is not modelled, as in the plan's layer graph."""
from __future__ import annotations

import contextlib
import math

from calibrate.errors import UserError

from autotune.execute import ops
from autotune.execute.data import init_weight
from autotune.execute.layout import box
from autotune.execute.planread import LayerSpec


class PlanModel:
    def __init__(self, graph, specs: list[LayerSpec], ctx: ops.Ctx, seed: int, param_dtype, device):
        self.graph, self.specs, self.ctx = graph, specs, ctx
        self.params: list[dict] = []  # per chain position: weight name -> local leaf tensor
        for pos, v in enumerate(graph.chain):
            spec = specs[v]
            local = {}
            for name, shape, fine in spec.weights:
                full = init_weight(spec.kind, shape, seed, pos, param_dtype, device)
                local[name] = ctx.piece(full, fine).requires_grad_(True)
                del full
            self.params.append(local)

    def weight_fines(self):
        """(local leaf, whole shape, fine placements) of every weight."""
        for pos, v in enumerate(self.graph.chain):
            shapes = {n: (s, f) for n, s, f in self.specs[v].weights}
            for name, p in self.params[pos].items():
                yield p, shapes[name][0], shapes[name][1]

    def release(self) -> None:
        """Free the weights and their gradients (before the next plan runs)."""
        for local in self.params:
            for p in local.values():
                p.grad = None
        self.params = []

    def layer_names(self) -> list[tuple[str, str]]:
        """(layer name, kind) of each chain position."""
        return [(self.specs[v].layer.name, self.specs[v].kind) for v in self.graph.chain]

    def parameters(self) -> list:
        return [p for p, _, _ in self.weight_fines()]

    def forward(self, data: dict, loss_scale: float, around=None, after=None):
        """(this device's share of the loss, how many devices hold the same share). ``around(pos)``,
        if given, is a context manager entered around each layer (its input boxing and its op);
        ``after(pos, out)``, if given, is called with each layer's output."""
        ctx, x, prev = self.ctx, None, None
        for pos, v in enumerate(self.graph.chain):
            spec = self.specs[v]
            with around(pos) if around else contextlib.nullcontext():
                if spec.input is not None:
                    if x is None:
                        x = ctx.piece(data["x"], spec.input)
                    else:
                        x = box(x, ctx.mesh, spec.in_shape, prev, spec.input, grad_dst=spec.grad_in, log=ctx.log)
                weights = {n: p.to(ctx.dtype) for n, p in self.params[pos].items()}
                x = ops.forward(ctx, spec, x, weights, data, loss_scale)
            if after:
                after(pos, x)
            prev = spec.output
        last = self.specs[self.graph.chain[-1]]
        if last.kind != "loss":
            raise UserError(f"the model ends in {last.layer.name}, not a loss layer: re-run the search with this version")
        # devices that differ only along the vocabulary axes compute the same share
        return x, math.prod(n for p, n in zip(last.input, ctx.axis_sizes) if p != "S0")
