"""``--profile``: GPU time of a step by kernel kind (torch.profiler), the busiest kernels, and
where the GPU waits for the host (its idle gaps and the CPU events running in them)."""

from __future__ import annotations

import time

import numpy as np
import torch

_KERNEL_KINDS = (  # (category, name fragments), first match wins
    ("attention", ("flex_attention", "triton_tem", "flash", "fmha", "cudnn", "attention")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_", "splitk")),
    # Before copy/fill: Inductor names a fused kernel after its ops, so RoPE or SiLU fused
    # with a dtype cast is "triton_poi_fused__to_copy_...", which is pointwise work.
    ("triton pointwise/reduction", ("triton_poi", "triton_red", "triton_per")),
    ("copy/fill", ("memcpy", "memset", "copy", "fill")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, frags in _KERNEL_KINDS:
        if any(f in low for f in frags):
            return kind
    return "other"


def profile_step(env, step, steps: int = 2) -> dict:
    """GPU kernel time of ``steps`` steps by kind (torch.profiler), the busiest kernels, and
    how much of the steps' span the GPU was busy (the rest: waiting for the host)."""
    from torch.profiler import ProfilerActivity, profile

    env.sync()
    w0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        env.sync()
    wall_ms = (time.perf_counter() - w0) * 1e3
    by_name: dict[str, float] = {}
    spans = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us()
        by_name[e.name] = by_name.get(e.name, 0.0) + us
        spans.append((e.time_range.start, e.time_range.end))
    kinds: dict[str, float] = {}
    for name, us in by_name.items():
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + us
    busy = sum(by_name.values())
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:25]
    cpu = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
           if e.device_type == torch.autograd.DeviceType.CPU]
    return {
        "host_gaps": host_gaps(spans, cpu, steps),
        "steps": steps, "wall_ms_per_step": wall_ms / steps,
        "gpu_busy_ms_per_step": busy / 1e3 / steps,
        "gpu_span_ms_per_step": span / 1e3 / steps,
        "by_kind_ms_per_step": {k: v / 1e3 / steps for k, v in sorted(kinds.items(),
                                                                        key=lambda kv: -kv[1])},
        "top_kernels_ms_per_step": [(n[:160], us / 1e3 / steps) for n, us in top],
        "kernel_launches_per_step": sum(1 for _ in spans) / steps,
    }


def host_gaps(kernels, cpu, steps: int, min_us: float = 20.0) -> dict:
    """Where the GPU waits for the host: the gaps of at least ``min_us`` between kernels
    (``kernels``: (start, end) in µs), each CPU event's overlap with them (inclusive: a
    parent and its child both count), and the largest gaps with the innermost CPU event
    covering most of each."""
    if not kernels:
        return {}
    merged = []
    for s0, e0 in sorted(kernels):
        if merged and s0 <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e0)
        else:
            merged.append([s0, e0])
    gaps = [(a[1], b[0]) for a, b in zip(merged, merged[1:]) if b[0] - a[1] >= min_us]
    if not gaps or not cpu:
        return {"gaps": len(gaps), "gap_ms_per_step": sum(b - a for a, b in gaps) / 1e3 / steps}
    cs = np.array([c[0] for c in cpu], dtype=np.float64)
    ce = np.array([c[1] for c in cpu], dtype=np.float64)
    names = [c[2] for c in cpu]
    by_name: dict[str, float] = {}
    largest = []
    for g0, g1 in gaps:
        ov = np.clip(np.minimum(ce, g1) - np.maximum(cs, g0), 0, None)
        for i in np.flatnonzero(ov > 0):
            by_name[names[i]] = by_name.get(names[i], 0.0) + float(ov[i])
        cover = np.flatnonzero(ov >= 0.5 * (g1 - g0))
        inner = names[cover[np.argmin(ce[cover] - cs[cover])]] if cover.size else None
        largest.append((g1 - g0, inner))
    largest.sort(key=lambda x: -x[0])
    return {
        "gaps": len(gaps),
        "gap_ms_per_step": sum(b - a for a, b in gaps) / 1e3 / steps,
        "cpu_events_in_gaps_ms_per_step": [
            (n[:120], us / 1e3 / steps)
            for n, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:30]],
        "largest_gaps_us": [(round(us, 1), n and n[:120]) for us, n in largest[:15]],
    }
