"""A plan's training steps on a real nn.Module placed by ``autotune.apply``: the reference
modules of the transformer family (``models.modules:build``) by default, or a user's factory
(``--module package.module:factory``, called with the plan's model config dict; the module's
``forward(ids, targets)`` returns the mean loss over the micro-batch's tokens).

The step is the user's recipe: fp32 parameters (float64 for the CPU correctness tests), bf16
autocast on CUDA when the plan's activations are 16-bit, AdamW (fused on CUDA), the plan's
micro-batches accumulated before one optimizer step. Every process draws the micro-batch (token ids
and targets from the step's seed) and feeds its piece (``autotune.data_piece``); the loss and its
backward run under ``loss_parallel`` (logits split by vocabulary stay split).

Measured: steps back to back, each the time between CUDA events at its boundaries (the host's clock on
CPUs), the host's issue time, peak memory by phase, the loss, and under the profiler the time in
collectives (and on GPUs its exposed part and the device time by kernel family).
"""
from __future__ import annotations

import contextlib

import statistics
import time

from calibrate.errors import UserError

from calibrate.measure.engine import TorchGroup
from calibrate.measure.torcharm import mark, span
from calibrate.usermodule import loss_of
from calibrate.optional import require_torch
from calibrate.run_limits import host_available_bytes

from autotune.apply.batch import data_piece, param_groups
from autotune.apply.grads import accumulate
from autotune.execute import trace
from autotune.execute.usermodule import load_factory

torch = require_torch()

dist = torch.distributed


class FactoryError(UserError):
    """The user's factory failed: the same for every plan, so nothing more is tried."""


def build_module(spec: str, config: dict, seed: int, dtype, device, init=None):
    """The factory's module for the plan's model config, built under ``seed`` (the same weights on
    every process), its parameters in ``dtype`` on ``device``; ``init`` (a GPU): built there, under its own
    random generator (the factory's initialisation, at the GPU's speed), then moved."""
    factory = load_factory(spec)
    on = torch.device(init) if init is not None else None
    with torch.random.fork_rng(devices=[on] if on is not None and on.type == "cuda" else []), \
            on if on is not None else contextlib.nullcontext():
        torch.manual_seed(seed)
        try:
            model = factory(dict(config))
        except UserError:
            raise
        except Exception as e:  # the user's code: its error as one line, not a traceback on every rank
            raise FactoryError(f"{spec}(config) raised {type(e).__name__}: {e}: it is called with the plan's model "
                            f"config (a dict: kind, layers, hidden, ...); make it build the model from that") from None
    if not isinstance(model, torch.nn.Module):
        raise FactoryError(f"{spec} returned a {type(model).__name__}, not a torch.nn.Module: return the model")
    return model.to(device=device, dtype=dtype)


STEP_FIELDS = ("batch", "micro_batch")  # the step's shape in a plan's model config, not the model's


class BuildOnce:
    """``build_module`` for the plans one process runs in turn (``autotune tune``'s candidates). The first call
    builds the model and keeps a copy of its parameters and buffers. Each later call for the same model (its config
    but for ``STEP_FIELDS``: a pipelined candidate's micro-batches differ) builds the same module on the meta device
    (no initialisation) and fills it from that copy. On 2 x H200, a 1.5 B Llama's candidate took
    16-25 s to build, place and run, of which its 4 steps 2-3 s. The copy is kept only where this host's
    available memory holds it for each of ``local_ranks`` processes three times over. Otherwise, and wherever the
    meta build differs from the first, the model is built each time, as ``build_module``. ``init`` (this process's
    GPU): the first build initialised there and moved to the CPU (torchrun gives each process one CPU thread: the
    1.5 B Llama's initialisation took most of its first candidate's 35 s), on the CPU where that fails."""

    def __init__(self, local_ranks: int, available=host_available_bytes, init=None):
        self.local_ranks, self.available, self.init, self.kept = local_ranks, available, init, {}

    def __call__(self, spec: str, config: dict, seed: int, dtype, device):
        if torch.device(device).type != "cpu":
            return build_module(spec, config, seed, dtype, device)
        key = (spec, repr(sorted((k, v) for k, v in config.items() if k not in STEP_FIELDS)), seed, str(dtype))
        kept = self.kept.get(key)
        model = _filled(spec, config, dtype, kept) if kept is not None else None
        if model is not None:
            return model
        if self.init is not None:
            try:
                model = build_module(spec, config, seed, dtype, device, init=self.init)
            except (FactoryError, torch.OutOfMemoryError):  # refused there: on the CPU, where the user builds it
                pass
            torch.cuda.empty_cache()  # the GPU's copy given back before the candidate is placed
        model = model if model is not None else build_module(spec, config, seed, dtype, device)
        if kept is None:
            tensors = dict(_tensors(model))
            room = self.available()
            if room is not None and 3 * self.local_ranks * sum(t.numel() * t.element_size()
                                                               for t in tensors.values()) <= room:
                self.kept[key] = ({name: t.detach().clone() for name, t in tensors.items()}, _ties(model))
        return model


def _tensors(model):
    """Every (name, parameter or buffer) of ``model``, tied and shared ones under each of their names."""
    return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]


def _ties(model) -> dict:
    """name -> the first name holding the same tensor (the model's tied weights)."""
    first: dict = {}
    return {name: first.setdefault(id(t), name) for name, t in _tensors(model)}


def _filled(spec: str, config: dict, dtype, kept: tuple):
    """The factory's module built on the meta device, moved to the CPU and filled from ``kept`` (``BuildOnce``:
    the first build's tensors and ties; ties that the move to the CPU undid made again by a transformers model's
    ``tie_weights``); None where that build fails or its tensors are not ``kept``'s (names, shapes, dtypes, ties)."""
    values, ties = kept
    try:
        with torch.device("meta"):
            model = load_factory(spec)(dict(config))
        model = model.to_empty(device="cpu").to(dtype=dtype)
        if _ties(model) != ties and callable(getattr(model, "tie_weights", None)):
            model.tie_weights()
    except Exception:  # a factory that cannot build on the meta device: built as the first time
        return None
    tensors = dict(_tensors(model))
    if _ties(model) != ties or tensors.keys() != values.keys() or any(
            t.shape != values[k].shape or t.dtype != values[k].dtype for k, t in tensors.items()):
        return None
    with torch.no_grad():
        for name, t in tensors.items():
            t.copy_(values[name])
    return model


def forward_loss(model, ids, targets):
    """The mean loss of a step's micro-batch, as the README's training script and ``calibrate module`` take it: a
    Hugging Face causal LM (a factory may return one) called with ``input_ids`` and ``labels=targets``, its own
    loss (the labels shifted inside; the key/value cache as its config says); any other module as
    ``forward(ids, targets)``, returning the loss (``calibrate.usermodule.loss_of``: or nanoGPT's
    ``(logits, loss)``)."""
    inner = getattr(model, "module", model)  # DDP's wrapped module
    if hasattr(inner, "config") and hasattr(inner, "get_input_embeddings"):
        return model(input_ids=ids, labels=targets).loss
    return loss_of(model(ids, targets), "the --module factory")


def _gen(device, *keys: int):
    g = torch.Generator(device=device)
    seed = 0
    for k in keys:
        seed = (seed * 1_000_003 + k + 1) % (2**62)
    g.manual_seed(seed)
    return g


def token_batch(config: dict, seed: int, step: int, micro: int, device) -> tuple:
    """(ids, targets) of micro-batch ``micro`` of step ``step``, each (micro_batch, sequence)."""
    g = _gen(device, seed, 1_000_000 + step, micro)
    shape = (config["micro_batch"], config["sequence"])
    ids = torch.randint(0, config["vocabulary"], shape, generator=g, device=device)
    return ids, torch.randint(0, config["vocabulary"], shape, generator=g, device=device)


def _local(x):
    """A tensor's whole value on this process (a DTensor's full tensor)."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


class ModuleTrainer:
    def __init__(self, model, config: dict, micro_batches: int, d, seed: int, lr: float, autocast=None):
        """The step's loss is the mean of the ranks' pieces' losses."""
        self.model, self.config, self.micro_batches, self.d, self.seed = model, config, micro_batches, d, seed
        self.autocast_dtype = autocast
        self.opt = torch.optim.AdamW(param_groups(model), lr=lr, **({"fused": True} if d.is_gpu else {}))

    def close(self) -> None:
        self.opt.state.clear()
        self.opt = None

    def step(self, step: int, probe: dict | None = None):
        """One training step; returns the loss (mean over the step's tokens) as a tensor on the device."""
        if probe is not None:
            probe["before_step"] = self.d.peak_bytes()
        self.opt.zero_grad(set_to_none=True)
        total = self.forward_backward(step)
        if probe is not None:
            probe["forward_backward"] = self.d.peak_bytes()
        self.opt.step()
        if probe is not None:
            probe["optimizer_step"] = self.d.peak_bytes(reset=False)
        return total

    def autocast(self):
        """The step's autocast context (none where the parameters' dtype is the compute dtype)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.d.device.type, dtype=self.autocast_dtype)

    def forward_backward(self, step: int):
        """The step's micro-batches forward and backward (this rank's piece), gradients accumulated; the mean
        loss over the ranks."""
        from torch.distributed.tensor.parallel import loss_parallel
        total = None
        # the gradients reduced once a step, with the last micro-batch's backward (as priced)
        for j in accumulate(self.model, range(self.micro_batches)):
            ids, targets = data_piece(self.model, token_batch(self.config, self.seed, step, j, self.d.device))
            with loss_parallel():
                with self.autocast():
                    loss = forward_loss(self.model, ids, targets)
                (loss / self.micro_batches).backward()
            share = _local(loss.detach()) / self.micro_batches
            total = share if total is None else total + share
        dist.all_reduce(total)
        return total / self.d.launch.world

    def timed_steps(self, first: int, n: int, probe: dict | None = None, progress=None) -> tuple[list, list, list]:
        """Steps ``first`` .. ``first + n - 1`` from a synchronised start: (their losses, their times on the device's
        clock, the host's issue time of each)."""
        if self.d.is_gpu:
            torch.cuda.synchronize(self.d.device)
        dist.barrier()
        gpu = self.d.is_gpu
        marks, issue, losses = [mark(torch, gpu)], [], []
        for s in range(first, first + n):
            last = s == first + n - 1 and probe is not None
            t0 = time.perf_counter()
            losses.append(self.step(s, probe if last else None))
            issue.append(time.perf_counter() - t0)
            marks.append(mark(torch, gpu))
            if progress:
                progress(f"step {s + 1}/{first + n}: issued in {issue[-1] * 1e3:.1f} ms"
                         + ("" if gpu else f", loss {float(losses[-1]):.6g}"))
        if gpu:
            torch.cuda.synchronize(self.d.device)
        return [float(x) for x in losses], [span(a, b, gpu) for a, b in zip(marks, marks[1:])], issue

    def run(self, steps: int, warmup: int, profile_steps: int, progress=None) -> dict:
        probe = {}
        gpu = self.d.is_gpu
        if gpu:
            torch.cuda.reset_peak_memory_stats(self.d.device)
            retries = _retries(self.d)
        losses, times, issue = self.timed_steps(0, steps, probe, progress)
        peak = allocator = None
        if gpu:
            mine = torch.tensor([float(max(probe.values()))], device=self.d.device)
            out = [torch.zeros_like(mine) for _ in range(self.d.launch.world)]
            dist.all_gather(out, mine)
            peak = [int(x.item()) for x in out]
            allocator = {"retries": int(_slowest(float(_retries(self.d) - retries), self.d)),
                         "reserved_bytes": int(_slowest(float(torch.cuda.memory_reserved(self.d.device)), self.d))}
        res = {"losses": losses, "step_times_s": times, "step_s": _slowest(statistics.median(times[warmup:]), self.d),
               "host_issue_s": _slowest(statistics.median(issue[warmup:]), self.d), "peak_memory_bytes": peak,
               "allocator": allocator,
               "peak_memory_phases_bytes": {k: _slowest(float(v), self.d) for k, v in probe.items()} if gpu else None,
               "comm_s": None, "comm_source": "not profiled", "exposed_comm_s": None, "device_time_s": None,
               "top_kernels": None, "layer_clock": None}
        if profile_steps:
            res.update(self._profile(steps, profile_steps, losses))
        return res

    def _profile(self, first: int, n: int, losses: list) -> dict:
        return profiled(self.d, n, lambda: losses.extend(self.timed_steps(first, n)[0]))


def profiled(d, n: int, run) -> dict:
    """The time in collectives per step of ``run()`` (``n`` steps) under the torch profiler; on GPUs
    also its exposed part, the device's idle time and the device time by kernel family."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if d.is_gpu else [])
    with profile(activities=acts, acc_events=True) as prof:
        run()
    if not d.is_gpu:
        total = sum(e.cpu_time_total for e in prof.key_averages() if e.key.startswith("gloo:"))
        return {"comm_s": _slowest(total / 1e6 / n, d), "comm_source": "torch profiler: gloo operations (CPU time)"}
    events = [trace.DeviceEvent(e.name, e.time_range.start, e.time_range.end,
                                bool(getattr(e, "is_user_annotation", False)))
              for e in prof.events() if e.device_type == DeviceType.CUDA]
    comm, busy = trace.split(events)
    return {"comm_s": _slowest(sum(b - a for a, b in comm) / 1e6 / n, d),
            "comm_source": "torch profiler: time inside NCCL kernels (includes their waiting for the peer and "
                           "their slowdown by concurrent compute)",
            "exposed_comm_s": _slowest(trace.exposed_time(comm, busy) / 1e6 / n, d),
            "device_idle_s": _slowest(trace.idle_time(events) / 1e6 / n, d),
            "device_time_s": trace.breakdown(events, n), "top_kernels": trace.top_kernels(events, n)}


def _retries(d) -> int:
    """The caching allocator's retries so far on ``d``'s GPU: a request it could not serve from its cache or a new
    segment, served after freeing every cached block (a device-wide synchronisation each: a step near the memory
    limit runs slower than its kernels)."""
    return int(torch.cuda.memory_stats(d.device).get("num_alloc_retries", 0))


def _slowest(x: float, d) -> float:
    """The largest of every rank's ``x`` (the measurement engine's maximum over ranks)."""
    return float(TorchGroup(d.device).max([x])[0])
