"""packed_reset: sequence packing for models with state (hybrids). Each sequence its own root
in a treefx forest, nothing shared: attention is document-masked FlexAttention, the conv and
the recurrent state start from zero at every sequence, and the recurrence runs all sequences
in one variable-length call (fla): what a packing trainer does for GDN layers."""

from __future__ import annotations

import treefx

from .tree import tree_step


def make(env, model, parts, args=None):
    tm = parts.get("treefx_model") or treefx.compile(model, backend=env.tree_backend)
    parts["treefx_model"] = tm

    def prepare(tree):
        masks = [None] * tree.num_sequences if tree.loss_masks is None else [
            [list(tree.loss_mask(i))] for i in range(tree.num_sequences)]
        forest = [treefx.Tree.from_sequences([s], weights=[w], loss_masks=m)
                  for s, w, m in zip(tree.sequences, tree.weights, masks)]
        return tree_step(env, model, tm, forest)

    return prepare
