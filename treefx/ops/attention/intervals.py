"""Tree attention as key intervals, on cuDNN's interval-mask attention kernels.

In a depth-first row, the keys a query sees (its ancestors and itself) are a few runs of
consecutive rows: split the row into chains (maximal runs of rows each the child of the row
before), and a query in chain ``c`` sees, for each chain on the path from the root to ``c``,
the rows of that chain down to the path's row in it, then its own chain's rows up to itself.
So the tree's mask is, per query, a union of ``depth`` intervals (``depth``: chains on its
path), and the number of intervals is small even where the tree is large: 5 on the e2e
benchmark's POR-0.75 tree of 17,187 tokens.

cuDNN's frontend (``nvidia-cudnn-frontend`` >= 1.32, ``cudnn.flex_attention``) runs
attention under exactly such masks (``[0, F0) U [F1, F2) U ...`` per query) on Hopper and
Blackwell kernels written in CuTe DSL, forward and backward, with grouped-query attention,
faster than FlexAttention at treefx's site and within the same bf16 error of a float32
computation (``benchmarks.chain_attention``; BENCHMARKS.md, "Training step against sequence
packing", [att-1]).

:func:`tree_interval_attention` is a whole tree's site's call,
:func:`tree_part_interval_attention` a part's (:func:`treefx.backward`: its keys are its
context's path, then its own rows; the path's prefix a row sees is one more interval). The
mask's intervals come from the predecessor row's host copy
(:func:`treefx.ops.host_row.derived`, once per row), and so does cuDNN's plan for them (built
once per row and shape, shared by the layers and by the backward). Where it runs: a plain site
(no model mask, score ops, sinks or log-sum-exp out) on CUDA with bf16/fp16 q, k, v of one
dtype and one head width the kernels take, when the frontend is installed and the GPU is one
of its architectures, unless ``TREEFX_CUDNN_ATTENTION=0``; ``TREEFX_CUDNN_ATTENTION=1`` takes
it wherever else too, computed by plain torch from the same intervals (the CPU tests). The
kernels compile in second processes from the model's config or where the sites are lowered
(:mod:`.interval_warmup`), and the frontend is imported by the op's first call, so neither
waits for the other nor for the compiler.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import itertools
import math
import os

import numpy as np
import torch

from ...options import Options, current
from ..host_row import derived
from . import interval_warmup

__all__ = ["SWITCH", "available", "tree_intervals", "tree_interval_attention",
           "tree_part_interval_attention", "wanted", "warm_up", "warm_up_model"]

SWITCH = Options.env_name("cudnn_attention")
_DTYPES = (torch.bfloat16, torch.float16)
# The frontend's kernels by architecture (Hopper, Blackwell); checked on Hopper only.
_ARCH_HEAD_DIMS = {90: (64, 96, 128), 100: (64, 96, 128), 103: (64, 96, 128)}


_DISTRIBUTION, _MIN_VERSION = "nvidia-cudnn-frontend", (1, 32)


def _version(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _installed() -> bool:
    """Whether the frontend (>= 1.32) and the CuTe DSL it compiles its kernels with are
    installed: found, not imported (their import takes seconds, done by the op's first call,
    while the kernels compile in second processes: :mod:`.interval_warmup`)."""
    # The frontend compiles its kernels (CuTe DSL) on first use, tens of seconds in all; its
    # persistent cache, off unless asked, keeps them for a restarted job (as Inductor's
    # caches do) and carries them over from the warm-up process. A value the user set stays.
    os.environ.setdefault("FLEX_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    try:
        if importlib.util.find_spec("cudnn") is None or importlib.util.find_spec("cutlass") is None:
            return False
        return _version(importlib.metadata.version(_DISTRIBUTION)) >= _MIN_VERSION
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return False


@functools.lru_cache(maxsize=None)
def _frontend():
    """cuDNN's interval-mask attention (``cudnn.flex_attention``): its plan builder, forward and
    backward. An install that :func:`_installed` found but that does not import is an error
    (the sites were lowered onto the op)."""
    try:
        from cudnn.flex_attention import create_mask_plan
        from cudnn.flex_attention.execution import (
            _flex_attention_backward,
            _flex_attention_forward,
        )
    except Exception as e:
        try:
            found = f"{_DISTRIBUTION} {importlib.metadata.version(_DISTRIBUTION)}"
        except importlib.metadata.PackageNotFoundError:
            found = f"{_DISTRIBUTION}: not found"
        raise RuntimeError(
            f"treefx: cuDNN's frontend ({found}) is installed but its interval-mask attention "
            f"does not import ({type(e).__name__}: {e}). Repair the install, or set {SWITCH}=0 "
            "to run tree attention on FlexAttention.") from e
    return create_mask_plan, _flex_attention_forward, _flex_attention_backward


@functools.lru_cache(maxsize=None)
def _arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor


def available(device: torch.device) -> bool:
    """Whether cuDNN's kernels run on ``device``."""
    return (device.type == "cuda" and _installed()
            and _arch(device.index or 0) in _ARCH_HEAD_DIMS)


def wanted(q, k, v, options: Options | None = None) -> bool:
    """Whether a site with these example q, k, v (``[1, H, N, D]``) runs here
    (``options.cudnn_attention``: the capture's :class:`~treefx.options.Options`)."""
    switch = current(options).cudnn_attention
    if switch is False or q is None or k is None or v is None:
        return False
    if not (q.dim() == k.dim() == v.dim() == 4 and q.shape[0] == 1
            and q.shape[1] % k.shape[1] == 0 and k.shape[1] == v.shape[1]
            and q.shape[-1] == k.shape[-1] and q.dtype == k.dtype == v.dtype):
        return False
    if switch:
        return q.dtype.is_floating_point
    if not (q.dtype in _DTYPES and available(q.device)):
        return False
    dims = _ARCH_HEAD_DIMS[_arch(q.device.index or 0)]
    return q.shape[-1] in dims and v.shape[-1] == q.shape[-1]


def warm_up(q, k, v, options: Options | None = None) -> None:
    """Where a site is lowered onto the op with these example ``[1, H, N, D]`` q, k, v:
    compile cuDNN's kernels for them in second processes meanwhile
    (:mod:`.interval_warmup`), where they will run on cuDNN's kernels."""
    if q.device.type == "cuda" and q.dtype in _DTYPES and available(q.device):
        interval_warmup.start(q, k, v, options)


def warm_up_model(model: torch.nn.Module, device: torch.device,
                  options: Options | None = None) -> None:
    """Before a model's first capture on ``device``: compile cuDNN's kernels, in second
    processes, for the attention its Hugging Face config describes (query and KV heads, head
    width) in its parameters' dtype. Dynamo's trace of a deep model comes before the sites
    are lowered (15 s at 36 layers), so this starts the kernels' compilation that much
    earlier. A guess: where the sites differ, :func:`warm_up` starts theirs at lowering; a
    config it cannot read, or one with MLA's head widths, starts nothing."""
    options = current(options)
    if options.cudnn_attention is False or device.type != "cuda" or not available(device):
        return
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    hq = getattr(cfg, "num_attention_heads", None)
    if not isinstance(hq, int) or hq <= 0 or getattr(cfg, "kv_lora_rank", None):
        return
    hk = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or getattr(cfg, "hidden_size", 0) // hq
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if (dtype in _DTYPES and isinstance(hk, int) and hk > 0 and hq % hk == 0
            and d in _ARCH_HEAD_DIMS[_arch(device.index or 0)]):
        interval_warmup.start_for(dtype, hq, hk, d, d, device, options)


def tree_intervals(parent: np.ndarray, context: int = 0) -> np.ndarray:
    """int32 ``[nfunc, N]``: each row's visible keys (its ancestors and itself in the
    depth-first row whose predecessors are ``parent``, -1 at a root) as
    ``[F0, F1) U [F2, F3) U ...`` with ``F0 = 0``, in cuDNN's encoding ``[0, F0) U [F1, F2)
    U ...`` (``nfunc`` odd): the ancestors' chain segments in row order, then its own chain
    up to itself, padded with empty intervals at its own end.

    ``context`` (a part of a tree, :mod:`treefx.parts`): the keys are ``context`` rows of a
    path (each the child of the one before; rows past the path's end are padding, seen by
    none) followed by the N rows, and ``parent`` counts in those extended rows (``p <
    context``: the path's row ``p``). A row under path row ``p`` sees the path's rows ``[0,
    p + 1)``, which is ``F0``; the rest are the N rows' intervals moved by ``context``."""
    parent = np.asarray(parent, dtype=np.int64)
    n = len(parent)
    if n == 0:
        return np.zeros((1, 0), np.int32)
    local = np.where(parent >= context, parent - context, -1)
    if (local >= np.arange(n)).any():
        raise ValueError("tree intervals: a predecessor at or after its own row")
    starts = np.concatenate([[0], np.flatnonzero(local[1:] != np.arange(n - 1)) + 1])
    ends = np.append(starts[1:], n)
    chain_of = np.searchsorted(starts, np.arange(n), side="right") - 1
    segs: list[list[tuple[int, int]]] = []  # per chain: the segments above it, root first
    seen_context = np.zeros(len(starts), np.int64)  # per chain: the path rows it sees
    for c, s in enumerate(starts):
        p = int(local[s])
        if p < 0:
            segs.append([])
            seen_context[c] = int(parent[s]) + 1  # 0 at a root of the tree
            continue
        pc = int(chain_of[p])
        segs.append(segs[pc] + [(int(starts[pc]) + context, p + 1 + context)])  # pc < c
        seen_context[c] = seen_context[pc]
    pairs = 1 + max(len(x) for x in segs)
    f = np.empty((2 * pairs + 1, n), np.int32)
    for c, (s, e) in enumerate(zip(starts, ends)):
        rows = np.arange(s + 1 + context, e + 1 + context, dtype=np.int32)  # own ends
        f[0, s:e] = seen_context[c]
        col = 1
        for a, b in segs[c]:
            f[col, s:e], f[col + 1, s:e] = a, b
            col += 2
        f[col, s:e] = s + context
        f[col + 1:, s:e] = rows
    return f


def _visible(intervals: torch.Tensor, keys: int) -> torch.Tensor:
    """[N, keys] bool from :func:`tree_intervals`' array (plain torch path)."""
    j = torch.arange(keys, device=intervals.device)
    seen = j[None, :] < intervals[0][:, None]
    for a, b in zip(intervals[1::2], intervals[2::2]):
        seen |= (j[None, :] >= a[:, None]) & (j[None, :] < b[:, None])
    return seen


def _intervals(parent_token: torch.Tensor, context: int) -> np.ndarray:
    return derived(parent_token, ("tree intervals", context),
                   lambda row: tree_intervals(row, context))


def _plan(parent_token, q, k, v):
    """cuDNN's plan for the row's intervals at these shapes (built once per row)."""
    key = ("cudnn interval plan", tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype,
           q.device)

    def build(row):
        create = _frontend()[0]
        interval_warmup.wait(q, k, v)
        f = _intervals(parent_token, k.shape[1] - q.shape[1])
        mask = torch.from_numpy(f[None]).to(q.device, non_blocking=True)
        return create(mask, q, k, v, build_backward=True)

    return derived(parent_token, key, build)


def _check(q, k, parent_token) -> None:
    """The row and the tensors describe the same tokens (checked where the op runs, on
    concrete tensors): q's and the row's, then k's, which may have context rows first."""
    if parent_token.dim() != 1 or parent_token.shape[0] != q.shape[1] or k.shape[1] < q.shape[1]:
        raise ValueError(
            f"tree interval attention: the predecessor row has {tuple(parent_token.shape)} "
            f"entries, but q has {q.shape[1]} tokens and k {k.shape[1]} (q [1, N, H, D] and "
            "one [N] row of one depth-first tree layout; k, v [1, A + N, H, D], A >= 0 "
            "context rows first)")


def _reference(q, k, v, parent_token, scale):
    """(out, lse, probabilities, the inputs widened): plain torch, at least float32."""
    nk, group = k.shape[1], q.shape[2] // k.shape[2]
    wide = torch.promote_types(q.dtype, torch.float32)
    f = _intervals(parent_token, nk - q.shape[1])
    seen = _visible(torch.from_numpy(f).to(q.device), nk)
    qw = q[0].transpose(0, 1).to(wide)
    kw = k[0].repeat_interleave(group, 1).transpose(0, 1).to(wide)
    vw = v[0].repeat_interleave(group, 1).transpose(0, 1).to(wide)
    s = (qw @ kw.transpose(-1, -2) * scale).masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    return ((p @ vw).transpose(0, 1)[None].to(q.dtype).contiguous(), lse[None], p,
            (qw, kw, vw))


@torch.library.custom_op("treefx::interval_attention", mutates_args=())
def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, parent_token: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [1, N, Hq, Dv], lse [1, Hq, N] float32, or float64): q [1, N, Hq, D], k, v
    [1, A + N, Hk, D] (contiguous; A context rows first, a part's), each row over the keys
    its intervals name."""
    _check(q, k, parent_token)
    if q.is_cuda and q.dtype in _DTYPES and _installed():
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse, _ = _frontend()[1](q, k, v, mask_plan=_plan(parent_token, q, k, v),
                                     softmax_scale=scale, return_lse=True)
        return out, lse
    out, lse, _, _ = _reference(q, k, v, parent_token, scale)
    return out, lse


@_attend.register_fake
def _(q, k, v, parent_token, scale):
    return (q.new_empty(*q.shape[:3], v.shape[-1]),
            q.new_empty(1, q.shape[2], q.shape[1],
                        dtype=torch.promote_types(q.dtype, torch.float32)))


@torch.library.custom_op("treefx::interval_attention_backward", mutates_args=())
def _attend_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, parent_token: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the output's gradient, the output and its log-sum-exp."""
    _check(q, k, parent_token)
    if q.is_cuda and q.dtype in _DTYPES and _installed():
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        interval_warmup.wait(q, k, v, "backward")  # at the first backward: its child's kernels
        dq, dk, dv = _frontend()[2](q, k, v, out.contiguous(), grad.contiguous(), lse,
                                    mask_plan=_plan(parent_token, q, k, v),
                                    softmax_scale=scale)
        return dq, dk, dv
    _, _, p, (qw, kw, vw) = _reference(q, k, v, parent_token, scale)
    hk, group = k.shape[2], q.shape[2] // k.shape[2]
    gw = grad[0].transpose(0, 1).to(qw.dtype)
    d = (gw * out[0].transpose(0, 1).to(qw.dtype)).sum(-1, keepdim=True)
    ds = p * (gw @ vw.transpose(-1, -2) - d)  # softmax's gradient written out

    def fold(x):  # [Hq, N, D] -> [1, N, Hk, D], each KV head's group summed
        return x.view(hk, group, *x.shape[1:]).sum(1).transpose(0, 1)[None]

    return ((ds @ kw * scale).transpose(0, 1)[None].to(q.dtype).contiguous(),
            fold(ds.transpose(-1, -2) @ qw * scale).to(k.dtype).contiguous(),
            fold(p.transpose(-1, -2) @ gw).to(v.dtype).contiguous())


@_attend_backward.register_fake
def _(grad, q, k, v, out, lse, parent_token, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, parent_token, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], parent_token)
    ctx.scale = scale


def _grad(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, parent_token = ctx.saved_tensors
    dq, dk, dv = _attend_backward(grad_out, q, k, v, out, lse, parent_token, ctx.scale)
    return dq, dk, dv, None, None


_attend.register_autograd(_grad, setup_context=_setup)


def tree_interval_attention(q, k, v, parent_token, scale=None):
    """Tree attention of one depth-first row (``[1, Hq, N, D]`` q; ``[1, Hk, N, D]`` k, v
    with ``Hq % Hk == 0``; ``parent_token`` the row's predecessors): ``[1, Hq, N, Dv]``."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = _attend(q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(),
                  v.transpose(1, 2).contiguous(), parent_token, scale)[0]
    return out.transpose(1, 2)


def tree_part_interval_attention(q, k, v, k_context, v_context, parent_ext, scale=None):
    """Tree attention of a part of a tree (:func:`treefx.backward`): the part's ``[1, Hq, n,
    D]`` queries over its context's keys and values (``[1, Hk, A, D]``, the path above it
    from earlier parts, padded) and its own (``[1, Hk, n, D]``); ``parent_ext`` the part's
    predecessors in the extended row ``[context; own]``. ``[1, Hq, n, Dv]``."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    keys = torch.cat([k_context.transpose(1, 2), k.transpose(1, 2)], dim=1)
    values = torch.cat([v_context.transpose(1, 2), v.transpose(1, 2)], dim=1)
    out = _attend(q.transpose(1, 2).contiguous(), keys, values, parent_ext, scale)[0]
    return out.transpose(1, 2)
