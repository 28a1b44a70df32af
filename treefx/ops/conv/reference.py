"""Tree causal depthwise conv1d: token t's left context is its tree predecessors.

A causal conv of width K computes ``out[t] = Σ_k w[k] · x[t − (K−1) + k]``. On a DFS-packed tree
the token K−1−k steps back in *its sequence* is its (K−1−k)-th tree ancestor, not the token at
DFS index t − (K−1) + k (which may sit in a sibling branch). Ancestors above the root are zeros,
as the causal conv's left padding is. Nodes shorter than K−1 tokens and single-token nodes
need nothing special: the ancestor chain simply crosses node boundaries.

The conv for a part of a tree, over its context, is :mod:`.part`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["ancestor_table", "tree_causal_conv1d"]


def ancestor_table(parent_token: torch.Tensor, depth: int) -> torch.Tensor:
    """[depth, N]: row i holds each token's i-th tree ancestor (row 0 is the token itself),
    -1 above the root."""
    rows = [torch.arange(parent_token.shape[0], device=parent_token.device)]
    for _ in range(depth - 1):
        prev = rows[-1]
        rows.append(torch.where(prev >= 0, parent_token[prev.clamp(min=0)],
                                torch.full_like(prev, -1)))
    return torch.stack(rows)


def tree_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       parent_token: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv1d over the tree. ``x`` [B, C, N]; ``weight`` [C, 1, K] (as
    ``F.conv1d`` takes it for ``groups=C``) or [C, K]; returns [B, C, N] like
    ``F.conv1d(x, weight, bias, padding=K-1, groups=C)[..., :N]`` on each sequence alone."""
    w = weight.reshape(weight.shape[0], weight.shape[-1])  # [C, K]
    k = w.shape[-1]
    anc = ancestor_table(parent_token, k)  # [K, N]; row i = i steps back
    xp = F.pad(x, (0, 1))  # index N is a zero column: "above the root"
    idx = torch.where(anc >= 0, anc, torch.full_like(anc, x.shape[-1]))
    # taps[b, c, i, t] = x at the i-th ancestor of t; tap i multiplies w[:, K-1-i].
    taps = xp[:, :, idx]
    out = torch.einsum("bcit,ci->bct", taps, w.flip(-1))
    if bias is not None:
        out = out + bias[None, :, None]
    return out
