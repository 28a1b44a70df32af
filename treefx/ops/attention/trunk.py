"""The leading chain of a depth-first row on a dense causal attention kernel.

A depth-first row laid out largest subtree first (:func:`treefx.pack`) starts with the
tree's longest chain of first children: on an agent's comb-shaped tree, the conversation's
trunk, most of the attended pairs on the SWE-bench trees. Its rows ``[0, T)`` see exactly
the keys ``[0, i]``: plain causal attention, which cuDNN's fused kernel (SDPA's cuDNN backend)
runs faster than FlexAttention (``benchmarks.trunk_attention``; BENCHMARKS.md, "Real agent
trajectories: SWE-bench runs against per-call packing").

The trunk's rows, cut to whole blocks (``T0 = T // block * block``), run here; the
FlexAttention site skips their query blocks (:func:`trunk_blocks` gives it their count) and
writes zeros there, so the site's output is the sum of the two. The query sets are disjoint,
so nothing is merged: each row's softmax is computed by one kernel over all its keys. The keys'
and values' gradients add (autograd adds the two ops').

In a part of a tree (:mod:`treefx.parts`) the part's own rows start after its context, the
path to its first row, and the leading chain sees all of the context's rows too. The op takes
those (``k_context``, ``v_context``) as a second piece (the chain's queries over the
context's keys, all seen), merged with the causal piece by their log-sum-exps; each piece's
backward, given the merged output and log-sum-exp, is its share of the gradients. The
compiler does not use it (:func:`treefx.compiler.lower.shared.trunk_split` says why): a
part under a context runs on FlexAttention alone.

``T0`` is read on the host from the predecessor row's kept host copy
(:mod:`treefx.ops.host_row`), once per row: no device synchronization. The FlexAttention side
computes the same count on the device from the same row, so the two always agree.

Where the op runs: on CUDA with bf16/fp16 q, k, v of one dtype and one head width, at most
128 (cuDNN's), unless ``TREEFX_TRUNK_ATTENTION=0``; ``TREEFX_TRUNK_ATTENTION=1`` also takes it
wherever else (plain torch on the CPU, for tests).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ...options import Options, current
from ..host_row import derived

__all__ = ["SWITCH", "trunk_attention", "trunk_blocks", "trunk_rows", "wanted"]

SWITCH = Options.env_name("trunk_attention")
_CUDNN_DTYPES = (torch.bfloat16, torch.float16)


def wanted(q, k, v, options: Options | None = None) -> bool:
    """Whether a site with these example q, k, v (``[B, H, N, D]``) runs its trunk here
    (``options.trunk_attention``: the capture's :class:`~treefx.options.Options`)."""
    switch = current(options).trunk_attention
    if switch is False or q is None or k is None or v is None:
        return False
    if not (q.dim() == k.dim() == v.dim() == 4 and q.shape[1] % k.shape[1] == 0
            and k.shape[1] == v.shape[1] and q.shape[-1] == k.shape[-1] == v.shape[-1]):
        return False
    if switch:
        return q.dtype == k.dtype == v.dtype and q.dtype.is_floating_point
    return (q.is_cuda and q.dtype in _CUDNN_DTYPES and q.dtype == k.dtype == v.dtype
            and q.shape[-1] <= 128 and torch.backends.cudnn.is_available())


def _chain(parent: np.ndarray, offset: int, context: bool) -> tuple[int, int]:
    """``(T, k)``: rows ``[0, T)`` are the leading chain (row ``i >= 1`` the child of row
    ``offset + i - 1``, the row before in coordinates where the rows start at ``offset``), and
    row 0 sees ``k`` context rows before them (its predecessor's row + 1: a part's context is
    the path to its first row, so all of it; 0 for a root). Without ``context`` row 0 must be a
    root."""
    n = len(parent)
    if n == 0:
        return 0, 0
    k = int(parent[0]) + 1
    if k and not context:
        return 0, 0
    breaks = np.flatnonzero(parent[1:] != offset + np.arange(n - 1))
    return (int(breaks[0]) + 1 if len(breaks) else n), k


def trunk_rows(parent_token: torch.Tensor, offset: int, block: int,
               context: bool = False) -> tuple[int, int]:
    """``(T0, k)``: the leading chain's rows cut to whole blocks and the context rows they
    see, from the host copy of the row (computed once per row)."""
    t, k = derived(parent_token, ("trunk rows", offset, context),
                   lambda row: _chain(row, offset, context))
    return t // block * block, k


def trunk_blocks(parent_token: torch.Tensor, offset, block: int,
                 context: bool = False) -> torch.Tensor:
    """``T0 // block`` as a 0-d int64 tensor on the row's device, from the row itself: the
    same count as :func:`trunk_rows` (the FlexAttention site skips that many query blocks).
    Every tensor here is the row's length (a shorter one would make the compiler guard the
    length against small values)."""
    i = torch.arange(parent_token.shape[0], device=parent_token.device)
    prev = torch.where(i == 0, parent_token if context else -1, i - 1 + offset)
    return torch.cumprod((parent_token == prev).to(torch.int64), 0).sum() // block


def _scale(q, scale):
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _expand(x, group: int):
    if group == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, group, n, d).reshape(b, h * group, n, d)


def _fold(dx, group: int):
    """The gradient of :func:`_expand`: each KV head's group summed."""
    if group == 1:
        return dx
    b, hg, n, d = dx.shape
    return dx.view(b, hg // group, group, n, d).sum(2)


def _cudnn(q) -> bool:
    return q.is_cuda and q.dtype in _CUDNN_DTYPES


def _pieces(q, k, v, k_ctx, v_ctx, t0, kc):
    """The keys the rows ``[0, t0)`` see, as (keys, values, causal) with the KV heads expanded
    to the query heads: the context's ``kc`` rows (all seen), then the rows' own (causal)."""
    group = q.shape[1] // k.shape[1]
    own = (_expand(k[:, :, :t0], group), _expand(v[:, :, :t0], group), True)
    if not kc:
        return [own]
    return [(_expand(k_ctx[:, :, :kc], group), _expand(v_ctx[:, :, :kc], group), False), own]


def _scores(qs, ks, causal, scale):
    """Plain torch (tests on the CPU): the scores in at least float32, masked if causal."""
    s = (qs @ ks.transpose(-2, -1)).to(torch.promote_types(qs.dtype, torch.float32)) * scale
    if causal:
        m = qs.shape[-2]
        s = s.masked_fill(~torch.ones(m, m, dtype=torch.bool, device=qs.device).tril(),
                          float("-inf"))
    return s


def _lse_dtype(q) -> torch.dtype:
    """The log-sum-exp's dtype: float32, float64 for float64 inputs."""
    return torch.promote_types(q.dtype, torch.float32)


def _forward(qs, pieces, scale):
    """(out [B, H, t0, Dv], lse [B, H, t0]) of the rows over all the pieces' keys: each piece
    attended alone, then merged by their log-sum-exps (in float32, or float64)."""
    wide = _lse_dtype(qs)
    outs, lses = [], []
    for ks, vs, causal in pieces:
        if _cudnn(qs):
            o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
                qs, ks, vs, None, True, 0.0, causal, False, scale=scale)[:2]
            lse = lse.reshape(o.shape[:3])
        else:
            sc = _scores(qs, ks, causal, scale)
            lse = torch.logsumexp(sc, dim=-1)
            o = torch.exp(sc - lse[..., None]).to(vs.dtype) @ vs
        outs.append(o)
        lses.append(lse.to(wide))
    if len(outs) == 1:
        return outs[0], lses[0]
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    out = sum(o.to(wide) * torch.exp(l_ - lse)[..., None] for o, l_ in zip(outs, lses))
    return out.to(outs[0].dtype), lse


def _backward(gs, qs, pieces, out, lse, scale):
    """(dq, [(dk, dv) per piece]) from the merged output and log-sum-exp: each piece's
    backward with them is that piece's share of the gradients of the merged attention."""
    grads = []
    dq = None
    t0 = qs.shape[-2]
    if _cudnn(qs):
        empty = qs.new_empty(0)
        # cuDNN reads the log-sum-exp as [B, H, T, 1] (a 3-d one crashed the process) and
        # wants the output and its gradient laid out alike: contiguous
        gs, qs, out = gs.contiguous(), qs.contiguous(), out.contiguous()
        lse4 = lse.float().reshape(*lse.shape, 1).contiguous()
        for ks, vs, causal in pieces:
            a, b, c = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                gs, qs, ks.contiguous(), vs.contiguous(), out, lse4, empty, empty, None, None,
                None, t0, ks.shape[-2], 0.0, causal, scale=scale)
            dq = a if dq is None else dq + a
            grads.append((b, c))
        return dq, grads
    wide = torch.promote_types(qs.dtype, torch.float32)
    gw, qw = gs.to(wide), qs.to(wide)
    d = (gw * out.to(wide)).sum(-1, keepdim=True)
    for ks, vs, causal in pieces:  # softmax's gradient written out
        kw, vw = ks.to(wide), vs.to(wide)
        p = torch.exp(_scores(qw, kw, causal, scale) - lse.to(wide)[..., None])
        ds = p * (gw @ vw.transpose(-2, -1) - d)
        a = ((ds @ kw) * scale).to(qs.dtype)
        dq = a if dq is None else dq + a
        grads.append((((ds.transpose(-2, -1) @ qw) * scale).to(ks.dtype),
                      (p.transpose(-2, -1) @ gw).to(vs.dtype)))
    return dq, grads


@torch.library.custom_op("treefx::trunk_causal_attention", mutates_args=())
def _trunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_ctx: torch.Tensor | None,
           v_ctx: torch.Tensor | None, parent_token: torch.Tensor, offset: int, scale: float,
           block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, N, Dv], lse [B, H, N] float32, or float64): rows ``[0, T0)`` over the
    context rows they see and their own keys causally, zeros after."""
    t0, kc = trunk_rows(parent_token, offset, block, k_ctx is not None)
    out = q.new_zeros(*q.shape[:3], v.shape[-1], dtype=v.dtype)
    lse = q.new_zeros(q.shape[:3], dtype=_lse_dtype(q))
    if t0:
        o, l_ = _forward(q[:, :, :t0], _pieces(q, k, v, k_ctx, v_ctx, t0, kc), scale)
        out[:, :, :t0] = o
        lse[:, :, :t0] = l_
    return out, lse


@_trunk.register_fake
def _(q, k, v, k_ctx, v_ctx, parent_token, offset, scale, block):
    return (q.new_empty(*q.shape[:3], v.shape[-1], dtype=v.dtype),
            q.new_empty(q.shape[:3], dtype=_lse_dtype(q)))


@torch.library.custom_op("treefx::trunk_causal_attention_backward", mutates_args=())
def _trunk_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_ctx: torch.Tensor | None, v_ctx: torch.Tensor | None, out: torch.Tensor,
                    lse: torch.Tensor, parent_token: torch.Tensor, offset: int, scale: float,
                    block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                         torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dk_ctx, dv_ctx); the last two empty without a context."""
    t0, kc = trunk_rows(parent_token, offset, block, k_ctx is not None)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dkc, dvc = ((q.new_empty(0), q.new_empty(0)) if k_ctx is None
                else (torch.zeros_like(k_ctx), torch.zeros_like(v_ctx)))
    if t0:
        group = q.shape[1] // k.shape[1]
        a, grads = _backward(grad[:, :, :t0], q[:, :, :t0],
                             _pieces(q, k, v, k_ctx, v_ctx, t0, kc), out[:, :, :t0],
                             lse[:, :, :t0], scale)
        dq[:, :, :t0] = a
        if kc:
            dkc[:, :, :kc] = _fold(grads[0][0], group)
            dvc[:, :, :kc] = _fold(grads[0][1], group)
        dk[:, :, :t0] = _fold(grads[-1][0], group)
        dv[:, :, :t0] = _fold(grads[-1][1], group)
    return dq, dk, dv, dkc, dvc


@_trunk_backward.register_fake
def _(grad, q, k, v, k_ctx, v_ctx, out, lse, parent_token, offset, scale, block):
    empty = q.new_empty(0)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            empty if k_ctx is None else torch.empty_like(k_ctx),
            empty if v_ctx is None else torch.empty_like(v_ctx))


def _setup(ctx, inputs, output):
    q, k, v, k_ctx, v_ctx, parent_token, offset, scale, block = inputs
    ctx.has_context = k_ctx is not None
    ctx.save_for_backward(q, k, v, k_ctx, v_ctx, output[0], output[1], parent_token)
    ctx.args = (offset, scale, block)


def _grad(ctx, grad_out, _grad_lse):
    q, k, v, k_ctx, v_ctx, out, lse, parent_token = ctx.saved_tensors
    dq, dk, dv, dkc, dvc = _trunk_backward(grad_out, q, k, v, k_ctx, v_ctx, out, lse,
                                           parent_token, *ctx.args)
    if not ctx.has_context:
        dkc = dvc = None
    return dq, dk, dv, dkc, dvc, None, None, None, None


_trunk.register_autograd(_grad, setup_context=_setup)


def trunk_attention(q, k, v, parent_token, offset=0, scale=None, block: int = 128,
                    k_context=None, v_context=None):
    """Rows ``[0, T0)`` of the row's leading chain (``[B, Hq, N, D]`` q; ``[B, Hk, N, D]`` k, v
    with ``Hq % Hk == 0``), attention over their own keys causally and, in a part of a tree,
    over the context rows they see (``k_context``, ``v_context`` [B, Hk, A, D]: row 0's
    predecessor and the path before it, all seen); zeros after ``T0``. ``parent_token``: the
    rows' predecessors (in coordinates where the rows start at ``offset``, the context's
    padded length). The output's rows are disjoint from those a FlexAttention site skipping
    :func:`trunk_blocks` query blocks computes."""
    return _trunk(q, k, v, k_context, v_context, parent_token, offset, _scale(q, scale),
                  block)[0]
