"""Element types: one table for sizes, NCCL's enum, device storage and rounding."""
from __future__ import annotations

from dataclasses import dataclass

from calibrate.errors import UserError


@dataclass(frozen=True)
class DType:
    name: str
    bytes: int
    nccl: int          # ncclDataType_t
    storage: str       # the array dtype holding it (cupy and numpy have no bfloat16)
    unit_roundoff: float


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("float32", 4, 7, "float32", 2.0 ** -23),
    DType("float16", 2, 6, "float16", 2.0 ** -10),
    DType("bfloat16", 2, 9, "uint16", 2.0 ** -7),
    DType("float64", 8, 8, "float64", 2.0 ** -52),
    DType("int32", 4, 2, "int32", 0.0),
    DType("int8", 1, 0, "int8", 0.0),
)}
# moved by the resharding executor besides the measured types above
EXTRA_DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("int64", 8, 4, "int64", 0.0),
    DType("uint8", 1, 1, "uint8", 0.0),
)}


def dtype_info(name: str, allowed: dict[str, DType] = DTYPES) -> DType:
    if name not in allowed:
        raise UserError(f"unknown dtype {name!r}: choose from {', '.join(allowed)}")
    return allowed[name]


def dtype_size(name: str) -> int:
    return dtype_info(name).bytes


def tolerance(dtype: str, nranks: int) -> float:
    """Relative error allowed in a collective's result over ``nranks`` ranks: a sum of
    ``nranks`` terms rounded in ``dtype`` (integers: exact)."""
    return 4 * nranks * dtype_info(dtype, {**DTYPES, **EXTRA_DTYPES}).unit_roundoff
