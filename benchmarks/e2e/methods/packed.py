"""packed: the tree's sequences end to end in one row, as sequence packing trains today: HF
FlexAttention with a document-causal BlockMask (``kv <= q < doc_end[kv]``), positions restarting
per document, the compiled body (:mod:`..body`) and its chunked weighted cross-entropy."""

from __future__ import annotations

import numpy as np
import torch

import treefx

from ...internals import tree_block_tensors
from ..body import body_and_ce
from ..env import BLOCK, attn_impl, set_attn


class PackedData:
    """Per-sequence token arrays, weights and masks (the input a packing trainer starts from;
    made once per tree, outside the timed step)."""

    def __init__(self, tree: treefx.Tree):
        self.seqs = [np.asarray(s, dtype=np.int64) for s in tree.sequences]
        self.lens = np.array([len(s) for s in self.seqs], dtype=np.int64)
        # treefx's loss is the mean over the sequences: weight ω_p / P (see treefx.pack).
        self.weights = np.asarray(tree.weights, dtype=np.float64) / tree.num_sequences
        self.masks = None if tree.loss_masks is None else [np.asarray(tree.loss_mask(i))
                                                          for i in range(tree.num_sequences)]

    def layout(self):
        """ids, positions, doc ends, shift source rows, per-token weights (numpy)."""
        lens = self.lens
        n = int(lens.sum())
        starts = np.cumsum(lens) - lens
        ids = np.concatenate(self.seqs)
        pos = np.arange(n) - np.repeat(starts, lens)
        ends = np.repeat(starts + lens, lens)
        first = pos == 0
        src = np.arange(n) - 1
        src[first] = 0
        if self.masks is None:
            pred = lens - 1
            r = np.divide(1.0, pred, out=np.zeros(len(lens)), where=pred > 0)
            w = np.repeat(self.weights * r, lens)
        else:
            m = np.concatenate(self.masks).astype(np.float64)
            m[first] = 0.0
            cnt = np.add.reduceat(m, starts)
            r = np.divide(1.0, cnt, out=np.zeros(len(lens)), where=cnt > 0)
            w = m * np.repeat(self.weights * r, lens)
        w[first] = 0.0
        return ids, pos, ends, src, w


def make(env, model, parts, args=None):
    body, ce = body_and_ce(env, model, parts)

    def prepare(tree):
        data = PackedData(tree)

        def step():
            set_attn(model, attn_impl(env))
            model.zero_grad(set_to_none=True)
            ids, pos, ends, src, w = data.layout()
            ids = torch.from_numpy(ids).to(env.dev)
            pos = torch.from_numpy(pos).to(env.dev)
            ends = torch.from_numpy(ends).to(env.dev)
            src = torch.from_numpy(src).to(env.dev)
            w = torch.from_numpy(w).to(env.dev, torch.float32)
            blocks = tree_block_tensors(ends, BLOCK)[:4]  # per-block doc boundaries
            h = body(ids[None], pos[None], ends, blocks)
            loss = ce(h, src, ids, w)
            loss.backward()
            return loss.detach()
        return step

    return prepare
