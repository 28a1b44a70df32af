"""Tree causal depthwise conv1d for traced graphs: the row's own causal conv, then the few tokens
whose window crosses a node boundary recomputed from their tree ancestors.

On the depth-first row, the K−1 tokens before token t in its sequence are the K−1 tokens before
it on the row, except at the start of a node that does not continue the row (a second or later
child, a root after the first of a forest) and in the K−2 tokens after it, where the window
reaches across that start: at most K−1 tokens per node. The row's conv
(:func:`causal_conv1d_row`) is plain torch that Inductor fuses; one opaque op then overwrites
the boundary tokens with the gather of :func:`.reference.tree_causal_conv1d` over them alone.

Why not the reference in the traced graph: its gather of K taps per token has as its backward a
scatter-add of K rows per token (atomic adds, as Inductor lowers it), and the gather reads the
[C, N] input across its strides: at Qwen3-Next's shapes those kernels were a large share of
the step (BENCHMARKS.md, "Hybrids on fla's kernels", [fla-9]).

Which tokens are boundary tokens is data (``parent_token``): they are found on the host, once
per row (:func:`treefx.ops.host_row.derived`, shared with the recurrence's nodes), and the
op's backward recomputes its forward under autograd, as the recurrence op does.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ...layout import move_tensors
from ..host_row import derived
from ..recurrence.traced import recomputed_grads

__all__ = ["boundary_taps", "causal_conv1d_row", "tree_causal_conv1d_fast"]


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
        # not inference tensors, made under torch.inference_mode (log-probabilities) and
        # reused by a training step of the same row, whose autograd saves them
        with torch.inference_mode(False):
            return tuple(move_tensors([torch.from_numpy(pos), torch.from_numpy(taps)],
                                      parent_token.device))

    return derived(parent_token, ("conv boundary taps", k), compute)


def causal_conv1d_row(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The row's own causal depthwise conv, no bias: ``x`` [B, C, N], ``w`` [C, K];
    ``out[t] = Σ_j w[:, j] · x[t − (K−1) + j]``, zeros before the row. Written as K shifted
    products (not ``F.conv1d``): in a traced graph Inductor fuses them into one kernel each
    way, accumulating in float32; cuDNN's grouped conv1d was slower at a hybrid's widths
    (``benchmarks/conv_check.py``; BENCHMARKS.md, "Hybrids on fla's kernels"). Computed on
    ``x``'s [B, N, C] transpose (:func:`_row_conv_tokens_first`) and returned as its [B, C, N]
    view."""
    return _row_conv_tokens_first(x.transpose(1, 2), w).transpose(1, 2)


def _row_conv_tokens_first(xt: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`causal_conv1d_row` on ``xt`` [B, N, C]: tokens before channels, the layout of
    the projection that feeds a model's conv (Hugging Face transposes it to [B, C, N] for
    ``nn.Conv1d``). Every tensor of the conv, forward and backward, then has the tokens
    first, so the input's gradient reaches the projection's backward products with rows of C
    elements. Computed on the [B, C, N] layout, that gradient came back with rows of N
    elements, and where N is odd (most trees) cuBLAS fell back to its unaligned kernels, a
    large share of Qwen3.5's step (BENCHMARKS.md, "Hybrids on fla's kernels", [fla-28])."""
    k, n = w.shape[-1], xt.shape[1]
    xp = F.pad(xt, (0, 0, k - 1, 0))
    out = xp[:, 0:n] * w[:, 0]
    for j in range(1, k):
        out = out + xp[:, j:j + n] * w[:, j]
    return out


def _fix(out_row, xt, w, parent_token):
    """``out_row`` [B, N, C] with the boundary tokens recomputed from their tree ancestors
    (``xt`` [B, N, C])."""
    pos, taps = _device_taps(parent_token, w.shape[-1])
    if not pos.numel():
        return out_row
    xz = F.pad(xt, (0, 0, 0, 1))  # token N: the zero row above the root
    with torch.autocast(xt.device.type, enabled=False):  # in the graph's dtype, as out_row
        fix = torch.einsum("bimc,ci->bmc", xz[:, taps], w.flip(-1))
    return out_row.index_copy(1, pos, fix.to(out_row.dtype))


@torch.library.custom_op("treefx::tree_conv1d_boundary", mutates_args=())
def _boundary_op(out_row: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                 parent_token: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = _fix(out_row, x, w, parent_token)
        return out.clone() if out is out_row else out.contiguous()


@_boundary_op.register_fake
def _(out_row, x, w, parent_token):
    return torch.empty_like(out_row, memory_format=torch.contiguous_format)


@torch.library.custom_op("treefx::tree_conv1d_boundary_backward", mutates_args=())
def _boundary_backward(out_row: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                       parent_token: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    return recomputed_grads(lambda ts: [_fix(ts[0], ts[1], ts[2], parent_token)],
                            [out_row, x, w], [grad])


@_boundary_backward.register_fake
def _(out_row, x, w, parent_token, grad):
    return [t.new_empty(t.shape) for t in (out_row, x, w)]


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    out_row, x, w, parent_token = ctx.saved_tensors
    g_row, g_x, g_w = _boundary_backward(out_row, x, w, parent_token, grad.contiguous())
    return g_row, g_x, g_w, None


_boundary_op.register_autograd(_backward, setup_context=_setup)


def tree_causal_conv1d_fast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            parent_token: torch.Tensor, dtype: torch.dtype | None = None
                            ) -> torch.Tensor:
    """:func:`.reference.tree_causal_conv1d` as traced graphs run it: the row's conv
    (:func:`causal_conv1d_row`, plain torch that Inductor fuses), then one opaque op that
    recomputes the boundary tokens. ``x`` [B, C, N], ``weight`` [C, 1, K] or [C, K]; inputs in
    ``dtype``, the dtype the model's conv computed in (which autocast may have chosen; default
    ``x``'s). Computed with the tokens first (:func:`_row_conv_tokens_first`); the result is
    the [B, C, N] view of a [B, N, C] tensor."""
    dtype = dtype or x.dtype
    xt = x.to(dtype).transpose(1, 2)
    w = weight.reshape(weight.shape[0], weight.shape[-1]).to(dtype)
    out = _boundary_op(_row_conv_tokens_first(xt, w), xt, w, parent_token)
    if bias is not None:
        out = out + bias.to(dtype)
    return out.transpose(1, 2)
