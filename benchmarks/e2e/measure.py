"""Timing one method's step: first call, warm-up, timed steps, peak memory, compilations."""

from __future__ import annotations

import statistics
import time

import torch

from ..common import counts_delta, dynamo_counts
from ..timing import repeat, timed


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


def matmul_rate(env, cfg: dict, tokens: int, reps: int = 20) -> dict | None:
    """The GPU's bf16 ``torch.mm`` rate at the model's shapes for ``tokens`` rows (the MLP's up
    and down projections, the output projection) and at 8192^3, median of ``reps`` after 3
    warm-up calls, and the first shape's sustained rate (:func:`_sustained_rate`)."""
    if not env.cuda:
        return None
    h, f, v = cfg["hidden_size"], cfg.get("intermediate_size", 3 * cfg["hidden_size"]), \
        cfg["vocab_size"]
    shapes = [(tokens, h, f), (tokens, f, h), (tokens, h, v), (8192, 8192, 8192)]
    out = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        ms = statistics.median(repeat(lambda: torch.mm(a, b), reps, True, warmup=3))
        out.append({"m": m, "k": k, "n": n, "ms": ms, "tflops": 2 * m * k * n / ms / 1e9})
        del a, b
    sustained = _sustained_rate(*shapes[0], out[0]["ms"])
    torch.cuda.empty_cache()
    return {"shapes": out, "max_tflops": max(s["tflops"] for s in out), **sustained}


def _sustained_rate(m: int, k: int, n: int, ms: float, span_ms: float = 250.0) -> dict:
    """The first shape's ``torch.mm`` back to back for about ``span_ms`` (a step's length),
    timed as one: the clock under sustained load."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    reps = max(1, round(span_ms / ms))

    def run():
        for _ in range(reps):
            torch.mm(a, b)

    total = statistics.median(repeat(run, 3, True, warmup=1))
    del a, b
    return {"sustained_tflops": 2 * m * k * n * reps / total / 1e9, "sustained_ms": total,
            "sustained_shape": [m, k, n]}
