"""The server's large buffers go back to the system when freed (serve/memory.py), so churn does not pile up."""

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


def resident_growth_mib(mode: str) -> float:
    """What a process holds after the churn of large buffers, all freed, over what it held before."""
    result = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return float(result.stdout)


def test_freed_large_buffers_leave_no_resident_memory_behind():
    given_back, kept = resident_growth_mib("given back"), resident_growth_mib("allocator's default")
    assert given_back < 32  # MiB: the pages of freed buffers went back to the system
    assert kept > given_back + 64  # the allocator's default keeps hundreds of MiB of them (glibc)
