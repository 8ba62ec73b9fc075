"""Timing the user's own transformer module (``calibrate.usermodule``) on one device: ``python -m calibrate module``
writes the profile's ``module`` section (``calibrate.module``; the rule there).

One block is timed, not the whole model: a model of ``1 + MORE`` blocks less one of one block, over ``MORE`` (the
difference of two whole models' times is noisy where the layers outside the blocks dominate, a large vocabulary's;
``MORE`` blocks divide the noise), each at every local shape (tensor width, micro-batch, sequence), through the
measurement engine (``calibrate.measure``: arms interleaved in rounds, the median); the widths shared out to the
visible GPUs (``lane_shares``); then the host's cost of each apply path (``calibrate.modulehost``) and the model's
slowdown beside collectives (``calibrate.overlap``).
"""
from __future__ import annotations

import sys
from dataclasses import replace

from calibrate.device.peers import run_each
from calibrate.errors import UserError
from calibrate.measure.torcharm import TorchArm, medians, timing
from calibrate.module import ModulePoint, ModuleSection
from calibrate.modulehost import host_seconds, peer_host
from calibrate.overlap import module_overlap
from calibrate.usermodule import MORE, Timed, UserModule, rebuild


def _arm(torch, device, fn):
    return lambda: TorchArm(torch, device, fn)


def time_point(torch, um: UserModule, models: dict, t: int, micro_batch: int, sequence: int, iters: int,
               warmup: int) -> ModulePoint:
    """One local shape: both models' arms interleaved in one comparison (a slow spell falls on all alike)."""
    one, two = models[1], models[1 + MORE]
    vocab = um.model["vocabulary"] // t
    for m in (one, two):
        m.inputs(micro_batch, sequence, vocab)
        m.both(0)  # gradients present for the optimizer's arm; the lazily made state made
        m.opt.step()
    can_recompute = um.checkpoint(one.model, False)
    arms = []
    for n, m in ((1, one), (2, two)):
        arms += [(f"f{n}", _arm(torch, m.device, m.forward)), (f"fb{n}", _arm(torch, m.device, m.both)),
                 (f"o{n}", _arm(torch, m.device, m.step))]
        arms.append((f"s{n}", _arm(torch, m.device, m.user_step)))
        if can_recompute:
            arms.append((f"rc{n}", _arm(torch, m.device, m.recompute)))
    med = medians(torch, arms, timing(iters, warmup, back_to_back=True))
    f = {n: med[f"f{n}"] for n in (1, 2)}
    b = {n: max(med[f"fb{n}"] - med[f"f{n}"], 0.0) for n in (1, 2)}
    o = {n: med[f"o{n}"] for n in (1, 2)}
    fwd = {n: m.forward_bytes() or (None, None) for n, m in ((1, one), (2, two))}  # (kept, peak) each
    kept = {n: k for n, (k, _) in fwd.items()}
    act = max(kept[2] - kept[1], 0) / MORE if kept[1] is not None else None
    block = {"forward_s": max(f[2] - f[1], 0.0) / MORE, "backward_s": max(b[2] - b[1], 0.0) / MORE,
             "optimizer_s": max(o[2] - o[1], 0.0) / MORE,
             "recompute_s": max((med["rc2"] - med["fb2"]) - (med["rc1"] - med["fb1"]), 0.0) / MORE
             if can_recompute else None,
             "activation_bytes": act, "step_s": max(med["s2"] - med["s1"], 0.0) / MORE,
             "forward_transient_bytes": max((fwd[2][1] - fwd[1][1]) / MORE - act, 0.0) if act is not None else None}
    outside = {"forward_s": max(f[1] - block["forward_s"], 0.0), "backward_s": max(b[1] - block["backward_s"], 0.0),
               "optimizer_s": max(o[1] - block["optimizer_s"], 0.0),
               "activation_bytes": max(kept[1] - act, 0) if act is not None else None,
               "step_s": max(med["s1"] - block["step_s"], 0.0), "peak_bytes": one.step_peak()}
    return ModulePoint(t, micro_batch, sequence, block, outside)


def time_widths(torch, um: UserModule, widths, micro_batches, sequence: int, device, iters: int, warmup: int,
                progress) -> list[ModulePoint]:
    """The points of ``widths`` x ``micro_batches`` at ``sequence`` on ``device``, one width's models at a time; a
    shape that runs out of memory is skipped, said."""
    points = []
    oom = getattr(torch.cuda, "OutOfMemoryError", MemoryError)
    for t in widths:
        models = {n: Timed(torch, um, n, t, device) for n in (1, 1 + MORE)}
        for mb in micro_batches:
            try:
                p = time_point(torch, um, models, t, mb, sequence, iters, warmup)
            except oom:
                progress(f"tensor {t}, micro-batch {mb}, sequence {sequence}: out of memory, skipped")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            except UserError:
                raise
            except Exception as e:
                fix = ("its model is built from the fields (heads, kv_heads, ffn, vocabulary divided by the width) "
                       "and called as forward(ids, targets), returning the loss (or nanoGPT's (logits, loss)): make "
                       "it so, or " if um.recipe[:1] == ("factory",) else "")
                raise UserError(f"{um.name} could not be timed at tensor width {t}, micro-batch {mb}, sequence "
                                f"{sequence}: {type(e).__name__}: {str(e)[:200]}: {fix}give --tensor, "
                                f"--micro-batches or --sequence it takes") from None
            points.append(p)
            bl = p.block
            progress(f"tensor {t}, micro-batch {mb}, sequence {sequence}: block {bl['forward_s'] * 1e3:.3f} ms forward, "
                     f"{bl['backward_s'] * 1e3:.3f} ms backward, optimizer {bl['optimizer_s'] * 1e3:.3f} ms; "
                     f"outside {p.outside['forward_s'] * 1e3:.3f} / {p.outside['backward_s'] * 1e3:.3f} ms"
                     + (f"; kept for the backward: block {bl['activation_bytes'] / 2**20:.1f} MiB, outside "
                        f"{p.outside['activation_bytes'] / 2**20:.1f} MiB" if bl["activation_bytes"] is not None
                        else ""))
        models = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return points


def lane_shares(widths, lanes: int) -> list[tuple[int, ...]]:
    """``widths`` shared out to ``lanes``: a width's shapes cost about 1 / width (its local shapes' size), each width,
    the costliest first, to the lane with the least so far (2 x H200, an 8 B Llama: width 1 took 37 s of the 77)."""
    shares: list[list[int]] = [[] for _ in range(lanes)]
    for t in sorted(widths):
        min(shares, key=lambda share: sum(1 / w for w in share)).append(t)
    return [tuple(share) for share in shares]


def _widths_job(torch, device, recipe: tuple, widths, micro_batches, sequence: int, iters: int, warmup: int,
                prefix: str) -> dict:
    """``time_widths`` in a process of ``measure``'s lanes, its progress lines on stderr under ``prefix``."""
    points = time_widths(torch, rebuild(recipe), widths, micro_batches, sequence, device, iters, warmup,
                         lambda msg: print(f"{prefix}{msg}", file=sys.stderr, flush=True))
    return {"points": [p.to_dict() for p in points]}


def measure(torch, um: UserModule, widths, micro_batches, sequence: int, device, iters: int, warmup: int,
            progress, source: str, host: bool = True, save=None, lanes: int = 1) -> ModuleSection:
    """The module section of ``um`` at every (tensor width, micro-batch) of ``widths`` x ``micro_batches``
    and ``sequence`` (module docstring; ``time_widths``). With ``lanes`` above 1 the widths are shared out
    (``lane_shares``) to that many processes (``calibrate.device.peers.run_each``: one GPU each, GPUs 0 to
    lanes - 1, each width on one GPU as alone; on the CPU, processes: tests), else timed one after the other
    on ``device``.
    ``save`` (given) is called with the section of the timed shapes before the host's cost is measured: an
    interrupted run keeps them."""
    bad = [t for t in widths if t not in um.widths]
    if bad:
        raise UserError(f"{um.name}: tensor width {bad[0]} does not divide its heads, K/V heads, MLP and vocabulary "
                        f"(widths it can take: {', '.join(map(str, um.widths))})")
    lanes = min(lanes, len(widths)) if um.recipe else 1
    if lanes > 1:
        progress(f"tensor widths {', '.join(map(str, widths))} shared out to {lanes} "
                 f"{'GPUs' if device.type == 'cuda' else 'processes'}, each timing its widths alone")
        got = run_each(_widths_job, [(um.recipe, share, micro_batches, sequence, iters, warmup, f"[module] lane {i}: ")
                                     for i, share in enumerate(lane_shares(widths, lanes))],
                       "timing the tensor widths", device.type)
        points = sorted((ModulePoint(**p) for g in got for p in g["points"]), key=lambda p: p.key)
        progress(f"{len(points)} shapes timed on {lanes} lanes")
    else:
        points = time_widths(torch, um, widths, micro_batches, sequence, device, iters, warmup, progress)
    if not points:
        raise UserError(f"{um.name}: no shape could be timed (each ran out of memory): give smaller --micro-batches "
                        f"or --sequence")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    section = ModuleSection(source, um.name, um.model, tuple(points),
                            "fp32 weights, bf16 autocast, fused AdamW" if device.type == "cuda"
                            else "fp32 weights, fp32 (no autocast on the CPU), AdamW", name)
    if not host:
        return section
    if save is not None:
        save(section)
    memory: dict = {}
    hosts = host_seconds(torch, um, min(micro_batches), sequence, device, iters, warmup, progress, memory=memory)
    outside, overlap = {}, {}
    if device.type == "cuda":
        peers, outside, _ = peer_host(torch, um.recipe, min(micro_batches), sequence, device, iters, warmup,
                                      progress)
        hosts.update(peers)
        overlap = module_overlap(torch, um.recipe, min(micro_batches), sequence, iters, warmup, progress)
    return replace(section, host_s=hosts, host_outside_s=outside, memory=memory, overlap=overlap)
