"""Tree attention for a part of a tree (:mod:`treefx.parts`): the part's queries over the keys
of its context tokens (computed by earlier parts, :mod:`treefx.ops.part_context`) and its own,
the extended row ``[context; part]``.

- :class:`TreePartAttention`: dense (SDPA; eager backend, reference);
- :class:`TreePartFlexAttention`: FlexAttention, sharing the whole tree's kernel options and
  interleaved layout (:class:`.flex.FlexSite`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...mask import pad_to_block, tree_block_tensors
from .flex import (
    FlexSite,
    heads_to_row,
    identity_score,
    interleave_wanted,
    interleaved_block_mask,
    row_to_heads,
)

__all__ = ["TreePartAttention", "TreePartFlexAttention", "ones_for_positions"]


def ones_for_positions(pos_ext: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """All ones [1, len(pos_ext)] in ``like``'s dtype: the all-ones padding mask treefx gives
    a model, long enough to be read at any position of the extended row."""
    return torch.ones(1, pos_ext.shape[0], dtype=like.dtype, device=like.device)


class TreePartAttention:
    """Dense tree attention of a part's queries over ``[context keys; its own keys]``
    (eager backend, reference). Called ``(q, k, v, k_context, v_context, subtree_end_ext,
    positions_ext, *mask_buffers)``: ``q``/``k``/``v`` [1, H(kv), n, D] the part's own,
    ``*_context`` [1, Hkv, A, D], the tree tensors over the A + n extended row. Query i is row
    A + i of it and sees key j iff ``j <= A + i < subtree_end_ext[j]``, ANDed with the
    model's own mask at path positions (``model_mask(b, h, q_pos, kv_pos, *buffers)``)."""

    def __init__(self, *, scale=None, enable_gqa=False, model_mask=None,
                 name="tree_part_attention"):
        self.scale = scale
        self.enable_gqa = enable_gqa
        self.model_mask = model_mask
        self.__name__ = name

    def __call__(self, q, k, v, k_context, v_context, se_ext, pos_ext, *bufs):
        a, n = k_context.shape[-2], q.shape[-2]
        keys = torch.cat([k_context.to(k.dtype), k], dim=-2)
        values = torch.cat([v_context.to(v.dtype), v], dim=-2)
        if self.model_mask is None:
            qi = torch.arange(n, device=q.device) + a
            ki = torch.arange(a + n, device=q.device)
            mask = (ki[None, :] <= qi[:, None]) & (qi[:, None] < se_ext[None, :])
        else:
            from torch.nn.attention.flex_attention import create_mask

            model_mask = self.model_mask

            def mod(b, h, q_idx, kv_idx):
                qe = q_idx + a
                return (kv_idx <= qe) & (qe < se_ext[kv_idx]) & model_mask(
                    b, h, pos_ext[qe], pos_ext[kv_idx], *bufs)

            mask = create_mask(mod, 1, q.shape[1], n, a + n, device=q.device)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale,
                                              enable_gqa=self.enable_gqa)

    def __repr__(self) -> str:
        return self.__name__


class TreePartFlexAttention(FlexSite):
    """:class:`TreePartAttention` with FlexAttention (inductor backend): the part's queries
    over ``[context; own]`` keys. The block mask is the tree's over the extended row
    (:func:`tree_block_tensors` of ``subtree_end_ext``), its query blocks cut to the part's
    (the context row is a whole number of blocks); the ``mask_mod`` is the same interval test
    at row ``A + q``, ANDed with the model's mask at path positions.

    Called ``(q, k, v, k_context, v_context, subtree_end_ext, positions_ext,
    *mask_buffers, *score_buffers)``. ``score_mod`` (optional): the model's own score ops as
    in :class:`.flex.TreeFlexAttention`, evaluated at the path positions of the extended row;
    ``mask_buffers``: how many of the extra buffers the mask reads (default: all);
    ``return_lse``: return ``(out, lse)``, the natural log-sum-exp of each query's row (a
    sink and a model that reads it need it). Its eager form (FlexAttention's dense math,
    differentiable on the CPU too) is the eager backend's for scored sites.
    ``interleave_heads`` as in :class:`.flex.TreeFlexAttention`: the part's query row and the
    extended key row each with the KV heads interleaved at block granularity (not with a
    ``score_mod``); ``layouts`` records the layouts the site was traced with. ``window``: the
    model mask admits no pair farther apart in path positions, so key blocks beyond it are
    left out (:func:`treefx.mask.tree_block_tensors`). ``skip_blocks`` as in
    :class:`.flex.TreeFlexAttention`, counted in the part's own query blocks."""

    def __init__(self, *, scale=None, block_size=128, model_mask=None, kernel_options=None,
                 score_mod=None, mask_buffers=None, return_lse=False, interleave_heads=None,
                 window=None, name="tree_part_flex_attention"):
        super().__init__(scale=scale, block_size=block_size, model_mask=model_mask,
                         kernel_options=kernel_options, interleave_heads=interleave_heads,
                         score_mod=score_mod, mask_buffers=mask_buffers, return_lse=return_lse,
                         name=name)
        self.window = window  # the model mask admits no pair farther apart (a sliding window)

    def _mask_mod(self, b, h, q_idx, kv_idx, subtree_end, positions, offset, *bufs):
        qe = q_idx + offset[0]
        tree = (kv_idx <= qe) & (qe < subtree_end[kv_idx])
        if self.model_mask is None:
            return tree
        return tree & self.model_mask(b, h, positions[qe], positions[kv_idx], *bufs)

    def _score(self, score, b, h, q_idx, kv_idx, positions, offset, *bufs):
        return self.score_mod(score, b, h, positions[q_idx + offset[0]], positions[kv_idx],
                              *bufs)

    def __call__(self, q, k, v, k_context, v_context, se_ext, pos_ext, *bufs, skip_blocks=None):
        from torch.nn.attention.flex_attention import BlockMask

        wide = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        a, n, bs = k_context.shape[-2], q.shape[-2], self.block_size
        keys = torch.cat([k_context.to(wide), k.to(wide)], dim=-2)
        values = torch.cat([v_context.to(wide), v.to(wide)], dim=-2)
        kv_num, kv_idx, full_num, full_idx, se_pad = tree_block_tensors(
            se_ext, bs, full=self.model_mask is None,
            **({} if self.window is None else {"positions": pos_ext, "window": self.window}))
        first = a // bs  # the part's first query block in the extended row
        own_num, own_full = self._skip_rows(kv_num[:, :, first:], full_num[:, :, first:],
                                            skip_blocks)
        site_mask = self._site_mask_mod(skip_blocks is not None)
        hk = keys.shape[1]
        # A site returning its log-sum-exp (a sink) keeps the usual layout in parts: on the
        # GPU, Inductor's backward of the interleaved part with the log-sum-exp laid back
        # failed a stride assertion (gpt-oss in parts); the usual layout is exact there
        # (benchmarks/HISTORY.md, "Sliding windows in the block mask").
        interleave = (interleave_wanted(self.interleave_heads, (q, k, v, k_context, v_context))
                      and hk > 1 and self.score_mod is None and not self.return_lse)
        pad_rows = self._query_pad(interleave)  # exact; no guard on n (_query_pad)
        block_mask = BlockMask.from_kv_blocks(
            own_num, kv_idx[:, :, first:], own_full, full_idx[:, :, first:], BLOCK_SIZE=bs,
            mask_mod=site_mask, seq_lengths=(n + pad_rows, a + n))
        pos_pad = pad_to_block(pos_ext, bs)
        offset = torch.full((1,), a, dtype=se_ext.dtype, device=se_ext.device)
        m = len(bufs) if self.mask_buffers is None else self.mask_buffers
        if self.score_mod is not None:
            score_mod, score_bufs = self._score, (pos_pad, offset, *bufs[m:])
        else:
            score_mod, score_bufs = identity_score, ()
        qw = q.to(wide)
        mask_bufs = (se_pad, pos_pad, offset, *bufs[:m], *self._skipped(skip_blocks))
        self.layouts.add("interleaved" if interleave else "standard")
        qw = self._pad_rows(qw, pad_rows)
        if interleave:
            nbq, nbk = kv_num.shape[-1] - first, kv_num.shape[-1]
            block_mask = interleaved_block_mask(
                block_mask, hk, (nbq * hk * bs, nbk * hk * bs),
                self._interleaved_mask_mod(hk, q.shape[1] // hk, site_mask))
            qw = heads_to_row(qw, hk, nbq, bs, pad_by_cat=True)
            keys, values = (heads_to_row(x, hk, nbk, bs, pad_by_cat=True)
                            for x in (keys, values))
        out = self._call_flex(qw, keys, values, block_mask, score_mod, score_bufs, mask_bufs)
        if self.return_lse:
            out, lse = out
        if interleave:
            out = row_to_heads(out, hk, nbq, bs, n)
            if self.return_lse:
                lse = row_to_heads(lse.unsqueeze(-1), hk, nbq, bs, n).squeeze(-1)
        elif pad_rows:
            out = out[:, :, :n]
            if self.return_lse:
                lse = lse[:, :, :n]
        if self.return_lse:
            return out.to(v.dtype), lse
        return out.to(v.dtype)
