"""The device layer's pure-Python parts: dtypes, tolerance, NCCL enum values."""
from __future__ import annotations

import pytest

from calibrate.device.dtypes import DTYPES, EXTRA_DTYPES, dtype_size, tolerance
from calibrate.errors import UserError


def test_dtype_table_matches_nccl_and_numpy():
    nccl = {"int8": 0, "uint8": 1, "int32": 2, "int64": 4, "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
    for d in {**DTYPES, **EXTRA_DTYPES}.values():
        assert d.nccl == nccl[d.name]
    assert [dtype_size(n) for n in ("float32", "float16", "bfloat16", "float64", "int32", "int8")] == [4, 2, 2, 8, 4, 1]
    with pytest.raises(UserError, match="unknown dtype 'float8': choose from float32, float16, bfloat16"):
        dtype_size("float8")


def test_tolerance_is_a_sum_of_p_roundings():
    assert tolerance("float32", 2) == 8 * 2.0 ** -23
    assert tolerance("bfloat16", 4) == 16 * 2.0 ** -7
    assert tolerance("float16", 1) == 4 * 2.0 ** -10
    assert tolerance("int32", 8) == 0.0 and tolerance("int64", 8) == 0.0
