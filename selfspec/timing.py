"""The one clock every timer reads (CUDA kernels run asynchronously, so a GPU timing must wait for them first), and
the timer of several steps in turns that the cost meter and the output layer's choice of product share."""

import statistics
import time

import torch


def clock(device: torch.device | str = "cpu") -> float:
    """Seconds (time.perf_counter) after the work queued on `device` has finished; CPU work is synchronous."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def timed_ms_each(steps: list, device: torch.device | str, repeats: int) -> list[float]:
    """Median milliseconds of each of `steps`, timed in turn, round after round, after one untimed round: a slow
    spell on a shared machine falls on every step alike, not on whichever one was being timed."""
    for step in steps:
        step()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for step, taken in zip(steps, times):
            start = clock(device)
            step()
            taken.append(clock(device) - start)
    return [1000 * statistics.median(taken) for taken in times]
