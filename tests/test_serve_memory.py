"""The server's large buffers go back to the system when freed, and its heap's free pages when trimmed
(serve/memory.py), so churn does not pile up."""

import subprocess
import sys

CHURN = """
import random, sys, psutil, torch
from selfspec.serve.memory import give_back_large_buffers
if sys.argv[1] == "given back":
    assert give_back_large_buffers()
rss = lambda: psutil.Process().memory_info().rss / 2 ** 20
rnd, rows, kept = random.Random(0), [], []
start = rss()
for _ in range(1000):  # 16 rows' buffers of changing sizes (1-16 MiB), the oldest leaving as one joins; small ones
    rows.append(torch.ones(rnd.randrange(256, 4096) * 1024))  # stay
    kept.append(torch.ones(64))
    if len(rows) > 16:
        rows.pop(0)
rows.clear()
print(rss() - start)
"""


SMALL_CHURN = """
import sys, psutil
from selfspec.serve.memory import give_back_free_heap
rss = lambda: psutil.Process().memory_info().rss / 2 ** 20
start = rss()
buffers = [bytearray(8192) for _ in range(40_000)]  # 312 MiB of heap buffers below the mmap threshold
kept = buffers[::64]  # one in 64 stays: the heap cannot shrink from its top
buffers.clear()
if sys.argv[1] == "trimmed":
    assert give_back_free_heap()
print(rss() - start)
"""


def resident_growth_mib(mode: str, churn: str = CHURN) -> float:
    """What a process holds after the churn of buffers, all but a few freed, over what it held before."""
    result = subprocess.run([sys.executable, "-c", churn, mode], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return float(result.stdout)


def test_freed_large_buffers_leave_no_resident_memory_behind():
    given_back, kept = resident_growth_mib("given back"), resident_growth_mib("allocator's default")
    assert given_back < 32  # MiB: the pages of freed buffers went back to the system
    assert kept > given_back + 64  # the allocator's default keeps hundreds of MiB of them (glibc)


def test_a_trim_gives_the_heaps_free_pages_back():
    trimmed, kept = resident_growth_mib("trimmed", SMALL_CHURN), resident_growth_mib("untrimmed", SMALL_CHURN)
    assert trimmed < 32  # MiB: the kept buffers' pages and little else
    assert kept > trimmed + 200  # untrimmed, the freed buffers' pages stay resident


def test_the_heap_trim_runs_at_most_once_every_interval(monkeypatch):
    from selfspec.serve import memory

    trims, now = [], [0.0]
    monkeypatch.setattr(memory, "give_back_free_heap", lambda: trims.append(now[0]))
    trim = memory.HeapTrim(every_s=5.0, clock=lambda: now[0])
    for now[0] in (1.0, 4.9, 5.0, 6.0, 9.9, 10.0, 30.0):
        trim()
    assert trims == [5.0, 10.0, 30.0]


KERNELS = """
import sys, psutil, torch
from selfspec.models.packed_linear import packed_product, packed_weight
from selfspec.serve.memory import give_back_free_heap


def rss():
    give_back_free_heap()  # what stays resident is what is still allocated
    return psutil.Process().memory_info().rss / 2 ** 20


weight, x = packed_weight(torch.randn(576, 576)), torch.randn(300, 576)  # a SmolLM2 attention projection
with torch.inference_mode():
    start = rss()
    for rows in range(17, 300):  # a prompt of every length
        if sys.argv[1] == "padded":
            packed_product(x[:rows], weight)
        else:
            torch.ops.mkldnn._linear_pointwise(x[:rows], weight, None, "none", [], "")
print(rss() - start)
"""


def test_a_packed_linear_meeting_every_row_count_keeps_few_kernels():
    padded, exact = resident_growth_mib("padded", KERNELS), resident_growth_mib("exact", KERNELS)
    assert padded < 24  # MiB: kernels for the 17 padded row counts
    assert exact > padded + 64  # oneDNN keeps a kernel for each of the 283 row counts
