"""Timing one method's step: first call, warm-up, timed steps, peak memory, compilations."""

from __future__ import annotations

import gc
import statistics
import time

import torch

from ..common import counts_delta, dynamo_counts
from ..timing import timed


def measure(env, step, warmup: int, reps: int) -> dict:
    """First step (may compile), warm-up, then ``reps`` timed steps: CUDA events on the GPU,
    wall clock on the CPU. Peak memory over the timed steps."""
    c0 = dynamo_counts()
    t0 = time.perf_counter()
    loss = step()
    env.sync()
    first_s = time.perf_counter() - t0
    for _ in range(max(warmup - 1, 0)):
        step()
    env.sync()
    c1 = dynamo_counts()
    if env.cuda:
        torch.cuda.reset_peak_memory_stats()
    times, walls = [], []
    for _ in range(reps):
        w0 = time.perf_counter()
        loss, ms = timed(step, env.cuda)
        times.append(ms)
        walls.append((time.perf_counter() - w0) * 1e3)
    c2 = dynamo_counts()
    out = {
        "step_ms": statistics.median(times),
        "step_ms_all": times,
        "wall_ms": statistics.median(walls),
        "first_step_s": first_s,
        "loss": float(loss),
        "dynamo_warmup": counts_delta(c0, c1),
        "dynamo_timed": counts_delta(c1, c2),
        "timing": "cuda_events" if env.cuda else "cpu_wall_clock",
    }
    if env.cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def cleanup(env, model=None):
    if model is not None:
        model.zero_grad(set_to_none=True)
    gc.collect()
    if env.cuda:
        torch.cuda.empty_cache()


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()
