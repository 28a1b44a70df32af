"""The suite's one timer: CUDA events around a call on the GPU, ``time.perf_counter`` on the
CPU. Every benchmark times through these functions, so the same convention (median of the
repetitions after warm-up calls) holds everywhere."""

from __future__ import annotations

import statistics
import time

import torch


def timed(fn, cuda: bool):
    """Run ``fn()`` once; return (its result, milliseconds). On the GPU the time is between two
    CUDA events recorded around the call, after synchronizing on the second (so it is the GPU's
    time for the call, host overhead included only where the GPU waits for it)."""
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


def repeat(fn, reps: int, cuda: bool, warmup: int = 0) -> list[float]:
    """``warmup`` untimed calls, then ``reps`` timed ones (:func:`timed`); milliseconds each."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return [timed(fn, cuda)[1] for _ in range(reps)]


def median_ms(fn, reps: int, cuda: bool, warmup: int = 0) -> float:
    """Median of :func:`repeat`."""
    return statistics.median(repeat(fn, reps, cuda, warmup))
