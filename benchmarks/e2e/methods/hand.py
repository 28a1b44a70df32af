"""hand: what a user writes without treefx. ``treefx.pack`` for the layout, compiled
``create_block_mask`` with the interval test ``kv <= q < subtree_end[kv]``, the packed step's
compiled flex model body with ``position_ids`` = tree positions, the same chunked
cross-entropy gathered at ``parent_token`` with ``batch.loss_weights``."""

from __future__ import annotations

import torch

import treefx

from ..body import body_and_ce
from ..env import BLOCK, Env, attn_impl, set_attn


def _interval_blocks(ends):
    """The hand-written mask: create_block_mask with the interval test, evaluated per element
    (compiled, so no N x N tensor is stored). Returns the kv block tensors."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = ends.shape[0]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < ends[kv_idx])

    bm = create_block_mask(mask_mod, None, None, n, n, device=ends.device, BLOCK_SIZE=BLOCK)
    return bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices


class HandMask:
    """The hand step's block tensors from ``subtree_end``, compiled (dynamic in N)."""

    def __init__(self, env: Env):
        self.fn = torch.compile(_interval_blocks, backend=env.backend)

    def __call__(self, ends):
        torch._dynamo.maybe_mark_dynamic(ends, 0)
        return self.fn(ends)


def make(env, model, parts, args=None):
    body, ce = body_and_ce(env, model, parts)
    hand_mask = parts.setdefault("hand_mask", HandMask(env))

    def prepare(tree):
        def step():
            set_attn(model, attn_impl(env))
            model.zero_grad(set_to_none=True)
            batch = treefx.pack(tree, reduction="mean").to(env.dev)
            ends = batch.subtree_end
            blocks = hand_mask(ends)
            h = body(batch.input_ids, batch.position_ids, ends, blocks)
            loss = ce(h, batch.parent_token.clamp(min=0), batch.input_ids[0],
                      batch.loss_weights.float())
            loss.backward()
            return loss.detach()
        return step

    return prepare
