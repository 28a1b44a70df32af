"""Tree cumulative sum as a plain loop over the tokens: the reference of :mod:`.fast`."""

from __future__ import annotations

import torch

__all__ = ["tree_cumsum_reference"]


def tree_cumsum_reference(x: torch.Tensor, dim: int, parent_token: torch.Tensor) -> torch.Tensor:
    """Plain loop over tokens (DFS order puts every parent first): the reference."""
    x = x.movedim(dim, 0)
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        p = int(parent_token[t])
        out[t] = x[t] if p < 0 else out[p] + x[t]
    return out.movedim(0, dim)
