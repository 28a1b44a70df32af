"""Positions pass: every position the model builds itself becomes the tree's position.

A model that takes ``position_ids`` gets the tree's positions as an input (the capture passes
them). A model that builds positions itself does it with an ``arange`` over the sequence
length, feeding rotary tables, a learned position embedding, or the index grids of its
attention mask. Each such ``arange`` becomes each token's offset in its own sequence. For mask
grids that is exactly the lifting the attention pass needs: the model's mask (causal, sliding
window, ...) evaluated at path positions, which the attention pass then ANDs with the tree.
"""

from __future__ import annotations

import torch

from .common import GraphContext, example, is_call, same_size

__all__ = ["positions_pass"]


def positions_pass(ctx: GraphContext) -> int:
    """Replace every ``arange`` of the sequence length by the tree positions; returns how many."""
    count = 0
    for node in list(ctx.graph.nodes):
        if not is_call(node, torch.arange):
            continue
        val = example(node)
        if val is None or val.dim() != 1 or not same_size(val.shape[0], ctx.seq_len):
            continue
        start = node.args[0] if len(node.args) >= 2 else node.kwargs.get("start", 0)
        step = node.args[2] if len(node.args) >= 3 else node.kwargs.get("step", 1)
        if step != 1:
            continue  # a strided grid is not a position
        with ctx.graph.inserting_before(node):
            new = ctx.positions
            if val.dtype != torch.int64:
                new = ctx.graph.call_method("to", (new, val.dtype))
            if not (isinstance(start, int) and start == 0):
                new = ctx.graph.call_function(torch.add, (new, start))
        if new is not ctx.positions:
            new.meta["example_value"] = val
        ctx.record("positions", node, f"{new.name} (tree positions)")
        node.replace_all_uses_with(new)
        ctx.graph.erase_node(node)
        count += 1
    return count
