"""``python -m calibrate profiles``: list the embedded profiles with their provenance;
``--combine INTRA INTER -o OUT.json``: one profile whose intra tier comes from one
profile and inter tier from another (e.g. a measured node and an assumed network)."""
from __future__ import annotations

import datetime as _dt

from calibrate.cli import command_parser
from calibrate.errors import UserError
from calibrate.profile import DEFAULT_PROFILE, Profile, embedded_profile_names


def combine(intra: Profile, inter: Profile, name: str) -> Profile:
    for prof, tier in ((intra, "intra"), (inter, "inter")):
        if not prof.tiers.get(tier):
            raise UserError(f"profile {prof.name!r} has no {tier} tier to take: choose another")
    return Profile(
        name=name,
        provenance={"kind": "combined", "created": _dt.datetime.now().isoformat(timespec="seconds"),
                    "intra": {"from": intra.name, **intra.provenance},
                    "inter": {"from": inter.name, **inter.provenance}},
        hardware={"intra": intra.hardware, "inter": inter.hardware},
        software=intra.software,
        timing_mode=intra.timing_mode,
        tiers={"intra": intra.tiers["intra"], "inter": inter.tiers["inter"]},
        compute=intra.compute,  # the GPUs are the intra profile's
        device=intra.device or inter.device,
        bandwidth_per={t: f for prof, t in ((intra, "intra"), (inter, "inter")) if t in prof.bandwidth_per
                       for f in (prof.bandwidth_per[t],)},
        fragmentation=intra.fragmentation or inter.fragmentation,
    )


def main(argv=None) -> int:
    p = command_parser("python -m calibrate profiles",
                description="List embedded profiles, or combine two into one.")
    p.add_argument("--combine", nargs=2, metavar=("INTRA", "INTER"),
                   help="take the intra tier of INTRA and the inter tier of INTER")
    p.add_argument("-o", "--out", help="output JSON for --combine")
    p.add_argument("--name", help="name of the combined profile. Default INTRA+INTER")
    args = p.parse_args(argv)
    if args.combine:
        if not args.out:
            raise UserError("--combine needs -o OUT.json")
        a, b = (Profile.load(x) for x in args.combine)
        path = combine(a, b, args.name or f"{a.name}+{b.name}").save(args.out)
        print(f"wrote {path}")
        return 0
    print(f"{'name':<22} {'provenance':<10} {'tiers':<12} {'bandwidth per':<30} {'timing':<9} source")
    for name in embedded_profile_names():
        prof = Profile.load(name)
        prov = prof.provenance
        kind = prov.get("kind", "?")
        if kind == "measured":
            src = "; ".join(f"{r.get('created')} {r.get('command', '')}"[:90] for r in prov.get("runs", []))
        elif kind == "combined":
            src = f"intra from {prov['intra']['from']} ({prov['intra'].get('kind')}), " \
                  f"inter from {prov['inter']['from']} ({prov['inter'].get('kind')})"
        else:
            src = "; ".join(f"{k}: {v}" for k, v in prov.get("sources", {}).items())[:200]
        mark = " (default)" if name == DEFAULT_PROFILE else ""
        per = ", ".join(f"{t} per {prof.per(t)}" for t in sorted(prof.tiers))
        print(f"{name + mark:<22} {kind:<10} {','.join(sorted(prof.tiers)):<12} {per:<30} {prof.timing_mode:<9} {src}")
    return 0
