"""Positions pass: every position the model builds itself becomes the tree's position.

A model that takes ``position_ids`` gets the tree's positions as an input (the capture passes
them). A model that builds positions itself does it with an ``arange`` over the sequence
length, feeding rotary tables, a learned position embedding, or the index grids of its
attention mask. Each such ``arange`` becomes each token's offset in its own sequence. For mask
grids that is exactly the lifting the attention pass needs: the model's mask (causal, sliding
window, ...) evaluated at path positions, which the attention pass then ANDs with the tree.
"""

from __future__ import annotations

import operator

import torch

from ..graph import GraphContext, arg, example, is_call, same_size, set_example
from ..registry import node_rewrites

__all__ = ["positions_pass"]


def _rewrite_band(ctx: GraphContext, node) -> bool:
    """``triu``/``tril`` over a [..., N, N] grid keeps or drops entries by their distance
    in the DFS row; on a tree it is the distance in positions. Rewritten to a ``where`` on
    the position grids (exact for every query/key pair on one path: the pairs tree attention
    lets through)."""
    val = example(node.args[0])
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or not (
            same_size(val.shape[-1], ctx.seq_len) and same_size(val.shape[-2], ctx.seq_len)):
        return False
    upper = node.target in (torch.triu, "triu")
    diagonal = arg(node, 1, "diagonal", 0)
    if not isinstance(diagonal, int):
        return False
    g = ctx.graph
    with g.inserting_before(node):
        pos = ctx.positions
        q = g.call_function(operator.getitem, (pos, (slice(None), None)))
        kv = g.call_function(operator.getitem, (pos, (None, slice(None))))
        dist = g.call_function(operator.sub, (kv, q))
        keep = g.call_function(operator.ge if upper else operator.le, (dist, diagonal))
        new = g.call_function(torch.where, (keep, node.args[0],
                                            g.call_function(torch.zeros_like,
                                                            (node.args[0],))))
    for n in (q, kv, dist, keep):
        set_example(n)
    new.meta["example_value"] = val
    ctx.record("positions", node, f"{new.name} (kept by distance in positions)",
               note="triu" if upper else "tril")
    node.replace_all_uses_with(new)
    ctx.graph.erase_node(node)
    return True


def _rewrite_cumsum_of_ones(ctx: GraphContext, node) -> bool:
    """``attention_mask.cumsum(-1)`` over the all-ones mask treefx gives the model (Bloom's
    and Falcon's ALiBi, Llama 4's left-padding count) is each token's position + 1 in its own
    sequence: on the tree, the tree positions + 1."""
    from ..mask_lift import is_all_ones_input

    src = node.args[0]
    val, sv = example(node), example(src)
    dim = arg(node, 1, "dim", None)
    if (not is_all_ones_input(src) or val is None or sv is None or sv.dim() != 2
            or not isinstance(dim, int) or dim % 2 != 1 or not same_size(sv.shape[1], ctx.seq_len)
            or not same_size(sv.shape[0], 1)):
        return False
    dtype = arg(node, 2, "dtype", None) or val.dtype
    g = ctx.graph
    with g.inserting_before(node):
        row = g.call_function(operator.getitem, (ctx.positions, (None, slice(None))))
        new = g.call_function(torch.add, (row, 1))
        if dtype != torch.int64:
            new = g.call_method("to", (new, dtype))
    set_example(row)
    new.meta["example_value"] = val
    if new.args[0] is not row:
        set_example(new.args[0])
    ctx.record("positions", node, f"{new.name} (tree positions + 1)",
               note="cumsum of the all-ones attention mask")
    node.replace_all_uses_with(new)
    g.erase_node(node)
    for user in list(new.users):
        # ``cumsum == 0`` (Llama 4 counts left padding with it) is False at every token, in
        # every sequence and on the tree: a position + 1 is at least 1. Folded to a constant,
        # so its sum over the tokens reads no token.
        if is_call(user, torch.eq, operator.eq, methods=("eq", "__eq__")) and len(
                user.args) == 2 and (
                new in user.args) and _is_zero(user.args[1] if user.args[0] is new
                                               else user.args[0]):
            with g.inserting_before(user):
                false = g.call_function(torch.zeros_like, (src,), {"dtype": torch.bool})
            false.meta["example_value"] = example(user)
            ctx.record("positions", user, f"{false.name} (all False)",
                       note="a position + 1 is never 0")
            user.replace_all_uses_with(false)
            g.erase_node(user)
    return True


def _is_zero(x) -> bool:
    """A constant 0: a number, or a tensor of zeros (through casts)."""
    while is_call(x, methods=("to", "bool", "long", "int", "float")):
        x = x.args[0]
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return x == 0
    if is_call(x, torch.full, torch.full_like, methods=("new_full",)) and len(x.args) > 1:
        return _is_zero(x.args[1])
    return is_call(x, torch.zeros_like, torch.zeros, methods=("new_zeros", "zero_"))


# Ops that carry an index grid's values through unchanged (reshaped, repeated, cast).
_CARRY = (torch.unsqueeze, torch.reshape, torch.flatten, torch.repeat_interleave)
_CARRY_METHODS = ("unsqueeze", "expand", "reshape", "view", "flatten", "repeat",
                  "repeat_interleave", "to", "contiguous", "clone", "long", "int")


def _has_tensor(index) -> bool:
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, torch.fx.Node) for i in items)


def _gathered_as_token_indices(node) -> bool:
    """Whether the grid ``node`` makes (through reshapes and repeats) is itself gathered by a
    tensor index or written as values by one: a table of token indices that the model permutes
    (a mixture of experts sorting its token-expert pairs by expert:
    ``arange(N)[perm]`` picks tokens, ``inv_perm[perm] = arange(N)`` inverts the sort). Such a
    grid holds DFS indices, not positions; rewritten to positions it would pick other tokens."""
    todo, seen = [node], set()
    while todo:
        cur = todo.pop()
        if cur in seen:
            continue
        seen.add(cur)
        for user in cur.users:
            if is_call(user, *_CARRY, methods=_CARRY_METHODS) and user.args and \
                    user.args[0] is cur:
                todo.append(user)
            elif is_call(user, operator.getitem) and user.args[0] is cur:
                if _has_tensor(user.args[1]):
                    return True
                todo.append(user)  # a slice or a new axis
            elif is_call(user, torch.index_select, torch.gather, torch.take,
                         methods=("index_select", "gather", "take")) and user.args[0] is cur:
                return True
            elif is_call(user, operator.setitem) and len(user.args) > 2 and \
                    user.args[2] is cur and _has_tensor(user.args[1]):
                return True
    return False


def positions_pass(ctx: GraphContext) -> int:
    """Replace every ``arange`` of the sequence length by the tree positions; returns how many."""
    count = 0
    for node in list(ctx.graph.nodes):
        if is_call(node, torch.triu, torch.tril, methods=("triu", "tril")):
            count += _rewrite_band(ctx, node)
            continue
        if is_call(node, torch.cumsum, methods=("cumsum",)):
            count += _rewrite_cumsum_of_ones(ctx, node)
            continue
        if is_call(node, operator.getitem):  # a table cut to the token count (a family's)
            count += any(fn(ctx, node) for fn in node_rewrites("positions"))
            continue
        if not is_call(node, torch.arange):
            continue
        val = example(node)
        if val is None or val.dim() != 1 or not same_size(val.shape[0], ctx.seq_len):
            continue
        start = node.args[0] if len(node.args) >= 2 else node.kwargs.get("start", 0)
        step = node.args[2] if len(node.args) >= 3 else node.kwargs.get("step", 1)
        if step != 1:
            continue  # a strided grid is not a position
        if _gathered_as_token_indices(node):
            continue  # a table of token indices, not positions (left as the DFS index)
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
