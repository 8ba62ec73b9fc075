"""The caching allocator's recorded history (``torch.cuda.memory._snapshot()`` after
``_record_memory_history``) replayed: the most bytes alive at once and what was alive then, by where it was
allocated (the caller's ``site`` of an allocation's frames)."""


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
