"""Process-wide memory tuning of a replay server: a malloc that keeps the memory it freed.

Every 0.5 MB insert passes through several transient buffers of its size (gRPC's received slices and
their join, the protobuf decode, the ``arrow_ipc`` field). With glibc's defaults a block that size is
``mmap``ed and ``munmap``ed (or the heap top trimmed) again and again, so each message paid ~100 page
faults (zero, charge and map a 4 KiB page each) for memory it had just freed — measured with
``perf record -e page-faults`` on a replay server under ``bench.replay``'s ingest: 240 faults per
message with the defaults, ~150 with ``tune_malloc`` (the rest is the stored payload itself, new
memory as long as the buffer grows; a buffer at capacity reuses what evicted and consumed groups freed).
"""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
"""``mallopt`` parameters (glibc ``<malloc.h>``)."""


def tune_malloc(mmap_threshold: int = 32 << 20, trim_threshold: int = (1 << 31) - 1, arena_max: int = 1) -> bool:
    """Make glibc's malloc reuse freed memory instead of returning it to the OS (process-wide).

    Args:
        mmap_threshold: bytes; smaller allocations come from the heap instead of their own mapping
            (glibc caps it at 32 MiB on 64-bit).
        trim_threshold: bytes of free memory at the heap top kept instead of being returned to the OS.
        arena_max: malloc arenas shared by all threads (gRPC's I/O threads free what Python threads
            allocated; one arena keeps each freed block reusable by every thread).

    The process's resident size therefore stays near its peak. Returns ``True`` once all three are
    set, ``False`` (changing nothing more) where there is no glibc ``mallopt`` (macOS, musl).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no C library with mallopt here: keep the allocator's defaults
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in
               ((_M_MMAP_THRESHOLD, mmap_threshold), (_M_TRIM_THRESHOLD, trim_threshold), (_M_ARENA_MAX, arena_max)))
