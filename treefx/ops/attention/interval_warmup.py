"""cuDNN's interval-attention kernels compiled in second processes while the compiler works.

The frontend (:mod:`treefx.ops.attention.intervals`) compiles its CuTe DSL kernels on first
use: the plan's builders, the forward and the backward (seconds each; BENCHMARKS.md, "First
step and compile time"), in the middle of the first step, after Inductor compiled the graph around them. Which kernels a
site needs is known from the dtype, head counts and widths (the frontend's compile keys name no
lengths): from the model's config at its first call, before Dynamo's trace
(:func:`~treefx.ops.attention.intervals.warm_up_model`, :func:`start_for`), and exactly where
a site is lowered (:func:`start`, for a site the guess missed). Each launches this file as a
script in fresh Pythons that import only torch and the frontend and leave the kernels in the
frontend's on-disk cache (``FLEX_ATTENTION_CUTE_DSL_CACHE_*``, which treefx turns on).

Two children by default, side by side: one builds a plan and runs the forward once, the other
builds a plan and runs the backward once (on made-up outputs), so the kernels are ready after
the plan's and the slower pass's compile instead of all three in a row. Both compile the plan's
kernels (the same keys; the cache's file locks keep their writes apart).
``TREEFX_CUDNN_WARMUP_PROCESSES=1`` runs one child for all three (a host short of cores).

The op imports the frontend at its first call (about 5 s, while the children still work) and
calls :func:`wait` before its first plan (the forward's child) and before its first backward
(the backward's): it waits for that process, then loads the kernels from the disk instead of
compiling them. A thread in the same process did not help (it competes with the compiler for
the interpreter: the first step took longer).

Each child takes the GPU the site runs on (a CUDA context, a few hundred MB, while it lives);
a guess from the config that missed costs such processes compiling kernels nothing uses.
``TREEFX_CUDNN_WARMUP=0`` turns them off. A child that fails changes nothing: the op compiles
its kernels itself, as without it.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import tempfile
import time

__all__ = ["PROCESSES", "ROLES", "SWITCH", "start", "start_for", "wait"]



def __getattr__(name: str) -> str:
    """``SWITCH`` and ``PROCESSES``, the switches' variable names (:mod:`treefx.options`),
    looked up when asked: this file also runs as a script in the children, without the
    package, so it imports treefx's modules only inside its functions."""
    fields = {"SWITCH": "cudnn_warmup", "PROCESSES": "cudnn_warmup_processes"}
    if name not in fields:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from ...options import Options

    return Options.env_name(fields[name])

# What the op waits for: the plan's and the forward's kernels before its first plan, the
# backward's before its first backward.
ROLES = ("forward", "backward")
_TIMEOUT_S = 300.0
log = logging.getLogger("treefx")


class _Child:
    """One child process compiling kernels for one or both roles; reported once."""

    def __init__(self, proc, out, roles: tuple[str, ...]):
        self.proc, self.out, self.roles = proc, out, roles
        self.t0 = time.perf_counter()
        self.finished = False

    def finish(self) -> None:
        """Wait for it (at most what is left of its time), then report a failure."""
        if self.finished:
            return
        self.finished = True
        try:
            rc = self.proc.wait(timeout=max(1.0, _TIMEOUT_S - (time.perf_counter() - self.t0)))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = "killed after its time"
        if rc != 0:
            self.out.seek(0)
            tail = self.out.read().decode(errors="replace")[-2000:]
            log.warning("treefx: the cuDNN kernel warm-up process (%s) ended with %s; the op "
                        "compiles its kernels itself. Its output's end:\n%s",
                        " and ".join(self.roles), rc, tail)
        self.out.close()


# (signature, role) -> the child compiling its kernels, while it may still run
_running: dict[tuple, _Child] = {}
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


def _groups(options: Options | None = None) -> tuple[tuple[str, ...], ...]:
    """The roles of each child: one each (the default), or both in one
    (``options.cudnn_warmup_processes`` 1)."""
    from ...options import current

    return (ROLES,) if current(options).cudnn_warmup_processes == 1 \
        else tuple((r,) for r in ROLES)


def start(q, k, v, options: Options | None = None) -> None:
    """Launch the children for these example q, k, v (``[1, H, N, D]``, on the GPU): see
    :func:`start_for`."""
    start_for(q.dtype, q.shape[1], k.shape[1], q.shape[-1], v.shape[-1], q.device, options)


def start_for(dtype, hq: int, hk: int, d: int, dv: int, device,
              options: Options | None = None) -> None:
    """Launch the children for the kernels of this dtype, these query / KV heads and head
    widths on ``device`` (a GPU) unless they ran or run for them, the switch is off, or the
    frontend's disk cache is off (then their kernels could not reach this process)."""
    from ...options import current

    options = current(options)
    key = _key(dtype, hq, hk, d, dv, device)
    if any((key, r) in _running or (key, r) in _done for r in ROLES) \
            or not options.cudnn_warmup or not _disk_cache_on():
        return
    for roles in _groups(options):
        out = tempfile.TemporaryFile()
        try:
            # run by its path, its folder not on sys.path (its modules' names would shadow)
            proc = subprocess.Popen(
                [sys.executable, "-c", "import runpy, sys; runpy.run_path(sys.argv[1], "
                 "run_name='__main__')", os.path.abspath(__file__), ",".join(roles),
                 *map(str, key)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        except (OSError, ValueError, TypeError) as e:  # no interpreter (embedded Python)
            log.info("treefx: cuDNN kernel warm-up not started (%s)", e)
            out.close()
            _done.update((key, r) for r in roles)
            continue
        child = _Child(proc, out, roles)
        _running.update(((key, r), child) for r in roles)


def _stop_all() -> None:
    """At exit: a child still compiling is stopped (nothing waits for its kernels)."""
    for child in set(_running.values()):
        if child.proc.poll() is None:
            child.proc.kill()
        child.out.close()
    _running.clear()


atexit.register(_stop_all)


def wait(q, k, v, role: str = "forward") -> None:
    """Before the op's first plan (``role="forward"``) or first backward (``"backward"``) for
    these ``[1, N, H, D]`` q, k, v: wait for the child compiling those kernels, if one runs
    (at most 5 minutes from its start)."""
    key = (_key(q.dtype, q.shape[2], k.shape[2], q.shape[-1], v.shape[-1], q.device), role)
    child = _running.pop(key, None)
    _done.add(key)
    if child is not None:
        child.finish()


def _child(roles: str, dtype: str, hq: str, hk: str, d: str, dv: str, index: str) -> None:
    """Build a plan on a short chain row, then run the forward and/or the backward once
    (``roles``: comma-separated), so that their kernels land in the disk cache. The backward
    runs on made-up outputs: its kernels depend on shapes and dtypes, not values."""
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
    roles_ = roles.split(",")
    if "forward" in roles_:
        out, lse, _ = _flex_attention_forward(q, k, v, mask_plan=plan, softmax_scale=scale,
                                              return_lse=True)
    else:  # the forward's outputs as it returns them: [1, N, Hq, Dv] and float32 [1, Hq, N]
        out = torch.randn(1, n, int(hq), int(dv), dtype=dt, device=dev)
        lse = torch.randn(1, int(hq), n, dtype=torch.float32, device=dev)
    if "backward" in roles_:
        _flex_attention_backward(q, k, v, out, torch.randn_like(out), lse, mask_plan=plan,
                                 softmax_scale=scale)
    torch.cuda.synchronize(dev)


if __name__ == "__main__":
    _child(*sys.argv[-7:])
