"""One timer for the benchmark scripts: CUDA events around a call on the GPU, the wall clock
on the CPU."""

from __future__ import annotations

import time

import torch


def timed(fn, cuda: bool):
    """Run ``fn()`` once; return (its result, milliseconds). On the GPU the time is between two
    CUDA events recorded around the call, after synchronizing on the second."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        return out, start.elapsed_time(end)
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3
