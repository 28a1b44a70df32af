"""Tree attention: query ``q`` sees key ``k`` iff ``k <= q < subtree_end[k]``.

Two versions with one meaning:

- :func:`tree_attention_dense`: SDPA with the dense [N, N] boolean mask (CPU, reference,
  differentiable everywhere);
- :class:`TreeFlexAttention`: FlexAttention with a block mask built from per-block min/max of
  ``subtree_end`` (GPU, Inductor generates the kernels, forward and backward).

Both AND in the model's own mask when it has one, evaluated at path positions (so a sliding
window or any other position-based mask stays exact per sequence).

:class:`TreeFlexAttention` takes the KV heads as the model has them (fewer than the query
heads under GQA) and can lay them out along the row, block by block
(``interleave_heads``): the same values, with FlexAttention's backward launching every
head's long shared-prefix key columns first instead of the last head's last.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..mask import tree_visible

__all__ = [
    "tree_attention_dense",
    "TreeScoredAttention",
    "TreeFlexAttention",
    "sink_rescale",
    "interleave_block_tensors",
    "interleaved_block_mask",
]


def tree_attention_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tree_mask: torch.Tensor,
    model_mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """SDPA over the tree: ``tree_mask`` [N, N] bool (from :func:`dense_tree_mask`) ANDed with
    the model's own mask (boolean, or additive float), which must already be evaluated at path
    positions."""
    mask = tree_mask
    if model_mask is not None:
        if model_mask.dtype == torch.bool:
            mask = mask & model_mask
        else:
            mask = model_mask.masked_fill(~mask, float("-inf"))
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )


class TreeScoredAttention:
    """Dense tree attention for a model that transforms its scores itself before the softmax
    (a ``tanh`` softcap, a bias, a second mask): ``score_fn(scores, *sides)`` replays the
    model's own ops from ``q @ k^T`` to its softmax input, ``sides`` being the other tensors
    those ops read (the model's masks, evaluated at path positions). The tree mask is applied
    last, to the softmax input, so every key a query does not see gets probability 0 whatever
    the model did to the scores.

    Called ``(scores, v, tree_mask, *sides)`` with the model's ``q @ k^T``; returns
    ``(out, lse)``: the attention output in ``v``'s dtype and the natural log-sum-exp of each
    query's row (float32 or wider), which attention sinks and models that use it read.
    """

    def __init__(self, score_fn, *, name: str = "tree_scored_attention"):
        self.score_fn = score_fn
        self.__name__ = name

    def __call__(self, scores, v, tree_mask, *sides):
        s = self.score_fn(scores, *sides)
        s = s.to(torch.promote_types(s.dtype, torch.float32))
        s = s.masked_fill(~tree_mask, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v)
        return out, lse

    def __repr__(self) -> str:
        return self.__name__


def sink_rescale(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Attention with a *sink*: one more logit ``sink`` [B, H, N, 1] in each query's softmax
    that takes probability but has no value. Its softmax over ``[scores, sink]`` is the
    softmax over the scores times ``Z / (Z + e^sink) = sigmoid(lse - sink)``, so the sink needs
    only the plain attention's output and log-sum-exp (in float32)."""
    w = torch.sigmoid(lse.float() - sink.squeeze(-1).float())
    return out * w.unsqueeze(-1).to(out.dtype)
def _identity_score(score, b, h, q_idx, kv_idx):
    return score


def _standard_kernel_options() -> dict:
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


_STANDARD_KERNEL = _standard_kernel_options()
_TREEFX_SETS = ("BACKEND", "FORCE_USE_FLEX_ATTENTION")


def check_kernel_options(options) -> dict:
    """A user's FlexAttention ``kernel_options`` for the tree attention sites (tile sizes,
    ``num_warps``, ``USE_TMA``, ...), checked: a dict with string keys, not choosing the
    kernel (treefx keeps the standard one; see :func:`_standard_kernel_options`)."""
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


def _heads_to_row(x: torch.Tensor, kv_heads: int, nb: int, block: int) -> torch.Tensor:
    """[B, kv_heads * r, N, D] -> [B, r, nb * kv_heads * block, D]: the row zero-padded to
    ``nb`` blocks, block ``b`` of KV head ``g`` at row block ``b * kv_heads + g``."""
    bsz, heads, n, d = x.shape
    r = heads // kv_heads
    x = F.pad(x, (0, 0, 0, nb * block - n)).view(bsz, kv_heads, r, nb, block, d)
    return x.permute(0, 2, 3, 1, 4, 5).reshape(bsz, r, nb * kv_heads * block, d)


def _row_to_heads(x: torch.Tensor, kv_heads: int, nb: int, block: int, n) -> torch.Tensor:
    """The inverse of :func:`_heads_to_row`, the padding cut off."""
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


class TreeFlexAttention:
    """One attention site rewritten to FlexAttention over the tree.

    Called with ``(q, k, v, kv_num, kv_idx, full_num, full_idx, subtree_end_padded,
    positions_padded, *model_mask_buffers, *score_buffers)``. ``model_mask`` (optional) is a
    mask_mod-like callable ``(b, h, q_pos, kv_pos, *buffers) -> bool`` of path positions
    (``h`` the query head). ``score_mod`` (optional) likewise modifies a score:
    ``(score, b, h, q_pos, kv_pos, *buffers) -> score`` (the model's softcap or bias);
    ``mask_buffers`` says how many of the extra buffers are the mask's (default: all).
    ``return_lse``: return ``(out, lse)`` with the natural log-sum-exp of each query's row.
    Module-level callables, tensors as explicit buffers: no per-step state in closures. ``interleave_heads``: True, False, or None for "where the
    call computes gradients" (see :func:`check_interleave_heads`); ``layouts`` records the
    layouts the site was traced with.
    """

    def __init__(self, *, scale=None, block_size=128, model_mask=None,
                 kernel_options=None, interleave_heads=None, score_mod=None,
                 mask_buffers=None, return_lse=False, name="tree_flex_attention"):
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

    def _mask_mod(self, b, h, q_idx, kv_idx, subtree_end, positions, *bufs):
        tree = tree_visible(b, h, q_idx, kv_idx, subtree_end)
        if self.model_mask is None:
            return tree
        return tree & self.model_mask(b, h, positions[q_idx], positions[kv_idx], *bufs)

    def __call__(self, q, k, v, kv_num, kv_idx, full_num, full_idx, se_pad, pos_pad, *bufs):
        if not q.dtype == k.dtype == v.dtype:
            # Scores in a wider dtype than the values (GPT-Neo upcasts q and k): FlexAttention
            # takes one dtype, so all three go to the widest; the output is the values' dtype,
            # as ``softmax(...).to(v.dtype) @ v`` gives.
            wide = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
            out = self(q.to(wide), k.to(wide), v.to(wide), kv_num, kv_idx, full_num, full_idx,
                       se_pad, pos_pad, *bufs)
            if self.return_lse:
                return out[0].to(v.dtype), out[1]
            return out.to(v.dtype)
        n = q.shape[-2]
        if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
            raise ValueError(f"{self.__name__}: {q.shape[1]} query heads cannot share "
                             f"{k.shape[1]} key and {v.shape[1]} value heads")
        interleave = self.interleave_heads
        if interleave is None:  # the backward is what gains; the forward alone does not
            interleave = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        # A score_mod reads the usual layout's positions and heads.
        interleave = interleave and k.shape[1] > 1 and self.score_mod is None
        self.layouts.add("interleaved" if interleave else "standard")
        from torch.nn.attention.flex_attention import BlockMask

        std = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx,
                                       BLOCK_SIZE=self.block_size, mask_mod=self._mask_mod,
                                       seq_lengths=(n, n))
        if not interleave:
            return self._flex(q, k, v, std, se_pad, pos_pad, bufs)
        hk, bs = k.shape[1], self.block_size
        nb = kv_num.shape[-1]
        mask_mod = self._interleaved_mask_mod(hk, q.shape[1] // hk)
        block_mask = interleaved_block_mask(std, hk, nb * hk * bs, mask_mod)
        out = self._flex(*(_heads_to_row(x, hk, nb, bs) for x in (q, k, v)), block_mask,
                         se_pad, pos_pad, bufs)
        if self.return_lse:  # the log-sum-exp back to [B, H, N] like the output
            out, lse = out
            return (_row_to_heads(out, hk, nb, bs, n),
                    _row_to_heads(lse.unsqueeze(-1), hk, nb, bs, n).squeeze(-1))
        return _row_to_heads(out, hk, nb, bs, n)

    def _interleaved_mask_mod(self, kv_heads: int, group: int):
        """The mask_mod on the interleaved row, calling the site's own with the row position
        and the query head they have in the usual layout."""
        bs = self.block_size

        def unmix(idx):  # interleaved index -> (KV head, position in the usual row)
            return (idx // bs) % kv_heads, (idx // (bs * kv_heads)) * bs + idx % bs

        def mask_mod(b, h, q_idx, kv_idx, *bufs):
            # The block mask lists same-head blocks only (interleave_block_tensors), but the
            # mask_mod must hold on its own: FlexAttention's eager path evaluates it densely.
            (gq, qp), (gk, kp) = unmix(q_idx), unmix(kv_idx)
            return (gq == gk) & self._mask_mod(b, gq * group + h, qp, kp, *bufs)

        return mask_mod

    def _score(self, score, b, h, q_idx, kv_idx, pos, *bufs):
        return self.score_mod(score, b, h, pos[q_idx], pos[kv_idx], *bufs, q_idx=q_idx,
                              kv_idx=kv_idx)

    def _flex(self, q, k, v, block_mask, se_pad, pos_pad, bufs):
        from torch._higher_order_ops.flex_attention import flex_attention as flex_hop
        from torch.nn.attention.flex_attention import _apply_kernel_options

        m = len(bufs) if self.mask_buffers is None else self.mask_buffers
        mask_bufs = (se_pad, pos_pad, *bufs[:m])
        if self.score_mod is not None:
            score_mod, score_bufs = self._score, (pos_pad, *bufs[m:])
        else:
            score_mod, score_bufs = _identity_score, ()
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        kernel_options = _apply_kernel_options(q, k, v, self.return_lse,
                                               {**_STANDARD_KERNEL, **self.kernel_options})
        out, lse, *_ = flex_hop(
            q, k, v, score_mod, block_mask.as_tuple(), scale, kernel_options,
            score_bufs, mask_bufs,
        )
        if self.return_lse:
            return out, lse * math.log(2.0)  # the kernel's log-sum-exp is in base 2
        return out

    def __repr__(self) -> str:
        return self.__name__


class TreePartFlexAttention:
    """:class:`treefx.ops.context.TreePartAttention` with FlexAttention (inductor backend):
    the part's queries over ``[context; own]`` keys. The block mask is the tree's over the
    extended row (:func:`tree_block_tensors` of ``subtree_end_ext``), its query blocks cut to
    the part's (the context row is a whole number of blocks); the ``mask_mod`` is the same
    interval test at row ``A + q``, ANDed with the model's mask at path positions.

    Called ``(q, k, v, k_context, v_context, subtree_end_ext, positions_ext,
    *mask_buffers, *score_buffers)``. ``score_mod`` (optional): the model's own score ops as
    in :class:`TreeFlexAttention`, evaluated at the path positions of the extended row;
    ``mask_buffers``: how many of the extra buffers the mask reads (default: all);
    ``return_lse``: return ``(out, lse)``, the natural log-sum-exp of each query's row (a
    sink and a model that reads it need it). Its eager form (FlexAttention's dense math,
    differentiable on the CPU too) is the eager backend's for scored sites.
    ``interleave_heads`` as in :class:`TreeFlexAttention`: the part's query row and the
    extended key row each with the KV heads interleaved at block granularity (not with a
    ``score_mod``); ``layouts`` records the layouts the site was traced with. ``window``: the
    model mask admits no pair farther apart in path positions, so key blocks beyond it are
    left out (:func:`treefx.mask.tree_block_tensors`)."""

    def __init__(self, *, scale=None, block_size=128, model_mask=None, kernel_options=None,
                 score_mod=None, mask_buffers=None, return_lse=False, interleave_heads=None,
                 window=None, name="tree_part_flex_attention"):
        self.scale = scale
        self.window = window  # the model mask admits no pair farther apart (a sliding window)
        self.block_size = block_size
        self.model_mask = model_mask
        self.score_mod = score_mod
        self.mask_buffers = mask_buffers
        self.return_lse = return_lse
        self.kernel_options = check_kernel_options(kernel_options)
        self.interleave_heads = check_interleave_heads(interleave_heads, self.kernel_options)
        self.layouts: set[str] = set()
        self.__name__ = name

    def _mask_mod(self, b, h, q_idx, kv_idx, subtree_end, positions, offset, *bufs):
        qe = q_idx + offset[0]
        tree = (kv_idx <= qe) & (qe < subtree_end[kv_idx])
        if self.model_mask is None:
            return tree
        return tree & self.model_mask(b, h, positions[qe], positions[kv_idx], *bufs)

    def _score(self, score, b, h, q_idx, kv_idx, positions, offset, *bufs):
        return self.score_mod(score, b, h, positions[q_idx + offset[0]], positions[kv_idx],
                              *bufs)

    def _interleaved_mask_mod(self, kv_heads: int, group: int):
        """The mask_mod on the interleaved rows (queries and keys alike: block ``b`` of KV
        head ``g`` at row block ``b * kv_heads + g``), calling :meth:`_mask_mod` with the rows
        and the query head of the usual layout."""
        bs = self.block_size

        def unmix(idx):
            return (idx // bs) % kv_heads, (idx // (bs * kv_heads)) * bs + idx % bs

        def mask_mod(b, h, q_idx, kv_idx, *bufs):
            (gq, qp), (gk, kp) = unmix(q_idx), unmix(kv_idx)
            return (gq == gk) & self._mask_mod(b, gq * group + h, qp, kp, *bufs)

        return mask_mod

    def __call__(self, q, k, v, k_context, v_context, se_ext, pos_ext, *bufs):
        from torch._higher_order_ops.flex_attention import flex_attention as flex_hop
        from torch.nn.attention.flex_attention import BlockMask, _apply_kernel_options

        from ..mask import pad_to_block, tree_block_tensors

        wide = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        a, n, bs = k_context.shape[-2], q.shape[-2], self.block_size
        keys = torch.cat([k_context.to(wide), k.to(wide)], dim=-2)
        values = torch.cat([v_context.to(wide), v.to(wide)], dim=-2)
        kv_num, kv_idx, full_num, full_idx, se_pad = tree_block_tensors(
            se_ext, bs, full=self.model_mask is None,
            **({} if self.window is None else {"positions": pos_ext, "window": self.window}))
        first = a // bs  # the part's first query block in the extended row
        block_mask = BlockMask.from_kv_blocks(
            kv_num[:, :, first:], kv_idx[:, :, first:], full_num[:, :, first:],
            full_idx[:, :, first:], BLOCK_SIZE=bs, mask_mod=self._mask_mod,
            seq_lengths=(n, a + n))
        pos_pad = pad_to_block(pos_ext, bs)
        offset = torch.full((1,), a, dtype=se_ext.dtype, device=se_ext.device)
        m = len(bufs) if self.mask_buffers is None else self.mask_buffers
        if self.score_mod is not None:
            score_mod, score_bufs = self._score, (pos_pad, offset, *bufs[m:])
        else:
            score_mod, score_bufs = _identity_score, ()
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        qw = q.to(wide)
        mask_bufs = (se_pad, pos_pad, offset, *bufs[:m])
        hk = keys.shape[1]
        interleave = self.interleave_heads
        if interleave is None:  # the backward is what gains (see TreeFlexAttention)
            interleave = torch.is_grad_enabled() and any(
                t.requires_grad for t in (q, k, v, k_context, v_context))
        # A site returning its log-sum-exp (a sink) keeps the usual layout in parts: on the
        # H100 (torch 2.11) Inductor's backward of the interleaved part with the log-sum-exp
        # laid back failed a stride assertion (gpt-oss in parts, 2026-11-24); the usual
        # layout is exact there (benchmarks/HISTORY.md, "Sliding windows in the block mask").
        interleave = interleave and hk > 1 and self.score_mod is None and not self.return_lse
        self.layouts.add("interleaved" if interleave else "standard")
        if interleave:
            nbq, nbk = kv_num.shape[-1] - first, kv_num.shape[-1]
            block_mask = interleaved_block_mask(
                block_mask, hk, (nbq * hk * bs, nbk * hk * bs),
                self._interleaved_mask_mod(hk, q.shape[1] // hk))
            qw = _heads_to_row(qw, hk, nbq, bs)
            keys, values = (_heads_to_row(x, hk, nbk, bs) for x in (keys, values))
        kernel_options = _apply_kernel_options(qw, keys, values, self.return_lse,
                                               {**_STANDARD_KERNEL, **self.kernel_options})
        out, lse, *_ = flex_hop(qw, keys, values, score_mod, block_mask.as_tuple(), scale,
                                kernel_options, score_bufs, mask_bufs)
        if interleave:
            out = _row_to_heads(out, hk, nbq, bs, n)
            if self.return_lse:
                lse = _row_to_heads(lse.unsqueeze(-1), hk, nbq, bs, n).squeeze(-1)
        if self.return_lse:
            return out.to(v.dtype), lse * math.log(2.0)  # the kernel's is in base 2
        return out.to(v.dtype)

    def __repr__(self) -> str:
        return self.__name__
