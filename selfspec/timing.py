"""The one clock every timer reads: CUDA kernels run asynchronously, so a GPU timing must wait for them first."""

import time

import torch


def clock(device: torch.device | str = "cpu") -> float:
    """Seconds (time.perf_counter) after the work queued on `device` has finished; CPU work is synchronous."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
