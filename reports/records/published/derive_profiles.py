"""How the embedded profiles a100-80gb-nvlink+hdr200 and h100-nvlink+ib400 were built (run once from the
repository root: python reports/records/published/derive_profiles.py; it rewrites both JSON files).

h100-nvlink+ib400: compute and device measured on an H100 80GB HBM3 (python -m calibrate compute, 2026-11-27,
reports/records/transformer-h100-2026-11-27-run9/profile.json); the NVLink tier measured on H200 (same NVLink 4
generation and link count as the H100 SXM); the network ib400 (400 Gb/s per GPU; Llama 3's cluster: 400 Gb/s
RoCE per GPU, Dubey et al. 2024 §3.3.1).

a100-80gb-nvlink+hdr200: no A100 was lent, so the compute section is the H100's measured one carried over to
the A100 figure by figure, each scaled by a cited A100/H100 ratio (``scale`` below states which), with the
matmul per shape: the H100's measured efficiency at that shape relative to its best, times the A100's cited
best (MAMF 267.9 TFLOP/s of 312, Bekman, ml-engineering, compute/accelerator/README.md, "Maximum Achievable
Matmul FLOPS comparison table", CUDA 12.1). Selene's nodes (Narayanan et al. 2021 §5.1): 8 A100 80 GB on
NVLink/NVSwitch, 8 HDR InfiniBand 200 Gb/s HCAs (one per GPU).
"""
import copy
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROFILES = ROOT / "calibrate" / "profiles"
H100 = json.loads((ROOT / "reports/records/transformer-h100-2026-11-27-run9/profile.json").read_text())
NVLINK = json.loads((PROFILES / "h200-nvlink.json").read_text())
IB400 = json.loads((PROFILES / "ib400.json").read_text())
GI = 2**30
FRAG = {"fraction": 0.10, "source": "the default allowance (calibrate.profile.DEFAULT_FRAGMENTATION): GMLake "
        "(Guo et al., ASPLOS 2024, abstract) measures torch's caching allocator wasting 9.2 GB on average over "
        "eight LLM training runs on A100 80 GB (11.5% of the card); not yet measured here "
        "(tests/gpu/fragmentation.py)"}


def assumed_tier(alpha: float, beta: float, name: str) -> dict:
    seg = {"min_bytes": 0.0, "max_bytes": 4.611686018427388e18, "alpha": alpha, "beta": beta,
           "fit": {"assumed": name}}
    return {c: {"2": {"segments": [dict(seg)]}} for c in
            ("allreduce", "allgather", "reducescatter", "alltoall", "broadcast", "sendrecv")}


def h100() -> dict:
    out = {"kind": "commtune.profile", "version": 1, "name": "h100-nvlink+ib400",
           "provenance": {"kind": "combined",
                          "intra": {"from": "h200-nvlink", **NVLINK["provenance"],
                                    "note": "measured on H200: the H100 SXM has the same NVLink 4 (18 links, "
                                            "900 GB/s per GPU)"},
                          "inter": {"from": "ib400", **IB400["provenance"]},
                          "compute": {"from": "reports/records/transformer-h100-2026-11-27-run9/profile.json",
                                      "kind": "measured"}},
           "hardware": {"gpu": "NVIDIA H100 80GB HBM3 (SXM)", "gpus_per_node": 8,
                        "intra": "NVLink 4, 900 GB/s per GPU", "inter": "400 Gb/s per GPU, one NIC each"},
           "software": NVLINK["software"], "timing_mode": NVLINK["timing_mode"],
           "tiers": {"intra": NVLINK["tiers"]["intra"], "inter": IB400["tiers"]["inter"]},
           "compute": H100["compute"], "device": H100["device"],
           "bandwidth_per": {"intra": {"per": "gpu", "source": "NVLink: each GPU's own 18 links"},
                             "inter": IB400["bandwidth_per"]["inter"]},
           "memory_fragmentation": FRAG}
    return out


A100_PEAK, A100_MAMF = 312e12, 267.9e12
H100_PEAK = 989e12
BW = 2039e9 / 3350e9  # HBM2e 2,039 GB/s (A100 80 GB SXM datasheet) over HBM3 3,350 GB/s (H100 SXM datasheet)


def a100() -> dict:
    c = copy.deepcopy(H100["compute"])
    best = max(f / t for f, t in c["matmul"]["2"]["points"])
    pts = []
    for f, t in c["matmul"]["2"]["points"]:
        eff = (f / t) / best * A100_MAMF  # the same share of the card's best as the H100 at this shape
        pts.append([f, max(f / eff, t)])  # never faster than the H100 at the same shape
    c["matmul"]["2"] = {"peak_flops": A100_PEAK, "points": pts}
    f32 = [[f, t * 67e12 / 19.5e12] for f, t in c["matmul"]["4"]["points"]]  # FP32: 67 vs 19.5 TFLOP/s datasheets
    c["matmul"]["4"] = {"peak_flops": 19.5e12, "points": f32}
    for key in ("attention", "attention_backward", "attention_copies", "attention_copies_backward"):
        for size, band in c.get(key, {}).items():  # the unfused core is memory-bound: scaled by HBM bandwidth
            band["points"] = [[x, t / BW] for x, t in band["points"]]
            band["peak_flops"] = A100_PEAK if size == "2" else 19.5e12
    for size, s in c.get("sdpa", {}).items():  # flash attention is matmul-bound: the matmul's best, A100 / H100
        k = best / A100_MAMF if size == "2" else 67e12 / 19.5e12
        s["points"] = [dict(p, forward_s=p["forward_s"] * k, backward_s=p["backward_s"] * k) for p in s["points"]]
    c["memory_Bps"] *= BW
    c["op_Bps"] = {k: v * BW for k, v in c["op_Bps"].items()}
    c["layer_s"] = {k: [x / BW for x in v] for k, v in c["layer_s"].items()}
    c["kind"] = "assumed"
    c["source"] = ("the H100's measured compute (python -m calibrate compute, 2026-11-27, reports/records/"
                   "transformer-h100-2026-11-27-run9) scaled to the A100 80 GB SXM by cited ratios "
                   "(reports/records/published/derive_profiles.py)")
    c["sources"] = {
        "matmul.2": f"per shape: the H100's measured efficiency relative to its best ({best / 1e12:.0f} TFLOP/s) "
                    "times the A100 SXM's measured best, MAMF 267.9 TFLOP/s (85.9% of 312; Bekman, ml-engineering, "
                    "compute/accelerator/README.md, CUDA 12.1)",
        "matmul.4": "the H100's measured FP32 times 19.5 / 67 (A100 and H100 SXM datasheets)",
        "attention": "the H100's measured unfused core (memory-bound) times 3,350 / 2,039 (HBM bandwidth, datasheets)",
        "sdpa": f"the H100's measured flash attention times {best / A100_MAMF:.2f} (the matmul bests, H100 / A100)",
        "memory_Bps": "the H100's measured copy times 2,039 / 3,350 (HBM bandwidth, datasheets)",
        "op_Bps": "the H100's measured rates times 2,039 / 3,350", "layer_s": "the H100's measured rates times 2,039 / 3,350",
        "layer_call_s": "the H100's measured per-call costs (launch-bound, carried as they are)",
        "launch_s": "the H100's measured launch (host-bound, carried as it is)",
    }
    total = 81920 * 2**20
    out = {"kind": "commtune.profile", "version": 1, "name": "a100-80gb-nvlink+hdr200",
           "provenance": {"kind": "assumed", "sources": {
               "intra.beta": "NVLink 3 / NVSwitch, 600 GB/s per A100 both directions (300 GB/s each way); 230 GB/s "
                             "taken as achievable NCCL busbw (about 77%, as gcp-a100)",
               "intra.alpha": "2 us per ring step: assumed NCCL NVLink hop latency; not measured",
               "inter.beta": "Narayanan et al. 2021 §5.1 (Selene): eight 200 Gb/s HDR InfiniBand HCAs per node of 8 "
                             "A100, one per GPU = 25 GB/s line rate per GPU; 23 GB/s taken as achievable (92%, as ib400)",
               "inter.alpha": "4 us per ring step: assumed NCCL inter-node hop latency over InfiniBand; not measured"}},
           "hardware": {"gpu": "NVIDIA A100 80 GB SXM", "gpus_per_node": 8, "intra": "NVLink 3 600 GB/s per GPU",
                        "inter": "InfiniBand HDR 200 Gb/s, one HCA per GPU"},
           "software": {}, "timing_mode": "assumed",
           "tiers": {"intra": assumed_tier(2e-6, 1 / 230e9, "a100-80gb-nvlink+hdr200"),
                     "inter": assumed_tier(4e-6, 1 / 23e9, "a100-80gb-nvlink+hdr200")},
           "compute": c,
           "device": {"name": "NVIDIA A100-SXM4-80GB", "total_bytes": total, "usable_bytes": total - GI,
                      "source": "total: 81920 MiB as nvidia-smi reports the A100-SXM4-80GB (assumed); usable = "
                                "total less 1 GiB for the CUDA context and the kernels (assumed, as gcp-a100)"},
           "bandwidth_per": {"intra": {"per": "gpu", "source": "NVLink: each A100's own 12 links"},
                             "inter": {"per": "gpu", "source": "one 200 Gb/s HDR HCA per GPU (Narayanan et al. "
                                                               "2021 §5.1)"}},
           "memory_fragmentation": FRAG}
    return out


for prof in (h100(), a100()):
    (PROFILES / f"{prof['name']}.json").write_text(json.dumps(prof, indent=1) + "\n")
    print("wrote", PROFILES / f"{prof['name']}.json")
