"""The tree mask, in one place: query ``q`` sees key ``k`` iff ``k <= q < subtree_end[k]``.

``subtree_end[k]`` is one past the last DFS index of the subtree under token k, so the keys a
query sees are exactly its ancestors on its own path and itself. Everything that needs the
mask takes it from here: the dense [N, N] boolean mask (:func:`dense_tree_mask`, the CPU
attention and the reference), FlexAttention's ``mask_mod`` (:func:`tree_mask_mod`) and its
block sparsity from per-block min/max of ``subtree_end`` (:func:`tree_block_tensors`,
:func:`tree_block_mask`, no N x N work), and pictures of it (:func:`pooled_mask`,
:func:`mask_text`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "dense_tree_mask",
    "mask_text",
    "pooled_mask",
    "tree_block_mask",
    "tree_block_tensors",
    "tree_mask_mod",
]


def tree_visible(b, h, q_idx, kv_idx, subtree_end):
    """The mask's one rule, elementwise: ``kv <= q < subtree_end[kv]``."""
    return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx])


def dense_tree_mask(subtree_end: torch.Tensor) -> torch.Tensor:
    """[N, N] boolean mask, rows are queries: ``mask[q, k] = k <= q < subtree_end[k]``."""
    idx = torch.arange(subtree_end.shape[0], device=subtree_end.device)
    return (idx[None, :] <= idx[:, None]) & (idx[:, None] < subtree_end[None, :])


def tree_mask_mod(subtree_end: torch.Tensor):
    """FlexAttention ``mask_mod`` for the interval test ``kv <= q < subtree_end[kv]``.

    ``subtree_end`` must cover every index the kernel may ask for (pad it to a block multiple
    with zeros: a padded key is then visible to no query).
    """

    def tree_mask(b, h, q_idx, kv_idx):
        return tree_visible(b, h, q_idx, kv_idx, subtree_end)

    return tree_mask


def num_blocks(n, block_size: int):
    """The row's block count in treefx's block tensors: the blocks that hold its ``n`` tokens
    and one spare (empty) block. The spare keeps the count at 2 or more, so that Dynamo never
    specializes a graph for a row of one block (a size that may be 1 gets guarded, e.g. by
    contiguity checks); it lists no block and no block lists it."""
    return (n + block_size - 1) // block_size + 1


@torch.library.custom_op("treefx::pad_to_block", mutates_args=())
def pad_to_block(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x`` [N] zero-padded to :func:`num_blocks` blocks, as an opaque op: the mask reads it
    as a buffer of its own. (Inductor would otherwise fuse the pad into the FlexAttention mask
    as a masked load, and fails to generate that kernel in a forward without autograd.)"""
    n = x.shape[0]
    return F.pad(x, (0, num_blocks(n, block_size) * block_size - n))


@pad_to_block.register_fake
def _(x, block_size):
    return x.new_empty((num_blocks(x.shape[0], block_size) * block_size,))


@torch.library.custom_op("treefx::skip_query_blocks", mutates_args=())
def skip_query_blocks(num: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """A block mask's per-query-block key-block counts ``num`` [..., Q] with the first ``skip``
    (a 0-d tensor) query blocks listing none, as an opaque op like :func:`pad_to_block`: its
    output is a buffer of its own with a fixed layout. (As a pointwise ``where`` in the graph,
    the counts reach FlexAttention's kernel template unrealized in a forward without autograd,
    and Inductor's lowering fails: "convert FlexibleLayout to FixedLayout first", torch 2.11.)"""
    rows = torch.arange(num.shape[-1], device=num.device)
    return torch.where(rows >= skip, num, torch.zeros_like(num))


@skip_query_blocks.register_fake
def _(num, skip):
    return torch.empty_like(num)


@torch.library.custom_op("treefx::pad_rows_to_block", mutates_args=())
def pad_rows_to_block(x: torch.Tensor, block_size: int, dims: list[int]) -> torch.Tensor:
    """``x`` zero-padded along ``dims`` (token axes of N) to :func:`num_blocks` blocks, like
    :func:`pad_to_block`: a dense bias a FlexAttention score_mod reads at (q_idx, kv_idx),
    which the kernel may ask for past N in the row's last, partial block."""
    pad = [0] * (2 * x.dim())
    for d in dims:
        n = x.shape[d]
        pad[2 * (x.dim() - 1 - d % x.dim()) + 1] = num_blocks(n, block_size) * block_size - n
    return F.pad(x, pad)


@pad_rows_to_block.register_fake
def _(x, block_size, dims):
    shape = list(x.shape)
    for d in dims:
        shape[d] = num_blocks(shape[d], block_size) * block_size
    return x.new_empty(shape)


def block_indices(m: torch.Tensor):
    """A [q block, kv block] bool matrix as a BlockMask's (num_blocks, indices) pair, each
    with leading [1, 1] dims."""
    # Counts as a matrix-vector product (0/1 entries, exact in float32 and TF32 for any
    # number of blocks a GPU holds), not a sum: Inductor (torch 2.11) fails to generate the
    # sum's kernel in a forward without autograd when the row is exactly one block
    # (AssertionError in the reduction codegen).
    # Autocast off: a bfloat16 product would round counts above 256.
    with torch.autocast(m.device.type, enabled=False):
        ones = torch.ones(m.shape[1], 1, dtype=torch.float32, device=m.device)
        num = (m.to(torch.float32) @ ones).squeeze(1).to(torch.int32)
    # A stable sort puts the selected kv blocks first, in increasing order.
    idx = torch.sort((~m).to(torch.int8), dim=1, stable=True).indices.to(torch.int32)
    return num[None, None], idx[None, None]


def tree_block_tensors(subtree_end: torch.Tensor, block_size: int = 128, *, full: bool = True,
                       positions: torch.Tensor | None = None, window: int | None = None):
    """The block sparsity of the tree mask as the tensors of a FlexAttention ``BlockMask``:
    (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices), each with leading
    [1, 1] dims, and ``subtree_end`` zero-padded to the same blocks (for the ``mask_mod``).
    The tensors cover :func:`num_blocks` blocks: the row's and one spare, empty block.

    For a key block ``K`` strictly before a query block ``[q0, q1)``: some pair is visible iff
    ``max(subtree_end[K]) > q0``; every pair iff ``min(subtree_end[K]) >= q1``. Diagonal
    blocks are partial; blocks after the query block are empty. With ``full=False`` every
    visible block is partial (needed when another mask is ANDed in by the ``mask_mod``).
    Per-block work only: O(N + (N / block_size)^2), no N x N tensor.

    ``window`` (with ``positions``, the path positions [N]): the mask ANDed in by the
    ``mask_mod`` admits no pair farther apart than ``window`` path positions (a sliding
    window; see :func:`treefx.compiler.mask_lift.window_of`). A key block strictly before the
    query block is then kept only if ``max(positions[K]) >= min(positions[Q]) - window``: the
    nearest pair it could hold is within the window. Blocks dropped this way hold no pair the
    window admits; the kept ones stay partial (the ``mask_mod`` applies the window).
    """
    n = subtree_end.shape[0]
    nb = num_blocks(n, block_size)
    se = pad_to_block(subtree_end, block_size)
    blocks = se.view(nb, block_size)
    # Only key blocks strictly before a query block use min/max, and those are never the
    # (possibly short) last block, so the zero padding does not enter them.
    max_se = blocks.amax(dim=1)
    min_se = blocks.amin(dim=1)
    b = torch.arange(nb, device=se.device)
    q0 = b * block_size
    q1 = torch.clamp((b + 1) * block_size, max=n)
    # [q block, kv block]; rows of padding only (the spare block) list nothing.
    before = (b[None, :] < b[:, None]) & (q0 < n)[:, None]
    full_m = before & (min_se[None, :] >= q1[:, None])
    visible = before & (max_se[None, :] > q0[:, None])
    if window is not None:
        if positions is None:
            raise ValueError("a window needs the path positions")
        # Zero padding in the last query block only lowers its min: a block is kept, never lost.
        pos = pad_to_block(positions, block_size).view(nb, block_size)
        visible = visible & (pos.amax(dim=1)[None, :] >= pos.amin(dim=1)[:, None] - window)
        full = False  # a full block skips the mask_mod, which is what applies the window
    if not full:
        full_m = torch.zeros_like(full_m)
    diagonal = (b[None, :] == b[:, None]) & (q0 < n)[:, None]
    partial = (visible & ~full_m) | diagonal

    return (*block_indices(partial), *block_indices(full_m), se)


def tree_block_mask(subtree_end: torch.Tensor, block_size: int = 128):
    """FlexAttention ``BlockMask`` for ``kv <= q < subtree_end[kv]``, from per-block min/max
    of ``subtree_end`` (see :func:`tree_block_tensors`)."""
    from torch.nn.attention.flex_attention import BlockMask

    n = int(subtree_end.numel())
    kv_num, kv_idx, full_num, full_idx, se = tree_block_tensors(subtree_end, block_size)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size,
        mask_mod=tree_mask_mod(se), seq_lengths=(n, n),
    )


def pooled_mask(subtree_end, max_size: int = 512) -> tuple[np.ndarray, int]:
    """The tree mask pooled into blocks, small enough to draw.

    The tree mask (rows: queries, columns: keys) OR-pooled over ``block`` x ``block`` cells so
    that it is at most ``max_size`` on a side: ``(grid [B, B] bool, block)``. A cell is True iff
    some query of its row block sees some key of its column block. O(N + B²), no N x N tensor."""
    se = np.asarray(subtree_end.cpu() if hasattr(subtree_end, "cpu") else subtree_end,
                    dtype=np.int64).reshape(-1)
    n = len(se)
    if n == 0:
        return np.zeros((0, 0), bool), 1
    block = max(1, math.ceil(n / max_size))
    nb = math.ceil(n / block)
    k = np.arange(n)
    col = k // block
    lo = k // block  # key k sees queries k .. se[k]-1
    hi = (np.maximum(se, k + 1) - 1) // block
    diff = np.zeros((nb, nb + 1), np.int64)  # [key block, query block]
    np.add.at(diff, (col, lo), 1)
    np.add.at(diff, (col, np.minimum(hi, nb - 1) + 1), -1)
    return (np.cumsum(diff, axis=1)[:, :nb] > 0).T.copy(), block


def mask_text(subtree_end, max_size: int = 64) -> str:
    """The mask as text, one line per query (row) block: ``█`` where some query of the row
    block sees some key of the column block, ``·`` elsewhere (OR-pooled to ``max_size``)."""
    grid, _ = pooled_mask(subtree_end, max_size)
    return "\n".join("".join("█" if v else "·" for v in row) for row in grid)
