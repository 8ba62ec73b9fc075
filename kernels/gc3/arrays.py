"""Sort-based set operations on integer arrays (numpy's hash-based ``unique`` and ``isin`` are many
times slower on the millions of codes the compiler handles); each is O(n log n), or O(n) for ``unique``
and ``unique_counts`` of values that span at most twice their count (counted, not sorted)."""
from __future__ import annotations

import numpy as np


def bit_width(n: int) -> int:
    """Bits that hold 0..n-1 (at least 1): codes ``(a << bit_width(n)) | b`` for b < n sort like (a, b) and
    decode with a shift and a mask, much faster than a division."""
    return max(n - 1, 1).bit_length()


def _dense(x: np.ndarray) -> bool:
    """Whether the values of ``x`` are non-negative and span at most about twice its length: then a count
    per value (O(n + range), no sort) finds them faster than a sort."""
    return len(x) > 1024 and x.dtype.kind in "iu" and int(x.min()) >= 0 and int(x.max()) < 2 * len(x)


def unique(x: np.ndarray, overwrite: bool = False) -> np.ndarray:
    """The distinct values of ``x``, sorted; ``overwrite``: sort ``x`` itself (no copy)."""
    if _dense(x):
        return np.flatnonzero(np.bincount(x)).astype(x.dtype, copy=False)
    if overwrite:
        x.sort()
        s = x
    else:
        s = np.sort(x)
    keep = np.ones(len(s), dtype=bool)
    keep[1:] = s[1:] != s[:-1]
    return s[keep]


def unique_counts(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of ``x``, sorted, and how often each occurs."""
    if _dense(x):
        counts = np.bincount(x)
        values = np.flatnonzero(counts)
        return values.astype(x.dtype, copy=False), counts[values]
    return run_counts(np.sort(x))


def run_counts(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of the sorted array ``s`` and how often each occurs; O(n)."""
    keep = np.ones(len(s), dtype=bool)
    keep[1:] = s[1:] != s[:-1]
    starts = np.flatnonzero(keep)
    return s[starts], np.diff(np.append(starts, len(s)))


def isin(x: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Whether each element of ``x`` is in ``ref`` (sorted, distinct)."""
    if not len(ref):
        return np.zeros(len(x), dtype=bool)
    pos = np.minimum(np.searchsorted(ref, x), len(ref) - 1)
    return ref[pos] == x


def order_by(major: np.ndarray, minor: np.ndarray | None = None) -> np.ndarray:
    """The stable order by (major, minor) of non-negative integer keys: when (major, minor, position) fits
    in 63 bits, one sort of those codes (several times faster than an argsort), else a lexsort."""
    n = len(major)
    if not n:
        return np.zeros(0, dtype=np.int64)
    span = 1 if minor is None else int(minor.max()) + 1
    bits = max(n - 1, 1).bit_length()           # positions take the low bits: decoding is a mask
    if (int(major.max()) + 1) * span < (1 << (62 - bits)):
        code = major.astype(np.int64) * span
        if minor is not None:
            code += minor
        code <<= bits
        code |= np.arange(n)
        code.sort()
        return code & ((1 << bits) - 1)
    return np.lexsort((np.arange(n), major) if minor is None else (minor, major))


def index_of(codes: np.ndarray, rows: np.ndarray, want: np.ndarray, space: int) -> np.ndarray:
    """``rows[i]`` for the i with ``codes[i] == want[k]``, for each k (``codes`` distinct, each ``want`` among
    them, all in 0..space-1): a direct table when ``space`` is small, else a sort and a binary search."""
    if space <= 4 * (len(codes) + len(want)) + 1024:
        table = np.empty(space, dtype=np.int64)
        table[codes] = rows
        return table[want]
    by = np.argsort(codes)
    return rows[by][np.searchsorted(codes[by], want)]


def rank_in_group(key: np.ndarray) -> np.ndarray:
    """For a sorted key array, each element's position within its run of equal keys."""
    if not len(key):
        return np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
    return np.arange(len(key)) - np.repeat(starts, np.diff(np.append(starts, len(key))))
