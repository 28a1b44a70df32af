"""What a part of a tree (:mod:`treefx.parts`) reads from the parts before it: the keys and
values of its context tokens at every attention site, as columns of one [A, W] buffer, and the
dense tree attention over the extended row ``[context; part]``.

Per token, every site's keys, values (and conv inputs) sit side by side in one row of the
buffer (:func:`heads_to_columns`), so a later part gathers its context with one index per
token whatever the model's depth; :func:`columns_to_heads` reads a site's share back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["TreePartAttention", "columns_to_heads", "heads_to_columns", "ones_for_positions",
           "part_embedding"]


def heads_to_columns(x: torch.Tensor) -> torch.Tensor:
    """[1, H, n, D] -> [n, H * D]."""
    return x[0].transpose(0, 1).reshape(x.shape[2], x.shape[1] * x.shape[3])


def columns_to_heads(buf: torch.Tensor, offset: int, heads: int, dim: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """Columns ``[offset, offset + heads * dim)`` of ``buf`` [A, W] as [1, heads, A, dim]."""
    cols = buf[:, offset:offset + heads * dim].to(dtype)
    return cols.reshape(buf.shape[0], heads, dim).transpose(0, 1).unsqueeze(0)


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


def part_embedding(ids: torch.Tensor, weight: torch.Tensor, sink: torch.Tensor,
                   padding_idx: int) -> torch.Tensor:
    """``F.embedding(ids, weight)`` whose gradient goes to ``sink`` [n, D] (a leaf of the
    caller's, one row per token) instead of ``weight``: a part's rows of the embedding's
    gradient, which :func:`treefx.backward` adds into ``weight.grad`` at those rows only (not a
    dense [vocab, D] gradient per part). ``padding_idx`` (-1: none): rows of that id get no
    gradient, as ``F.embedding`` gives."""
    return _part_embedding(ids, weight, sink, padding_idx)


@torch.library.custom_op("treefx::part_embedding", mutates_args=())
def _part_embedding(ids: torch.Tensor, weight: torch.Tensor, sink: torch.Tensor,
                    padding_idx: int) -> torch.Tensor:
    return F.embedding(ids, weight)


@_part_embedding.register_fake
def _(ids, weight, sink, padding_idx):
    return weight.new_empty(*ids.shape, weight.shape[1])


def _embedding_setup(ctx, inputs, output):
    ids, _, sink, padding_idx = inputs
    ctx.save_for_backward(ids)
    ctx.padding_idx = padding_idx
    ctx.sink_dtype = sink.dtype


def _embedding_grad(ctx, grad):
    (ids,) = ctx.saved_tensors
    g = grad.reshape(-1, grad.shape[-1])
    if ctx.padding_idx >= 0:
        g = torch.where((ids.reshape(-1) == ctx.padding_idx)[:, None], torch.zeros_like(g), g)
    return None, None, g.to(ctx.sink_dtype), None


_part_embedding.register_autograd(_embedding_grad, setup_context=_embedding_setup)
