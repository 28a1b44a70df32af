"""cuDNN's interval-attention kernels compiled in a second process while the compiler works.

The frontend (:mod:`treefx.ops.attention.intervals`) compiles its CuTe DSL kernels on first
use: the plan's builders, the forward and the backward, about 20 s on an H100, in the middle of
the first step, after Inductor compiled the graph around them. Which kernels a site needs is
known from the dtype, head counts and widths (the frontend's compile keys name no lengths):
from the model's config at its first call, before Dynamo's trace
(:func:`~treefx.ops.attention.intervals.warm_up_model`, :func:`start_for`), and exactly where
a site is lowered (:func:`start`, for a site the guess missed). Each launches this file as a
script in a fresh Python that imports only torch and the frontend, runs the op once on a short
row, and leaves the kernels in the frontend's on-disk cache
(``FLEX_ATTENTION_CUTE_DSL_CACHE_*``, which treefx turns on). The
op imports the frontend at its first call (about 5 s, while the child still works) and calls
:func:`wait` before its first plan: it waits for that process, then loads the kernels from the
disk instead of compiling them. A thread in the same process did not help (it competes with
the compiler for the interpreter: the first step took longer).

The child takes the GPU the site runs on (a CUDA context, a few hundred MB, while it lives);
a guess from the config that missed costs one such process compiling kernels nothing uses.
``TREEFX_CUDNN_WARMUP=0`` turns it off. A child that fails changes nothing: the op compiles its
kernels itself, as without it.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import tempfile
import time

__all__ = ["SWITCH", "start", "start_for", "wait"]

SWITCH = "TREEFX_CUDNN_WARMUP"
_TIMEOUT_S = 300.0
log = logging.getLogger("treefx")

# signature -> (process, log file, start time), while it may still run
_running: dict[tuple, tuple] = {}
_done: set[tuple] = set()


def _key(dtype, hq, hk, d, dv, device) -> tuple:
    """What selects the kernels (the frontend's compile keys name no lengths)."""
    return (str(dtype).removeprefix("torch."), int(hq), int(hk), int(d), int(dv),
            device.index or 0)


def _disk_cache_on() -> bool:
    """Whether the frontend's on-disk kernel cache is on in this process (its switch is read
    when it is imported: before that, the environment's)."""
    cache = sys.modules.get("cudnn.flex_attention.runtime.compile_cache")
    if cache is not None:
        return bool(getattr(cache, "CUTE_DSL_CACHE_ENABLED", False))
    return os.environ.get("FLEX_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0") == "1"


def start(q, k, v) -> None:
    """Launch the child for these example q, k, v (``[1, H, N, D]``, on the GPU): see
    :func:`start_for`."""
    start_for(q.dtype, q.shape[1], k.shape[1], q.shape[-1], v.shape[-1], q.device)


def start_for(dtype, hq: int, hk: int, d: int, dv: int, device) -> None:
    """Launch the child for the kernels of this dtype, these query / KV heads and head
    widths on ``device`` (a GPU) unless one ran or runs for them, the switch is off, or the
    frontend's disk cache is off (then the child's kernels could not reach this process)."""
    from ..._switches import switched_off

    key = _key(dtype, hq, hk, d, dv, device)
    if key in _running or key in _done or switched_off(SWITCH) or not _disk_cache_on():
        return
    out = tempfile.TemporaryFile()
    try:
        # run by its path, its folder not on sys.path (its modules' names would shadow)
        proc = subprocess.Popen(
            [sys.executable, "-c", "import runpy, sys; runpy.run_path(sys.argv[1], "
             "run_name='__main__')", os.path.abspath(__file__), *map(str, key)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    except (OSError, ValueError, TypeError) as e:  # no interpreter to start (embedded Python)
        log.info("treefx: cuDNN kernel warm-up not started (%s)", e)
        out.close()
        _done.add(key)
        return
    _running[key] = (proc, out, time.perf_counter())


def _stop_all() -> None:
    """At exit: a child still compiling is stopped (nothing waits for its kernels)."""
    for proc, out, _ in list(_running.values()):
        if proc.poll() is None:
            proc.kill()
        out.close()
    _running.clear()


atexit.register(_stop_all)


def wait(q, k, v) -> None:
    """Before the op's first plan for these ``[1, N, H, D]`` q, k, v: wait for the child
    compiling their kernels, if one runs (at most 5 minutes)."""
    key = _key(q.dtype, q.shape[2], k.shape[2], q.shape[-1], v.shape[-1], q.device)
    entry = _running.pop(key, None)
    _done.add(key)
    if entry is None:
        return
    proc, out, t0 = entry
    try:
        rc = proc.wait(timeout=max(1.0, _TIMEOUT_S - (time.perf_counter() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "killed after its time"
    if rc != 0:
        out.seek(0)
        tail = out.read().decode(errors="replace")[-2000:]
        log.warning("treefx: the cuDNN kernel warm-up process ended with %s; the op compiles "
                    "its kernels itself. Its output's end:\n%s", rc, tail)
    out.close()


def _child(dtype: str, hq: str, hk: str, d: str, dv: str, index: str) -> None:
    """Run the op's plan, forward and backward once on a short chain row (the kernels land in
    the disk cache)."""
    os.environ.setdefault("FLEX_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    import torch
    from cudnn.flex_attention import create_mask_plan
    from cudnn.flex_attention.execution import _flex_attention_backward, _flex_attention_forward

    dev = torch.device("cuda", int(index))
    torch.cuda.set_device(dev)
    n, dt = 256, getattr(torch, dtype)
    q = torch.randn(1, n, int(hq), int(d), dtype=dt, device=dev)
    k = torch.randn(1, n, int(hk), int(d), dtype=dt, device=dev)
    v = torch.randn(1, n, int(hk), int(dv), dtype=dt, device=dev)
    rows = torch.arange(1, n + 1, dtype=torch.int32, device=dev)
    mask = torch.stack([torch.zeros_like(rows), torch.zeros_like(rows), rows])[None]  # causal
    mask = mask.contiguous()
    plan = create_mask_plan(mask, q, k, v, build_backward=True)
    scale = int(d) ** -0.5
    out, lse, _ = _flex_attention_forward(q, k, v, mask_plan=plan, softmax_scale=scale,
                                          return_lse=True)
    _flex_attention_backward(q, k, v, out, torch.randn_like(out), lse, mask_plan=plan,
                             softmax_scale=scale)
    torch.cuda.synchronize(dev)


if __name__ == "__main__":
    _child(*sys.argv[-6:])
