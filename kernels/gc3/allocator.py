"""Process settings that let the compiler reuse the memory it frees (for the command layer only).

The compiler's passes make and drop many arrays of tens of MB. By default glibc
maps each one afresh (``mmap``) and numpy advises huge pages for it, so every
pass pays the kernel to fault in and zero new pages (at 1,024 ranks, all-pairs:
about 3 to 4 s of system time out of 14 s of CPU). With mappings off and a high
trim threshold, freed arrays go back to the heap and are reused as they are.
These are settings of the whole process: only ``kernels compile``, ``kernels
check`` and the scale benchmark call ``reuse_freed_memory``, before any work.
"""
from __future__ import annotations

import ctypes

import numpy as np

_M_TRIM_THRESHOLD = -1      # glibc mallopt parameters (malloc.h)
_M_MMAP_MAX = -4


def reuse_freed_memory() -> bool:
    """Keep freed memory for reuse (glibc) and drop numpy's huge-page advice; False where glibc's
    ``mallopt`` is not available (then only the latter applies)."""
    set_hugepage = getattr(np._core.multiarray, "_set_madvise_hugepage", None)
    if set_hugepage is not None:
        set_hugepage(False)
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1))
