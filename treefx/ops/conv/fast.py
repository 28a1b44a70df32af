"""Tree causal depthwise conv1d for traced graphs: the row's own causal conv, with the few tokens
whose window crosses a node boundary recomputed from their tree ancestors; one opaque op.

On the depth-first row, the K−1 tokens before token t in its sequence are the K−1 tokens before
it on the row, except near the start of a node that does not continue the row (a second or
later child, a root after the first of a forest) and in the K−2 tokens after it, where the
window reaches across that start. Those tokens are at most K−1 per node. The op runs the
row's causal conv (``F.conv1d``, as the model itself does) and overwrites the boundary tokens
with the gather of :func:`.reference.tree_causal_conv1d` over them alone.

Why not the reference in the traced graph: its gather of K taps per token has as its backward a
scatter-add of K rows per token (atomic adds, as Inductor lowers it), and the gather reads the
[C, N] input across its strides: on the H100, Qwen3-Next-shaped layers (8,192 conv channels,
17k tokens) spent about 40 ms of a 234 ms step in those kernels (BENCHMARKS.md [fla-9]).

Which tokens are boundary tokens is data (``parent_token``): they are found on the host, once
per row (:func:`treefx.ops.host_row.derived`, shared with the recurrence's nodes), and the
op's backward recomputes its forward under autograd, as the recurrence op does.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..host_row import derived
from ..recurrence.traced import recomputed_grads

__all__ = ["boundary_taps", "tree_causal_conv1d_fast", "tree_causal_conv1d_op"]


def boundary_taps(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions [M], ancestors [K, M]) for the parent row ``row`` and a conv of width ``k``:
    the tokens where some i-th tree ancestor (i < K) is not the token i places before on the
    row (above the root counts as "before the row"), and those tokens' ancestors, row i = i
    steps back, ``len(row)`` above the root (the index of a zero column)."""
    n = row.shape[0]
    t = np.arange(n)
    anc = [t]
    broken = np.zeros(n, dtype=bool)
    for i in range(1, k):
        prev = anc[-1]
        up = np.where(prev >= 0, row[np.maximum(prev, 0)], -1)
        anc.append(up)
        on_row = np.where(t - i >= 0, t - i, -1)
        broken |= up != on_row
    pos = np.flatnonzero(broken)
    taps = np.stack(anc)[:, pos]
    taps[taps < 0] = n
    return pos, taps


def _device_taps(parent_token: torch.Tensor, k: int):
    """:func:`boundary_taps` of the row on the row's device, once per row and width (one
    pinned copy, not waiting for the device's queue)."""
    def compute(row):
        pos, taps = boundary_taps(row, k)
        both = torch.from_numpy(np.concatenate([pos, taps.reshape(-1)]))
        if parent_token.device.type == "cuda":
            both = both.pin_memory()
        both = both.to(parent_token.device, non_blocking=True)
        m = pos.shape[0]
        return both[:m], both[m:].view(k, m)

    return derived(parent_token, ("conv boundary taps", k), compute)


def tree_causal_conv1d_fast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            parent_token: torch.Tensor) -> torch.Tensor:
    """:func:`.reference.tree_causal_conv1d`, eagerly: ``x`` [B, C, N], ``weight`` [C, 1, K]
    or [C, K]. Differentiable (plain torch ops)."""
    c, k = weight.shape[0], weight.shape[-1]
    w = weight.reshape(c, k)
    out = F.conv1d(F.pad(x, (k - 1, 0)), w[:, None, :], None, groups=c)
    pos, taps = _device_taps(parent_token, k)
    if pos.numel():
        xz = F.pad(x, (0, 1))  # index N: the zero column above the root
        fix = torch.einsum("bcim,ci->bcm", xz[:, :, taps], w.flip(-1))
        out = out.index_copy(-1, pos, fix)
    if bias is not None:
        out = out + bias[None, :, None]
    return out


def _run(x, weight, bias, parent_token):
    device = x.device.type
    with torch.autocast(device, enabled=False):  # the graph casts; the op keeps x's dtype
        return tree_causal_conv1d_fast(x, weight, bias, parent_token)


@torch.library.custom_op("treefx::tree_causal_conv1d", mutates_args=())
def _conv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             parent_token: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return _run(x, weight, bias, parent_token).contiguous()


@_conv_op.register_fake
def _(x, weight, bias, parent_token):
    return x.new_empty(x.shape)


@torch.library.custom_op("treefx::tree_causal_conv1d_backward", mutates_args=())
def _conv_backward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   parent_token: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    tensors = [x, weight] if bias is None else [x, weight, bias]
    return recomputed_grads(
        lambda ts: [_run(ts[0], ts[1], ts[2] if bias is not None else None, parent_token)],
        tensors, [grad])


@_conv_backward.register_fake
def _(x, weight, bias, parent_token, grad):
    return [t.new_empty(t.shape) for t in ([x, weight] if bias is None else [x, weight, bias])]


def _setup(ctx, inputs, output):
    x, weight, bias, parent_token = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, bias, parent_token)


def _backward(ctx, grad):
    x, weight, bias, parent_token = ctx.saved_tensors
    grads = _conv_backward(x, weight, bias, parent_token, grad.contiguous())
    return grads[0], grads[1], grads[2] if ctx.has_bias else None, None


_conv_op.register_autograd(_backward, setup_context=_setup)


def tree_causal_conv1d_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          parent_token: torch.Tensor, dtype: torch.dtype | None = None
                          ) -> torch.Tensor:
    """The graph's call of the op: ``x``, weight and bias in ``dtype`` (the dtype the model's
    conv computed in, which autocast may have chosen; default ``x``'s), then the opaque op."""
    dtype = dtype or x.dtype
    return _conv_op(x.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None,
                    parent_token)
