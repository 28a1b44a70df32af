"""What a part of a tree (:mod:`treefx.parts`) reads from the parts before it: the inputs of
its context tokens at every site (attention keys and values, conv inputs), as columns of one
[A, W] buffer.

Per token, every site's keys, values (and conv inputs) sit side by side in one row of the
buffer (:func:`heads_to_columns`), so a later part gathers its context with one index per
token whatever the model's depth; :func:`columns_to_heads` reads a site's share back. The ops
over the extended row ``[context; part]`` are each op's ``part`` module
(:mod:`treefx.ops.attention.part`, :mod:`treefx.ops.conv.part`,
:mod:`treefx.ops.recurrence.part`).
"""

from __future__ import annotations

import torch

__all__ = ["columns_to_heads", "heads_to_columns"]


def heads_to_columns(x: torch.Tensor) -> torch.Tensor:
    """[1, H, n, D] -> [n, H * D]."""
    return x[0].transpose(0, 1).reshape(x.shape[2], x.shape[1] * x.shape[3])


def columns_to_heads(buf: torch.Tensor, offset: int, heads: int, dim: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """Columns ``[offset, offset + heads * dim)`` of ``buf`` [A, W] as [1, heads, A, dim]."""
    cols = buf[:, offset:offset + heads * dim].to(dtype)
    return cols.reshape(buf.shape[0], heads, dim).transpose(0, 1).unsqueeze(0)
