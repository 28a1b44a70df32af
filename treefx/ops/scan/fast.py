"""Tree cumulative sum: ``cumsum`` along the tokens, taken along each token's own path.

On a sequence, ``cumsum(x)[t] = Σ_{s ≤ t} x[s]``. On the tree the tokens before t in its
sequence are its ancestors, so the tree version is the sum over t's path from the root. Models
compute positions this way (RoBERTa counts the non-padding tokens before each token; OPT-style
models count the ones of the attention mask).

Forward: pointer jumping over ancestors (after k steps every token holds the sum over its 2^k
nearest path tokens), ⌈log2 depth⌉ vectorized steps. Backward: the gradient of ``x[s]`` is the
sum of the output gradients over s's subtree, a contiguous DFS range ``[s, subtree_end[s])``:
a difference of prefix sums. The plain loop over tokens is :mod:`.reference`.
"""

from __future__ import annotations

import torch

__all__ = ["tree_cumsum"]


def _path_sums(x: torch.Tensor, parent_token: torch.Tensor) -> torch.Tensor:
    """x [N, ...] -> sums over each token's path (pointer jumping)."""
    acc = x.clone()
    anc = parent_token.clone()
    while True:
        live = anc >= 0
        if not bool(live.any()):
            return acc
        safe = anc.clamp(min=0)
        add = acc[safe]
        mask = live.view(-1, *([1] * (x.dim() - 1)))
        acc = acc + torch.where(mask, add, torch.zeros_like(add))
        anc = torch.where(live, anc[safe], anc)


def _subtree_sums(g: torch.Tensor, subtree_end: torch.Tensor) -> torch.Tensor:
    """g [N, ...] -> for each token s, Σ over its subtree [s, subtree_end[s]) of g."""
    acc = torch.promote_types(g.dtype, torch.float32) if g.is_floating_point() else g.dtype
    c = torch.cat([torch.zeros_like(g[:1], dtype=acc), g.to(acc).cumsum(0)])  # exclusive
    idx = torch.arange(g.shape[0], device=g.device)
    return (c[subtree_end] - c[idx]).to(g.dtype)


@torch.library.custom_op("treefx::tree_cumsum", mutates_args=())
def _tree_cumsum_op(x: torch.Tensor, dim: int, parent_token: torch.Tensor,
                    subtree_end: torch.Tensor) -> torch.Tensor:
    return _path_sums(x.movedim(dim, 0), parent_token).movedim(0, dim).contiguous()


@_tree_cumsum_op.register_fake
def _(x, dim, parent_token, subtree_end):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    _, dim, _, subtree_end = inputs
    ctx.dim = dim
    ctx.save_for_backward(subtree_end)


def _backward(ctx, grad):
    (subtree_end,) = ctx.saved_tensors
    g = _subtree_sums(grad.movedim(ctx.dim, 0), subtree_end).movedim(0, ctx.dim)
    return g.contiguous(), None, None, None


_tree_cumsum_op.register_autograd(_backward, setup_context=_setup)


def tree_cumsum(x: torch.Tensor, dim: int, parent_token: torch.Tensor,
                subtree_end: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.cumsum(x, dim, dtype=dtype)`` with the sum taken along each token's path
    (``dim`` is the token axis, of size N). Differentiable in ``x``."""
    if dtype is not None:
        x = x.to(dtype)
    elif not x.is_floating_point() and x.dtype != torch.int64:
        x = x.to(torch.int64)  # as torch.cumsum promotes integer and bool inputs
    return _tree_cumsum_op(x, dim % x.dim(), parent_token, subtree_end)
