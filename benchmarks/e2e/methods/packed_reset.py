"""packed_reset: sequence packing for models with state (hybrids). Each sequence its own root
in a treefx forest, nothing shared: attention is document-masked FlexAttention, the conv and
the recurrent state start from zero at every sequence, and the recurrence runs all sequences
in one variable-length call (fla): what a packing trainer does for GDN layers. With
``--pack-budget N`` the sequences go into micro-batches of at most max(N, longest) tokens
(first-fit decreasing, as :mod:`benchmarks.real_trees` packs), one forward and backward each,
gradients accumulated, their losses adding up to the mean over all sequences: a trainer's
packing where one row of every sequence does not fit."""

from __future__ import annotations

import treefx

from ..env import TREE_ATTN, set_attn
from .tree import tree_step


def make(env, model, parts, args=None):
    tm = parts.get("treefx_model") or treefx.compile(model, backend=env.tree_backend)
    parts["treefx_model"] = tm

    budget = getattr(args, "pack_budget", 0) or 0

    def prepare(tree):
        if budget:
            return micro_batch_step(env, model, tm, tree, budget)
        masks = [None] * tree.num_sequences if tree.loss_masks is None else [
            [list(tree.loss_mask(i))] for i in range(tree.num_sequences)]
        forest = [treefx.Tree.from_sequences([s], weights=[w], loss_masks=m)
                  for s, w, m in zip(tree.sequences, tree.weights, masks)]
        return tree_step(env, model, tm, forest)

    return prepare


def micro_batch_step(env, model, tm, tree, budget: int):
    """One timed step over the tree's sequences in micro-batches (host-side packing done once,
    as a data loader does): forward, tree loss and backward per micro-batch, gradients
    accumulated; returns the summed loss (the mean over all sequences)."""
    from ...real_trees import packing_batches

    batches = [b.to(env.dev) for b in packing_batches(tree, budget)]

    def step():
        set_attn(model, TREE_ATTN)
        model.zero_grad(set_to_none=True)
        total = None
        for b in batches:
            loss = treefx.tree_loss(tm(b), b)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total

    step.micro_batches = [b.num_tokens for b in batches]
    return step
