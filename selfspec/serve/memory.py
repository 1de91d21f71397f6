"""The server's memory over hours: large buffers given back to the system when freed.

glibc serves an allocation from its heap unless it is at least its mmap threshold, and raises that threshold (up to
32 MiB) each time a larger mmapped buffer is freed. A server allocates large buffers of ever-changing sizes: each
request's per-position draft buffers (a feature head's hidden states, max_len x hidden), a batch's logits, a long
prompt's prefill. Served from the heap, they fragment it, and resident memory creeps up as requests come and go
(`make soak` checks its growth). A fixed threshold gives each buffer of 1 MiB or more its own mapping,
returned whole when freed; smaller ones (a step's per-layer activations) stay on the heap, where reuse is cheap.
"""

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter; setting it also stops the threshold's growth
LARGE_BUFFER_BYTES = 1 << 20


def give_back_large_buffers(threshold: int = LARGE_BUFFER_BYTES) -> bool:
    """Allocations of `threshold` bytes or more are mapped on their own and unmapped when freed. False where the C
    library is not glibc (macOS, musl): its allocator keeps its own policy."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        return False
    return bool(mallopt and mallopt(M_MMAP_THRESHOLD, threshold))
