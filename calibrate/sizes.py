"""Message sizes: parsing of K/M/G suffixes and the geometric sweep of nccl-tests."""
from __future__ import annotations

import math
import re

import numpy as np

from calibrate.collectives import Collective, rank_divides
from calibrate.device.dtypes import dtype_size
from calibrate.errors import OptionError, UserError

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'64K' -> 65536, '1G' -> 2**30, '4096' -> 4096 (binary units, as nccl-tests)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise UserError(f"bad size {text!r}: write a number with an optional K, M or G suffix, e.g. 64K")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    return int(value)


def format_size(nbytes: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{int(nbytes // scale)}{unit}"
    return f"{int(nbytes)}"


def snap(n: float, bits: int = 4) -> int:
    """Round to ``bits`` significant bits (a multiple of 2**(floor(log2 n) - bits + 1)).

    Powers of two stay exact despite floating-point drift in the product, and the
    sizes between them are multiples of large powers of two (1.375 * 2**k, 1.5 *
    2**k, ...): NCCL is markedly slower at sizes that are not (seen on 2x H200,
    2026-11-22: a 1448-byte-stepped sweep put allgather of 2.97 MB at 28 us
    against 26 us for 4 MiB), which the alpha-beta model should not absorb.
    """
    if n < 2 ** bits:
        return max(int(round(n)), 1)
    granule = 2 ** (int(math.floor(math.log2(n))) - bits + 1)
    return int(round(n / granule)) * granule


def sweep(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """The geometric sweep min, min*factor, ... up to max, and max itself where the series falls short
    of it (nccl-tests stops below: 1408 B..1 GiB by x2 ends at 704 MiB, and every size above that was
    the fit's extrapolation), each size rounded to 4 significant bits (``snap``) except the two ends."""
    if min_bytes <= 0 or max_bytes <= 0:
        raise OptionError("min_bytes", "and {max_bytes}: sizes must be positive; give both above zero")
    if min_bytes > max_bytes:
        raise OptionError("min_bytes", f"({format_size(min_bytes)}) is larger than {{max_bytes}} "
                                       f"({format_size(max_bytes)}): swap them")
    if not (1 < factor < math.inf):
        raise OptionError("factor", f"must be above 1 and finite, got {factor}")
    sizes, n = [], float(min_bytes)
    while n <= max_bytes * (1 + 1e-9):
        sizes.append(min(max(snap(n), min_bytes), max_bytes))
        n *= factor
    return sorted({*sizes, max_bytes})


def odd_multiple(nbytes: int, unit: int) -> int:
    """The odd multiple of ``unit`` next to ``nbytes`` (``unit`` itself below it): a size aligned to
    ``unit`` and to nothing larger. NCCL runs sizes that are multiples of 8 KiB up to 8% faster at
    48-250 KiB than the sizes around them (2 x H200, 2026-11-23); a sweep on such sizes (2^k, 11 * 2^k)
    draws the lower edge of the curve, where most sizes (users', or ones drawn at random) are not."""
    if unit < 1:
        raise OptionError("size_unit", f"must be at least 1 byte, got {unit}")
    return max(nbytes // (2 * unit), 0) * 2 * unit + unit


def align(coll: Collective, nbytes: int, p: int, dtype: str) -> tuple[int, int]:
    """(bytes, count) after rounding as nccl-tests does.

    The whole buffer holds a whole number of elements, and for the collectives
    that split the buffer among ranks a multiple of p elements; sizes are rounded
    down (never below one element per rank). Returns the rounded size in bytes
    and nccl-tests' count column (elements of the whole buffer for allreduce,
    broadcast and sendrecv, per rank for the others).
    """
    esize = dtype_size(dtype)
    count = max(nbytes // esize, 1)
    if rank_divides(coll):
        per_rank = max(count // p, 1)
        return per_rank * p * esize, per_rank
    return count * esize, count


def rounded_note(coll: Collective, requested: int, actual: int, p: int) -> str | None:
    if requested == actual:
        return None
    return (f"note: {coll.value} size {requested} B rounded to {actual} B "
            f"(a whole number of elements{' for each of the ' + str(p) + ' ranks' if rank_divides(coll) else ''})")


def np_dtype(dtype: str):
    if dtype == "bfloat16":
        raise OptionError("dtype", "bfloat16 has no host (numpy) type: use float16 or float32 with the mpi backend")
    return np.dtype(dtype)
