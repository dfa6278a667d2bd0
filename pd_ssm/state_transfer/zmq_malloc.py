"""Process-wide malloc tuning for a receiving ZmqConnector (`ZmqConfig.malloc_retain_bytes`).

libzmq mallocs every received frame. glibc serves buffers that large with fresh mmaps and gives
freed ones back to the OS, so each request faulted in every 4 KiB page again (on a VM that cost
2.5x the loopback bandwidth). Keeping freed memory mapped for reuse avoids that.
"""

from __future__ import annotations

import ctypes

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_HEAP_MAX = 64 << 20  # a thread arena's heap on 64-bit hosts; glibc's mmap threshold is at most half


def retain_freed_memory(retain_bytes: int) -> None:
    """Make glibc malloc reuse freed receive buffers instead of faulting in fresh pages each request.

    Frames below 32 MB come from the heap, not mmap; up to `retain_bytes` of freed heap stay mapped;
    a top pad of a whole heap, since libzmq's I/O thread allocates in a thread arena, whose 64 MB
    heaps glibc unmaps as soon as they are empty unless the pad forbids it. Process-wide, idempotent."""
    # NOTE: the process's own symbols include the C library's; find_library would run ldconfig
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        raise RuntimeError("this C library has no mallopt (not glibc?): set ZmqConfig.malloc_retain_bytes=None")
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    for param, value in ((_M_MMAP_THRESHOLD, _HEAP_MAX // 2), (_M_TRIM_THRESHOLD, retain_bytes), (_M_TOP_PAD, _HEAP_MAX)):
        if mallopt(param, value) != 1:
            raise RuntimeError(f"mallopt({param}, {value}) failed: set ZmqConfig.malloc_retain_bytes=None")
