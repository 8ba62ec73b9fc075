"""The caching allocator's recorded history (``torch.cuda.memory._snapshot()`` after
``_record_memory_history``) replayed: the most bytes alive at once and what was alive then, by where it was
allocated (``site`` of an allocation's frames, or the caller's)."""

# where a block comes from: the innermost frame of the project, transformers, torch's nn / optim / autograd /
# distributed code or the GPU scripts that build models
KEEP = ("/autotune/", "/transformers/", "/torch/nn/", "/torch/optim/", "/torch/autograd/", "/torch/distributed/",
        "/torch/utils/checkpoint", "apply_llama", "calib_module_check", "transformer_check")


def site(frames) -> str:
    """The innermost ``KEEP`` frame of an allocation: file (below site-packages or the checkout), line, function."""
    for f in frames:
        name = f.get("filename", "")
        if any(k in name for k in KEEP):
            return f"{name.split('/site-packages/')[-1].split('/main/')[-1]}:{f.get('line')} {f.get('name')}"
    return "(other)"


def peak_live(snapshot: dict, device: int, site, before: int = 0) -> tuple[int, str | None, dict]:
    """(peak bytes, the site of the allocation that reached it, {site: [bytes, tensors]} alive then), counting
    ``before`` bytes alive before the history started."""
    live, total, peak, at, peak_live_blocks = {}, before, before, None, {}
    for e in snapshot["device_traces"][device]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], site(e.get("frames") or []))
            total += e["size"]
            if total > peak:
                peak, at, peak_live_blocks = total, live[e["addr"]][1], dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    sites: dict[str, list] = {}
    for size, where in peak_live_blocks.values():
        entry = sites.setdefault(where, [0, 0])
        entry[0] += size
        entry[1] += 1
    return peak, at, sites


def traced_step(torch, step, site, max_entries: int = 2_000_000) -> tuple[int, int, str | None, dict]:
    """``step()`` run once under the allocator's history: (bytes alive before it, ``peak_live``'s peak, the site
    that reached it, the sites alive then)."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    before = torch.cuda.memory_allocated()
    try:
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return (before, *peak_live(snap, torch.cuda.current_device(), site, before))
