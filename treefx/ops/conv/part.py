"""Tree causal depthwise conv1d for a part of a tree (:mod:`treefx.parts`): the part's tokens'
left context reaches into the context row before it (inputs computed by earlier parts)."""

from __future__ import annotations

import torch

__all__ = ["tree_causal_conv1d_context"]


def tree_causal_conv1d_context(x_context: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None,
                               parent_ext: torch.Tensor) -> torch.Tensor:
    """:func:`.reference.tree_causal_conv1d` for a part of a tree (:mod:`treefx.parts`):
    ``x`` [B, C, n] the part's inputs, ``x_context`` [B, C, A] those of the context row before it (computed
    by earlier parts), ``parent_ext`` [A + n] the predecessors in the extended row
    ``[context; part]``. Returns the part's [B, C, n] outputs only."""
    w = weight.reshape(weight.shape[0], weight.shape[-1])  # [C, K]
    k = w.shape[-1]
    a = x_context.shape[-1]
    # tokens first, as the projection feeding the conv lays them out (see .fast): the
    # input's gradient then reaches that projection's backward with rows of C elements
    xt = x.transpose(1, 2)
    xe = torch.cat([x_context.to(x.dtype).transpose(1, 2), xt, torch.zeros_like(xt[:, :1])],
                   dim=1)
    rows = [torch.arange(a, a + x.shape[-1], device=x.device)]
    for _ in range(k - 1):
        prev = rows[-1]
        rows.append(torch.where(prev >= 0, parent_ext[prev.clamp(min=0)],
                                torch.full_like(prev, -1)))
    anc = torch.stack(rows)  # [K, n]
    idx = torch.where(anc >= 0, anc, torch.full_like(anc, xe.shape[1] - 1))
    out = torch.einsum("bitc,ci->btc", xe[:, idx], w.flip(-1))
    if bias is not None:
        out = out + bias
    return out.transpose(1, 2)
