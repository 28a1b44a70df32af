"""DeepSeek's sparse-attention indexer: a top-k over the keys of a [.., N, N] score row, found
as a :class:`treefx.compiler.sites.KeySelectionSite` (the compiler's "selection" finder,
:mod:`treefx.compiler.registry`) and made per sequence by its lowering, which ANDs the tree
mask into the mask of the scores.

DeepSeek Sparse Attention (Hugging Face's DeepSeek-V3.2, GLM-MoE-DSA, dots3, AXK2) scores
every key for every query with a small *indexer*, masks the scores with the model's causal
mask, keeps each query's ``index_topk`` best keys (``topk`` over the keys) and lets the
attention see only those::

    index_scores = index_scores.masked_fill(~causal, -inf)     # or + an additive mask
    idx = index_scores.topk(min(k, N), dim=-1).indices
    selected = idx.new_ones(B, N, N, dtype=bool).scatter(-1, idx, False)   # True: not kept
    attn_mask = causal & ~selected[:, None]

On the tree's DFS row, after the positions pass, ``causal`` is ``kv_pos <= q_pos`` in path
positions, which lets a query see the tokens of *other* branches that sit at smaller path
positions: their keys would compete in the top-k with the query's own ancestors. This pass
ANDs the tree mask into the mask of the top-k's input (``dense_tree_mask``), so each query's
row holds exactly its ancestors, with the scores the sequence alone gives them, and every
other key at the masked value. The top-k then picks the same ancestors as the sequence's
own top-k picks among its earlier tokens; when a query has fewer than ``k`` ancestors, the
rest of its ``k`` are masked keys in both runs (later tokens of the sequence there, other
branches' tokens here), and the attention masks them out: the tree attention ANDs the tree
mask into every mask it is given.

That last step is what makes the selection safe, so it is checked on the final graph
(:func:`treefx.compiler.checks.leftovers.check_key_selections`): the selection may only be
scattered into a [.., N, N] mask that reaches tree attention through elementwise and shape
ops. Used any other way (its values, the indices gathering keys), compilation stops naming
the node.

Ties: a top-k whose ``k``-th and ``k+1``-th scores are equal picks between them as its
implementation decides (torch's CPU ``topk`` does not prefer the earlier key). The sequence
alone and the tree row hold the tied keys at different offsets, so the two may pick
differently, as the same model run on two devices may. Scores that tie exactly are rare
with real weights (an indexer score is a sum over 32-64 heads).

The indexer's dense [N, N] scores are the model's own code: on the tree they cover the
whole row, so their memory grows with the square of the tree's tokens (the sequences alone
need the sum of their squares).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..compiler.graph import (KEY_SELECTION, GraphContext, arg, describe, example, is_call,
                              same_size, selection_error)
from ..compiler.mask_lift import mask_applications
from ..compiler.registry import register_finder
from ..compiler.sites import KeySelectionSite
from ..compiler.taint import DATA, Taint

__all__ = ["KEY_SELECTION", "sites"]


_CASTS = ("to", "long", "int", "type", "type_as")
_FRESH = (torch.ones, torch.zeros, torch.full, torch.ones_like, torch.zeros_like,
          torch.full_like, torch.empty, torch.empty_like)
_FRESH_METHODS = ("new_ones", "new_zeros", "new_full", "new_empty")


def _pairwise(ctx: GraphContext, val) -> bool:
    """A tensor whose last two axes are the row's queries and keys ([.., N, N])."""
    n = ctx.seq_len
    return (isinstance(val, torch.Tensor) and val.dim() >= 2
            and same_size(val.shape[-1], n) and same_size(val.shape[-2], n))


def _peel(ctx: GraphContext, x: fx.Node):
    """``(scores, how, mask)`` when ``x`` masks a score row with the model's mask
    (:func:`mask_applications`; an additive mask is a float [.., N, N] tensor); else None."""
    for scores, how, mask in mask_applications(ctx, x):
        mv = example(mask) if isinstance(mask, fx.Node) else None
        if how != "additive" or (isinstance(mv, torch.Tensor) and mv.is_floating_point()
                                 and _pairwise(ctx, mv)):
            return scores, how, mask
    return None


def sites(ctx: GraphContext):
    """Every top-k over the keys of a score row of ``ctx``'s graph, checked (its scores masked
    with the model's mask, which depends on positions only; its indices only scattered into
    a fresh mask: those nodes are marked) and yielded in turn (lowered before the next is
    looked at)."""
    for node in list(ctx.graph.nodes):
        if not is_call(node, torch.topk, methods=("topk",)):
            continue
        x = node.args[0]
        val = example(x) if isinstance(x, fx.Node) else None
        if not _pairwise(ctx, val):
            continue  # not over a score row: the token-axis check judges it
        dim = arg(node, 2, "dim", -1)
        if not isinstance(dim, int) or dim % val.dim() != val.dim() - 1:
            continue  # over the queries: the token-axis check refuses it
        if arg(node, 3, "largest", True) is not True:
            raise selection_error(node, "picks the smallest scores; treefx supports the largest")
        peeled = _peel(ctx, x)
        if peeled is None:
            raise selection_error(node, "reads scores that the model does not mask with its "
                                        "attention mask; on the DFS row other sequences' keys "
                                        "would compete")
        scores, how, mask = peeled
        if DATA in Taint(ctx).of(mask):
            raise selection_error(node, f"masks its scores with `{describe(mask)}`, which "
                                        "depends on the tokens' hidden states, not only on "
                                        "positions")
        _check_uses(ctx, node)
        yield KeySelectionSite(node, x, how, mask)


_refuse = selection_error


def _check_uses(ctx: GraphContext, topk: fx.Node) -> None:
    """The selection's indices only: read through casts into a scatter along the keys of a
    fresh [.., N, N] tensor. Marks those nodes."""
    topk.meta[KEY_SELECTION] = True
    stack = list(topk.users)
    while stack:
        u = stack.pop()
        if u.op == "call_function" and u.target is operator.getitem and u.args[0] is topk:
            if u.args[1] != 1 and u.users:  # (an unread getitem is dead code)
                raise _refuse(u, "has its values read; treefx supports the indices scattered "
                                 "into an attention mask (the values of a query with fewer "
                                 "ancestors than k differ from the sequence's)")
        elif is_call(u, methods=("indices",)) or is_call(u, methods=_CASTS):
            pass
        elif is_call(u, methods=_FRESH_METHODS) and u.args[0] not in u.args[1:]:
            continue  # ``idx.new_ones(...)``: its dtype and device only
        elif (is_call(u, torch.scatter, methods=("scatter",)) and len(u.args) >= 3
              and u.args[2] in u.all_input_nodes and _is_key_scatter(ctx, u)):
            u.meta[KEY_SELECTION] = True
            continue  # its users are checked on the final graph
        elif u.op == "output":
            raise _refuse(u, "has its indices handed out of the region it is computed in (an "
                             "activation-checkpointed layer whose top-k a later layer reuses, "
                             "as GLM-MoE-DSA's shared indexer layers do); treefx follows a "
                             "selection within one graph: train without checkpointing")
        else:
            raise _refuse(u, f"has its indices used by `{describe(u)}`; treefx supports them "
                             "scattered along the keys into a fresh [.., N, N] attention mask")
        u.meta[KEY_SELECTION] = True
        stack.extend(u.users)


def _is_key_scatter(ctx: GraphContext, node: fx.Node) -> bool:
    dim = arg(node, 1, "dim", None)
    base = node.args[0]
    val = example(base) if isinstance(base, fx.Node) else None
    return (isinstance(dim, int) and _pairwise(ctx, val) and dim % val.dim() == val.dim() - 1
            and is_call(base, *_FRESH, methods=_FRESH_METHODS))


register_finder("selection", sites)
