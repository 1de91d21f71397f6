"""The server's memory over hours: large buffers given back to the system when freed, and the heap's free pages
given back as requests end.

glibc serves an allocation from its heap unless it is at least its mmap threshold, and raises that threshold (up to
32 MiB) each time a larger mmapped buffer is freed. A server allocates large buffers of ever-changing sizes: each
request's per-position draft buffers (a feature head's hidden states, max_len x hidden), a batch's logits, a long
prompt's prefill. Served from the heap, they fragment it, and resident memory creeps up as requests come and go
(`make soak` checks its growth). A fixed threshold gives each buffer of 1 MiB or more its own mapping,
returned whole when freed; smaller ones (a step's per-layer activations) stay on the heap, where reuse is cheap.
Their freed pages stay resident until glibc's malloc_trim hands them back; the batch worker calls it as rows end,
at most every few seconds (`HeapTrim`). The kernels oneDNN keeps for each row count of a packed linear are bounded
where they are made (models/packed_linear.py, `padded_rows`).
"""

import ctypes
import ctypes.util
import functools
import time

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter; setting it also stops the threshold's growth
LARGE_BUFFER_BYTES = 1 << 20


TRIM_EVERY_S = 5.0


@functools.cache
def _glibc_function(name: str):
    """`name` of the C library, or None where the C library is not glibc (macOS, musl): its allocator keeps its own
    policy."""
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name) if library else None
    except (OSError, AttributeError):
        return None


def give_back_large_buffers(threshold: int = LARGE_BUFFER_BYTES) -> bool:
    """Allocations of `threshold` bytes or more are mapped on their own and unmapped when freed; False without
    glibc."""
    mallopt = _glibc_function("mallopt")
    return bool(mallopt and mallopt(M_MMAP_THRESHOLD, threshold))


def give_back_free_heap() -> bool:
    """The heap's free pages back to the system (malloc_trim); True where glibc gave any back."""
    malloc_trim = _glibc_function("malloc_trim")
    return bool(malloc_trim and malloc_trim(0))


class HeapTrim:
    """give_back_free_heap, at most once every `every_s` seconds (a trim walks the whole heap)."""

    def __init__(self, every_s: float = TRIM_EVERY_S, clock=time.monotonic):
        self.every_s, self.clock, self.last = every_s, clock, clock()

    def __call__(self) -> None:
        if self.clock() - self.last >= self.every_s:
            give_back_free_heap()
            self.last = self.clock()
