"""packed_reset: sequence packing for models with state (hybrids): each sequence its own root in
a treefx forest, the state reset at every sequence, the recurrence in one variable-length call
(fla). ``--pack-budget N``: micro-batches of at most max(N, longest) tokens (first-fit
decreasing, as :mod:`benchmarks.real_trees` packs), gradients accumulated."""

from __future__ import annotations

import treefx

from ...real_trees import call_chains, packed_step, packing_batches
from ..env import TREE_ATTN, set_attn
from .tree import tree_step


def make(env, model, parts, args=None):
    tm = parts.get("treefx_model") or treefx.compile(model, backend=env.tree_backend)
    parts["treefx_model"] = tm
    budget = getattr(args, "pack_budget", 0) or 0

    def prepare(tree):
        if budget:
            return micro_batch_step(env, model, tm, tree, budget)
        return tree_step(env, model, tm, call_chains(tree))

    return prepare


def micro_batch_step(env, model, tm, tree, budget: int):
    """One timed step over the tree's sequences in micro-batches (host-side packing done once,
    as a data loader does), gradients accumulated; returns the summed loss."""
    batches = [b.to(env.dev) for b in packing_batches(tree, budget)]

    def step():
        set_attn(model, TREE_ATTN)
        model.zero_grad(set_to_none=True)
        return packed_step(tm, batches, env.dev)

    step.micro_batches = [b.num_tokens for b in batches]
    return step
