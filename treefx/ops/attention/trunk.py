"""The leading chain of a depth-first row on a dense causal attention kernel.

A depth-first row laid out largest subtree first (:func:`treefx.pack`) starts with the
tree's longest chain of first children: on an agent's comb-shaped tree, the conversation's
trunk, 60-77% of the attended pairs on the SWE-bench trees (BENCHMARKS.md). Its rows
``[0, T)`` see exactly the keys ``[0, i]``: plain causal attention, which cuDNN's fused kernel
(SDPA's cuDNN backend) runs 1.7-2.5x faster than FlexAttention on an H100 (causal, 16k
tokens, 8B heads: 13.4 against 23.0 ms forward and backward; ``benchmarks.trunk_attention``).

The trunk's rows, cut to whole blocks (``T0 = T // block * block``), run here; the
FlexAttention site skips their query blocks (:func:`trunk_blocks` gives it their count) and
writes zeros there, so the site's output is the sum of the two. The query sets are disjoint,
so nothing is merged: each row's softmax is computed by one kernel over all its keys. The keys'
and values' gradients add (autograd adds the two ops').

A part of a tree (:mod:`treefx.parts`) with context rows before its own takes no trunk: its
leading rows also see the context, which a causal kernel over its own rows does not cover
(``trunk_rows`` returns 0 there, and :func:`trunk_blocks` likewise).

``T0`` is read on the host from the predecessor row's kept host copy
(:mod:`treefx.ops.host_row`), once per row: no device synchronization. The FlexAttention side
computes the same count on the device from the same row, so the two always agree.

Where the op runs: on CUDA with bf16/fp16 q, k, v of one dtype and head width at most 128
(cuDNN's), unless ``TREEFX_TRUNK_ATTENTION=0``; ``TREEFX_TRUNK_ATTENTION=1`` also takes it
wherever else (the CPU's SDPA, for tests).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ..._switches import switched_off, switched_on
from ..host_row import derived

__all__ = ["SWITCH", "trunk_attention", "trunk_blocks", "trunk_rows", "wanted"]

SWITCH = "TREEFX_TRUNK_ATTENTION"
_CUDNN_DTYPES = (torch.bfloat16, torch.float16)


def wanted(q, k, v) -> bool:
    """Whether a site with these example q, k, v (``[B, H, N, D]``) runs its trunk here."""
    if switched_off(SWITCH) or q is None or k is None or v is None:
        return False
    if not (q.dim() == k.dim() == v.dim() == 4 and q.shape[1] % k.shape[1] == 0
            and k.shape[1] == v.shape[1] and q.shape[-1] == k.shape[-1]):
        return False
    if switched_on(SWITCH):
        return q.dtype == k.dtype == v.dtype and q.dtype.is_floating_point
    return (q.is_cuda and q.dtype in _CUDNN_DTYPES and q.dtype == k.dtype == v.dtype
            and max(q.shape[-1], v.shape[-1]) <= 128 and torch.backends.cudnn.is_available())


def _chain_length(parent: np.ndarray, offset: int) -> int:
    """Rows ``[0, T)``: row 0 a root, row ``i`` the child of row ``offset + i - 1`` (the row
    before, in coordinates where the part's rows start at ``offset``)."""
    n = len(parent)
    if n == 0 or parent[0] != -1:
        return 0
    breaks = np.flatnonzero(parent[1:] != offset + np.arange(n - 1))
    return int(breaks[0]) + 1 if len(breaks) else n


def trunk_rows(parent_token: torch.Tensor, offset: int, block: int) -> int:
    """``T0``: the leading chain's rows cut to whole blocks, from the host copy of the row
    (computed once per row). 0 where the first row has a predecessor (a part whose context
    rows its rows see)."""
    t = derived(parent_token, ("trunk rows", offset), lambda row: _chain_length(row, offset))
    return t // block * block


def trunk_blocks(parent_token: torch.Tensor, offset, block: int) -> torch.Tensor:
    """``T0 // block`` as a 0-d int64 tensor on the row's device, from the row itself: the
    same count as :func:`trunk_rows` (the FlexAttention site skips that many query blocks).
    Every tensor here is the row's length (a shorter one would make the compiler guard the
    length against small values)."""
    i = torch.arange(parent_token.shape[0], device=parent_token.device)
    prev = torch.where(i == 0, -1, i - 1 + offset)
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


def _cudnn(q, k, v) -> bool:
    return q.is_cuda and q.dtype in _CUDNN_DTYPES


def _forward(q, k, v, t0, scale):
    """Causal attention of rows ``[0, t0)``: (out [B, H, t0, Dv], lse [B, H, t0] float32)."""
    group = q.shape[1] // k.shape[1]
    qs, ks, vs = q[:, :, :t0], _expand(k[:, :, :t0], group), _expand(v[:, :, :t0], group)
    if _cudnn(q, k, v):
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qs, ks, vs, None, True, 0.0, True, False, scale=scale)[:2]
        return out, lse.reshape(out.shape[:3]).float()
    out, lse = _math(qs, ks, vs, t0, scale)  # elsewhere (tests on the CPU)
    return out.detach(), lse.detach().float()


def _math(qs, ks, vs, t0, scale):
    """Causal attention in plain torch, scores in at least float32: (out, lse)."""
    s = (qs @ ks.transpose(-2, -1)).to(torch.promote_types(qs.dtype, torch.float32)) * scale
    causal = torch.ones(t0, t0, dtype=torch.bool, device=qs.device).tril()
    s = s.masked_fill(~causal, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]).to(vs.dtype) @ vs, lse


def _backward(g, q, k, v, out, lse, t0, scale):
    """(dq, dk, dv) of rows ``[0, t0)``, from the forward's output and log-sum-exp."""
    group = q.shape[1] // k.shape[1]
    qs, ks, vs = q[:, :, :t0], _expand(k[:, :, :t0], group), _expand(v[:, :, :t0], group)
    gs, os_, ls = g[:, :, :t0], out[:, :, :t0], lse[:, :, :t0]
    if _cudnn(q, k, v):
        # cuDNN reads the log-sum-exp as [B, H, T, 1] (a 3-d one crashed the process on an
        # H100, torch 2.11) and wants the output and its gradient laid out alike: contiguous
        empty = q.new_empty(0)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            gs.contiguous(), qs.contiguous(), ks.contiguous(), vs.contiguous(),
            os_.contiguous(), ls.reshape(*ls.shape, 1).contiguous(), empty, empty, None, None,
            None, t0, t0, 0.0, True, scale=scale)
    else:  # the plain math (tests on the CPU): softmax's gradient written out
        wide = torch.promote_types(q.dtype, torch.float32)
        qw, kw, vw, gw = (x.to(wide) for x in (qs, ks, vs, gs))
        s = (qw @ kw.transpose(-2, -1)) * scale
        causal = torch.ones(t0, t0, dtype=torch.bool, device=q.device).tril()
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        dv = p.transpose(-2, -1) @ gw
        dp = gw @ vw.transpose(-2, -1)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq = ((ds @ kw) * scale).to(q.dtype)
        dk = ((ds.transpose(-2, -1) @ qw) * scale).to(k.dtype)
        dv = dv.to(v.dtype)
    return dq, _fold(dk, group), _fold(dv, group)


@torch.library.custom_op("treefx::trunk_causal_attention", mutates_args=())
def _trunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, parent_token: torch.Tensor,
           offset: int, scale: float, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, N, Dv], lse [B, H, N] float32): rows ``[0, T0)`` causal, zeros after."""
    t0 = trunk_rows(parent_token, offset, block)
    out = q.new_zeros(*q.shape[:3], v.shape[-1], dtype=v.dtype)
    lse = q.new_zeros(q.shape[:3], dtype=torch.float32)
    if t0:
        o, l_ = _forward(q, k, v, t0, scale)
        out[:, :, :t0] = o
        lse[:, :, :t0] = l_
    return out, lse


@_trunk.register_fake
def _(q, k, v, parent_token, offset, scale, block):
    return (q.new_empty(*q.shape[:3], v.shape[-1], dtype=v.dtype),
            q.new_empty(q.shape[:3], dtype=torch.float32))


@torch.library.custom_op("treefx::trunk_causal_attention_backward", mutates_args=())
def _trunk_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, parent_token: torch.Tensor,
                    offset: int, scale: float, block: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t0 = trunk_rows(parent_token, offset, block)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if t0:
        a, b, c = _backward(grad, q, k, v, out, lse, t0, scale)
        dq[:, :, :t0] = a
        dk[:, :, :t0] = b
        dv[:, :, :t0] = c
    return dq, dk, dv


@_trunk_backward.register_fake
def _(grad, q, k, v, out, lse, parent_token, offset, scale, block):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, parent_token, offset, scale, block = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], parent_token)
    ctx.args = (offset, scale, block)


def _grad(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, parent_token = ctx.saved_tensors
    dq, dk, dv = _trunk_backward(grad_out, q, k, v, out, lse, parent_token, *ctx.args)
    return dq, dk, dv, None, None, None, None


_trunk.register_autograd(_grad, setup_context=_setup)


def trunk_attention(q, k, v, parent_token, offset=0, scale=None, block: int = 128):
    """Rows ``[0, T0)`` of the row's leading chain, causal attention over their own keys
    (``[B, Hq, N, D]`` q; ``[B, Hk, N, D]`` k, v with ``Hq % Hk == 0``); zeros after ``T0``.
    ``parent_token``: the rows' predecessors (in coordinates where the rows start at
    ``offset``). The output's rows are disjoint from those a FlexAttention site skipping
    :func:`trunk_blocks` query blocks computes."""
    return _trunk(q, k, v, parent_token, offset, _scale(q, scale), block)[0]
