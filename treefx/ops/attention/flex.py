"""Tree attention with FlexAttention: a block mask built from per-block min/max of
``subtree_end`` (GPU, Inductor generates the kernels, forward and backward), the same meaning
as :func:`.reference.tree_attention_dense`.

:class:`TreeFlexAttention` takes the KV heads as the model has them (fewer than the query
heads under GQA) and can lay them out along the row, block by block
(``interleave_heads``): the same values, with FlexAttention's backward launching every
head's long shared-prefix key columns first instead of the last head's last. What a site over
the tree shares with the part of a tree's (:class:`.part.TreePartFlexAttention`) is here: the
kernel options, the interleaved layout and the call of FlexAttention (:class:`FlexSite`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...mask import skip_query_blocks, tree_visible

__all__ = [
    "FlexSite",
    "STANDARD_KERNEL",
    "TreeFlexAttention",
    "check_interleave_heads",
    "check_kernel_options",
    "heads_to_row",
    "interleave_block_tensors",
    "interleave_wanted",
    "interleaved_block_mask",
    "identity_score",
    "row_to_heads",
    "standard_kernel_options",
]


def identity_score(score, b, h, q_idx, kv_idx):
    """The score as it is: the ``score_mod`` of a site without one."""
    return score


def standard_kernel_options() -> dict:
    """FlexAttention kernel options for every tree attention site: the standard
    (non-decoding) kernel, in the spelling this torch understands (``BACKEND="TRITON"`` where
    it exists, else the older ``FORCE_USE_FLEX_ATTENTION``). With no autograd and fewer than
    128 queries Inductor would otherwise pick its decoding kernel, which does not take the
    tree's block mask correctly (wrong log-probs on torch 2.11).

    ``USE_TMA`` is left off: it fails on some float32 shapes (a misaligned address at
    head_dim 32 on torch 2.11); benchmarks/HISTORY.md has what it gains where it works.
    """
    import typing

    from torch.nn.attention import flex_attention as fa

    if "TRITON" in typing.get_args(getattr(fa, "_Backend", None) or ()):
        return {"BACKEND": "TRITON"}
    return {"FORCE_USE_FLEX_ATTENTION": True}


STANDARD_KERNEL = standard_kernel_options()
_TREEFX_SETS = ("BACKEND", "FORCE_USE_FLEX_ATTENTION")


def check_kernel_options(options) -> dict:
    """A user's FlexAttention ``kernel_options`` for the tree attention sites (tile sizes,
    ``num_warps``, ``USE_TMA``, ...), checked: a dict with string keys, not choosing the
    kernel (treefx keeps the standard one; see :func:`standard_kernel_options`)."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(f"kernel_options must be a dict of FlexAttention kernel options, got "
                        f"{type(options).__name__}")
    bad = [k for k in options if not isinstance(k, str)]
    if bad:
        raise TypeError(f"kernel_options keys must be option names (str), got {bad!r}")
    chosen = [k for k in options if k in _TREEFX_SETS]
    if chosen:
        raise ValueError(f"kernel_options may not set {chosen}: treefx always uses "
                         "FlexAttention's standard kernel (its decoding kernel gave wrong tree "
                         "log-probs on short rows without autograd)")
    return dict(options)


def interleave_block_tensors(num: torch.Tensor, idx: torch.Tensor, kv_heads: int):
    """A BlockMask's (num_blocks, indices) [1, 1, nb] / [1, 1, nb, nb] (either side: kv blocks
    per query block or query blocks per kv block) for the row with the KV heads interleaved at
    block granularity (block ``b * kv_heads + g`` is block ``b`` of KV head ``g``): row
    ``b * kv_heads + g`` lists the blocks of row ``b``, moved to head ``g``. Each row lists at
    most ``nb`` blocks, so the indices stay ``nb`` wide: [1, 1, nb * kv_heads, nb]."""
    nb = num.shape[-1]
    num = num[..., :, None].expand(*num.shape, kv_heads).reshape(1, 1, nb * kv_heads)
    g = torch.arange(kv_heads, device=idx.device, dtype=idx.dtype)
    idx = (idx[..., :, None, :] * kv_heads + g[:, None]).reshape(1, 1, nb * kv_heads,
                                                                 idx.shape[-1])
    return num, idx


def interleaved_block_mask(std, kv_heads: int, length, mask_mod):
    """The BlockMask of the interleaved row from the usual row's ``std`` (both sides spread
    with :func:`interleave_block_tensors`; no transposition at the interleaved size, whose
    dense intermediate would grow with the square of the KV heads). ``length``: the
    interleaved row's, or (queries, keys) where they differ (a part over its context)."""
    from torch.nn.attention.flex_attention import BlockMask

    parts = {}
    for side in ("kv", "full_kv", "q", "full_q"):
        num, idx = getattr(std, f"{side}_num_blocks"), getattr(std, f"{side}_indices")
        parts[f"{side}_num_blocks"], parts[f"{side}_indices"] = (
            (None, None) if num is None else interleave_block_tensors(num, idx, kv_heads))
    lengths = tuple(length) if isinstance(length, tuple) else (length, length)
    return BlockMask(seq_lengths=lengths, BLOCK_SIZE=std.BLOCK_SIZE, mask_mod=mask_mod,
                     **parts)


def heads_to_row(x: torch.Tensor, kv_heads: int, nb: int, block: int, *,
                 pad_by_cat: bool = False) -> torch.Tensor:
    """[B, kv_heads * r, N, D] -> [B, r, nb * kv_heads * block, D]: the row zero-padded to
    ``nb`` blocks, block ``b`` of KV head ``g`` at row block ``b * kv_heads + g``.
    ``pad_by_cat``: the zeros concatenated rather than padded, for a block count known only
    when the op runs (a part's key blocks): regional execution runs each piece once on fake
    tensors outside any trace, where ``constant_pad_nd``'s kernel wants concrete sizes."""
    bsz, heads, n, d = x.shape
    r = heads // kv_heads
    if pad_by_cat:
        x = torch.cat([x, x.new_zeros(bsz, heads, nb * block - n, d)], dim=2)
    else:
        x = F.pad(x, (0, 0, 0, nb * block - n))
    x = x.view(bsz, kv_heads, r, nb, block, d)
    return x.permute(0, 2, 3, 1, 4, 5).reshape(bsz, r, nb * kv_heads * block, d)


def row_to_heads(x: torch.Tensor, kv_heads: int, nb: int, block: int, n) -> torch.Tensor:
    """The inverse of :func:`heads_to_row`, the padding cut off."""
    bsz, r, _, d = x.shape
    x = x.view(bsz, r, nb, kv_heads, block, d).permute(0, 3, 1, 2, 4, 5)
    return x.reshape(bsz, kv_heads * r, nb * block, d)[:, :, :n]


def check_interleave_heads(interleave_heads, kernel_options: dict) -> bool | None:
    """``interleave_heads`` checked: True, False or None (treefx decides: interleaved where
    the site computes gradients, the usual layout without autograd), and never with
    ``ROWS_GUARANTEED_SAFE`` (the interleaved row pads every KV head's part to whole blocks; a
    padded query row sees no key, which that option promises never happens; None then means
    False)."""
    if interleave_heads is not None and not isinstance(interleave_heads, bool):
        raise TypeError(f"interleave_heads must be True, False or None, got "
                        f"{interleave_heads!r}")
    if kernel_options.get("ROWS_GUARANTEED_SAFE"):
        if interleave_heads:
            raise ValueError("interleave_heads=True cannot be combined with kernel option "
                             "ROWS_GUARANTEED_SAFE: the interleaved row has padded query rows "
                             "that see no key")
        return False
    return interleave_heads


def interleave_wanted(interleave_heads, tensors) -> bool:
    """A site's ``interleave_heads`` (checked by :func:`check_interleave_heads`) for one call:
    None means interleaved where the call computes gradients (the backward is what gains; the
    forward alone does not)."""
    if interleave_heads is None:
        return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return interleave_heads


class FlexSite:
    """What every FlexAttention site over a tree holds and does, whole tree
    (:class:`TreeFlexAttention`) or part (:class:`.part.TreePartFlexAttention`): the options,
    checked (``kernel_options`` by :func:`check_kernel_options`, ``interleave_heads`` by
    :func:`check_interleave_heads`), the ``mask_mod`` of the interleaved layout, and the call
    of FlexAttention with treefx's standard kernel. A subclass defines ``_mask_mod``.
    ``layouts`` records the layouts the site was traced with."""

    def __init__(self, *, scale=None, block_size=128, model_mask=None, kernel_options=None,
                 interleave_heads=None, score_mod=None, mask_buffers=None, return_lse=False,
                 name="tree_flex_attention"):
        self.scale = scale
        self.score_mod = score_mod
        self.mask_buffers = mask_buffers  # how many of the extra buffers the mask reads
        self.return_lse = return_lse
        self.kernel_options = check_kernel_options(kernel_options)
        self.interleave_heads = check_interleave_heads(interleave_heads, self.kernel_options)
        self.layouts: set[str] = set()  # the layouts this site was traced with
        self.block_size = block_size
        self.model_mask = model_mask
        self.__name__ = name

    def _site_mask_mod(self, skipping: bool):
        """The site's ``mask_mod``; ``skipping``: ANDed with ``q_idx >= rows``, the rows the
        site skips (the last mask buffer, [1]), so that a dense evaluation of the mask
        (FlexAttention's eager path) skips them as the kernel's block lists do."""
        if not skipping:
            return self._mask_mod
        inner = self._mask_mod

        def mask_mod(b, h, q_idx, kv_idx, *bufs):
            return inner(b, h, q_idx, kv_idx, *bufs[:-1]) & (q_idx >= bufs[-1][0])

        return mask_mod

    def _skipped(self, skip_blocks) -> tuple:
        """The extra mask buffer of :meth:`_site_mask_mod`: the skipped rows, [1]."""
        return () if skip_blocks is None else (skip_blocks.reshape(1) * self.block_size,)

    def _interleaved_mask_mod(self, kv_heads: int, group: int, inner=None):
        """The mask_mod on the interleaved rows (block ``b`` of KV head ``g`` at row block
        ``b * kv_heads + g``), calling the site's own (or ``inner``) with the row positions
        and the query head they have in the usual layout."""
        bs = self.block_size
        inner = inner or self._mask_mod

        def unmix(idx):  # interleaved index -> (KV head, position in the usual row)
            return (idx // bs) % kv_heads, (idx // (bs * kv_heads)) * bs + idx % bs

        def mask_mod(b, h, q_idx, kv_idx, *bufs):
            # The block mask lists same-head blocks only (interleave_block_tensors), but the
            # mask_mod must hold on its own: FlexAttention's eager path evaluates it densely.
            (gq, qp), (gk, kp) = unmix(q_idx), unmix(kv_idx)
            return (gq == gk) & inner(b, gq * group + h, qp, kp, *bufs)

        return mask_mod

    def _query_pad(self, interleave: bool) -> int:
        """Rows of zeros the usual layout's query row is padded with: one block, which the
        block tensors already count (their spare block, which lists no key block). Its length
        ``n + block`` is then one block or more for every ``n``, so Inductor's choice of its
        decoding kernel for rows of fewer than 128 queries (read off the query length even
        where the standard kernel is forced) is made without a guard on ``n``: a graph
        captured for a row of 128 tokens or more (every regional piece) is not captured again
        for a shorter one, or the reverse. The padded rows are cut off (:meth:`_unpad`), so
        no output row reads them and their gradient is zero: exact. None for the interleaved
        row (its length, blocks x KV heads x block, is at least 2 blocks, the spare's) and
        with ``ROWS_GUARANTEED_SAFE`` (a padded row sees no key, which it promises never
        happens)."""
        return 0 if interleave or self.kernel_options.get("ROWS_GUARANTEED_SAFE") \
            else self.block_size

    @staticmethod
    def _pad_rows(q: torch.Tensor, rows: int) -> torch.Tensor:
        """``q`` [B, H, n, D] with ``rows`` rows of zeros after (concatenated, not F.pad:
        see heads_to_row's pad_by_cat)."""
        if not rows:
            return q
        return torch.cat([q, q.new_zeros(*q.shape[:2], rows, q.shape[-1])], dim=2)

    def _unpad(self, out, n: int):
        """The site's output (and log-sum-exp, where it returns one) cut to ``n`` rows."""
        if self.return_lse:
            return out[0][:, :, :n], out[1][:, :, :n]
        return out[:, :, :n]

    @staticmethod
    def _skip_rows(kv_num, full_num, skip_blocks):
        """The block counts with the first ``skip_blocks`` query blocks listing no key block
        (their rows come out zero: :mod:`.trunk` computes them); None skips none."""
        if skip_blocks is None:
            return kv_num, full_num
        return (skip_query_blocks(kv_num, skip_blocks),
                None if full_num is None else skip_query_blocks(full_num, skip_blocks))

    def _call_flex(self, q, k, v, block_mask, score_mod, score_bufs, mask_bufs):
        """FlexAttention's kernel on ``q``, ``k``, ``v`` with the standard kernel and the
        site's options: the output, or ``(out, lse)`` with the natural log-sum-exp."""
        from torch._higher_order_ops.flex_attention import flex_attention as flex_hop
        from torch.nn.attention.flex_attention import _apply_kernel_options

        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        kernel_options = _apply_kernel_options(q, k, v, self.return_lse,
                                               {**STANDARD_KERNEL, **self.kernel_options})
        # A mask_mod's value is boolean: nothing it reads gets a gradient through it, so the
        # tensors it captures are detached (exactly; FlexAttention refuses captured mask
        # tensors that require grad, and a model's lifted mask can read one: Git's reads its
        # embeddings, of which it uses only the shape).
        mask_bufs = tuple(b.detach() if isinstance(b, torch.Tensor) else b for b in mask_bufs)
        out, lse, *_ = flex_hop(
            q, k, v, score_mod, block_mask.as_tuple(), scale, kernel_options,
            score_bufs, mask_bufs,
        )
        if self.return_lse:
            return out, lse * math.log(2.0)  # the kernel's log-sum-exp is in base 2
        return out

    def __repr__(self) -> str:
        return self.__name__


class TreeFlexAttention(FlexSite):
    """One attention site rewritten to FlexAttention over the tree.

    Called with ``(q, k, v, kv_num, kv_idx, full_num, full_idx, subtree_end_padded,
    positions_padded, *model_mask_buffers, *score_buffers)``. ``model_mask`` (optional) is a
    mask_mod-like callable ``(b, h, q_pos, kv_pos, *buffers) -> bool`` of path positions
    (``h`` the query head). ``score_mod`` (optional) likewise modifies a score:
    ``(score, b, h, q_pos, kv_pos, *buffers) -> score`` (the model's softcap or bias);
    ``mask_buffers`` says how many of the extra buffers are the mask's (default: all).
    ``return_lse``: return ``(out, lse)`` with the natural log-sum-exp of each query's row.
    Module-level callables, tensors as explicit buffers: no per-step state in closures.
    ``skip_blocks`` (a 0-d tensor): the first query blocks list no key block and come out
    zero (the row's leading chain, computed by :mod:`.trunk`). ``interleave_heads``: True,
    False, or None for "where the call computes gradients" (see
    :func:`check_interleave_heads`); ``layouts`` records the layouts the site was traced with.
    """

    def _mask_mod(self, b, h, q_idx, kv_idx, subtree_end, positions, *bufs):
        tree = tree_visible(b, h, q_idx, kv_idx, subtree_end)
        if self.model_mask is None:
            return tree
        return tree & self.model_mask(b, h, positions[q_idx], positions[kv_idx], *bufs)

    def __call__(self, q, k, v, kv_num, kv_idx, full_num, full_idx, se_pad, pos_pad, *bufs,
                 skip_blocks=None):
        if not q.dtype == k.dtype == v.dtype:
            # Scores in a wider dtype than the values (GPT-Neo upcasts q and k): FlexAttention
            # takes one dtype, so all three go to the widest; the output is the values' dtype,
            # as ``softmax(...).to(v.dtype) @ v`` gives.
            wide = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
            out = self(q.to(wide), k.to(wide), v.to(wide), kv_num, kv_idx, full_num, full_idx,
                       se_pad, pos_pad, *bufs, skip_blocks=skip_blocks)
            if self.return_lse:
                return out[0].to(v.dtype), out[1]
            return out.to(v.dtype)
        n = q.shape[-2]
        if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
            raise ValueError(f"{self.__name__}: {q.shape[1]} query heads cannot share "
                             f"{k.shape[1]} key and {v.shape[1]} value heads")
        # A score_mod reads the usual layout's positions and heads.
        interleave = (interleave_wanted(self.interleave_heads, (q, k, v)) and k.shape[1] > 1
                      and self.score_mod is None)
        self.layouts.add("interleaved" if interleave else "standard")
        from torch.nn.attention.flex_attention import BlockMask

        kv_num, full_num = self._skip_rows(kv_num, full_num, skip_blocks)
        site_mask, extra = self._site_mask_mod(skip_blocks is not None), \
            self._skipped(skip_blocks)
        pad_rows = self._query_pad(interleave)  # exact; no guard on n (_query_pad)
        std = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx,
                                       BLOCK_SIZE=self.block_size, mask_mod=site_mask,
                                       seq_lengths=(n + pad_rows, n))
        if not interleave:
            out = self._flex(self._pad_rows(q, pad_rows), k, v, std, se_pad, pos_pad, bufs,
                             extra)
            return self._unpad(out, n) if pad_rows else out
        hk, bs = k.shape[1], self.block_size
        nb = kv_num.shape[-1]
        mask_mod = self._interleaved_mask_mod(hk, q.shape[1] // hk, site_mask)
        block_mask = interleaved_block_mask(std, hk, nb * hk * bs, mask_mod)
        out = self._flex(*(heads_to_row(x, hk, nb, bs) for x in (q, k, v)), block_mask,
                         se_pad, pos_pad, bufs, extra)
        if self.return_lse:  # the log-sum-exp back to [B, H, N] like the output
            out, lse = out
            return (row_to_heads(out, hk, nb, bs, n),
                    row_to_heads(lse.unsqueeze(-1), hk, nb, bs, n).squeeze(-1))
        return row_to_heads(out, hk, nb, bs, n)

    def _score(self, score, b, h, q_idx, kv_idx, pos, *bufs):
        return self.score_mod(score, b, h, pos[q_idx], pos[kv_idx], *bufs, q_idx=q_idx,
                              kv_idx=kv_idx)

    def _flex(self, q, k, v, block_mask, se_pad, pos_pad, bufs, extra=()):
        m = len(bufs) if self.mask_buffers is None else self.mask_buffers
        mask_bufs = (se_pad, pos_pad, *bufs[:m], *extra)
        if self.score_mod is not None:
            score_mod, score_bufs = self._score, (pos_pad, *bufs[m:])
        else:
            score_mod, score_bufs = identity_score, ()
        return self._call_flex(q, k, v, block_mask, score_mod, score_bufs, mask_bufs)
