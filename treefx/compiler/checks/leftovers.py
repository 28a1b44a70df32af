"""The checks after the passes: nothing attention-like, no sequence state, no key selection
outside tree attention is left, and a training step's loss was found."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ...ops.attention import (TreeFlexAttention, TreePartFlexAttention, TreeScoredAttention,
                              tree_attention_dense)
from ...ops.attention import TreePartAttention
from ..graph import (
    KEY_SELECTION,
    GraphContext,
    TreeCompileError,
    arg,
    attention_error,
    describe,
    example,
    is_call,
    on_sequence,
    same_size,
    state_error,
    token_axis_error,
)
from ..patterns import OTHER_ATTENTION, SDPA, SOFTMAX, feeds_matmul

__all__ = ["check_key_selections", "check_loss_found", "check_no_attention_left",
           "check_no_state_left"]


# ---------------------------------------------------------------------------- attention

def check_no_attention_left(ctx: GraphContext) -> None:
    """After all passes: anything attention-like that survived is an error."""
    for node in ctx.graph.nodes:
        if node.op == "call_function" and node.target in OTHER_ATTENTION + SDPA:
            raise attention_error(node, "this attention op is not one treefx can rewrite")
        if node.op == "call_function" and "flex_attention" in str(node.target) and not isinstance(
            node.target, (TreeFlexAttention, TreePartFlexAttention)
        ):
            raise attention_error(node, "the model calls flex_attention itself; treefx does not "
                                        "rewrite a model's own flex_attention yet")
        if is_call(node, *SOFTMAX, methods=("softmax",)) and feeds_matmul(node):
            raise attention_error(node, "a softmax feeds a matmul here, but not in a pattern "
                                        "treefx recognises as attention")


# ---------------------------------------------------------------------------- state

_SCANS = (torch.cumsum, torch.cumprod, torch.logcumsumexp, torch.cummax, torch.cummin)
_SCAN_METHODS = ("cumsum", "cumprod", "logcumsumexp", "cummax", "cummin")
_RESHAPES = (torch.reshape,)
_RESHAPE_METHODS = ("view", "reshape", "unflatten")
_MATMULS = (torch.matmul, operator.matmul, torch.bmm)


def _has_seq_axis(ctx: GraphContext, val) -> bool:
    """Some axis runs along the tokens: its size is N, or (with dynamic shapes) depends on N,
    as a padded token axis does."""
    if not isinstance(val, torch.Tensor):
        return False
    n = ctx.seq_len
    syms = n.node.expr.free_symbols if isinstance(n, torch.SymInt) else set()
    for s in val.shape:
        if same_size(s, n):
            return True
        if syms and isinstance(s, torch.SymInt) and s.node.expr.free_symbols & syms:
            return True
    return False


def _keeps_tokens_whole(ctx: GraphContext, val) -> bool:
    """Some axis is a whole multiple of N: tokens merged with other axes (a per-token
    flatten, like [1, N, H, D] -> [N*H, D]), not cut into chunks."""
    n = ctx.seq_len
    for s in val.shape:
        if isinstance(s, torch.SymInt) or isinstance(n, torch.SymInt):
            import sympy

            expr = getattr(s, "node", None)
            nexpr = getattr(n, "node", None)
            ratio = sympy.simplify((expr.expr if expr is not None else sympy.Integer(s)) /
                                   (nexpr.expr if nexpr is not None else sympy.Integer(n)))
            if ratio.is_Integer and ratio > 0:
                return True
        elif n and s % n == 0 and s > 0:
            return True
    return False


def check_no_state_left(ctx: GraphContext) -> None:
    """After the passes, nothing may still mix tokens along the DFS row: every op that does
    (attention, convs, recurrences, the loss's shift) has been rewritten to read the tree.
    Flags scans along the tokens, reshapes that cut the token axis into chunks (how chunked
    recurrences start), and matmuls that contract over the tokens."""
    for node in ctx.graph.nodes:
        if is_call(node, *_RESHAPES, methods=_RESHAPE_METHODS):
            src, out = example(node.args[0]), example(node)
            if _has_seq_axis(ctx, src) and isinstance(out, torch.Tensor) and \
                    not _keeps_tokens_whole(ctx, out):
                raise state_error(node, f"a reshape cuts the token axis {tuple(src.shape)} -> "
                                        f"{tuple(out.shape)} (chunks of an unregistered "
                                        "recurrence? see treefx.register_recurrence)")
        if is_call(node, *_MATMULS, methods=("matmul", "bmm")):
            a, b = (example(x) for x in node.args[:2])
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() >= 2 and \
                    same_size(a.shape[-1], ctx.seq_len) and same_size(b.shape[-2], ctx.seq_len):
                raise state_error(node, "a matmul contracts over the tokens (attention or a linear "
                                        "recurrence treefx does not recognise)")
        if is_call(node, *_SCANS, methods=_SCAN_METHODS):
            x = node.args[0]
            dim = arg(node, 1, "dim")
            val = example(x)
            if val is not None and isinstance(dim, int) and on_sequence(ctx, x, dim) and \
                    val.shape[dim] != 1:
                raise state_error(node, "a cumulative op runs along the tokens (an unregistered "
                                        "recurrence? see treefx.register_recurrence)")


# ---------------------------------------------------------------------------- key selections

# What may carry a selection to the tree attention: elementwise logic, masking and shape ops.
_CARRY_METHODS = ("unsqueeze", "view", "reshape", "expand", "expand_as", "contiguous",
                  "logical_not", "logical_and", "logical_or", "bitwise_not", "bitwise_and",
                  "bitwise_or", "masked_fill", "to", "bool", "float", "type_as", "__invert__",
                  "__and__", "__or__", "add")
_CARRY_FUNCS = (operator.invert, operator.and_, operator.or_, operator.iand, operator.ior,
                operator.add, torch.logical_not, torch.logical_and, torch.logical_or,
                torch.bitwise_not, torch.bitwise_and, torch.bitwise_or, torch.masked_fill,
                torch.where, torch.unsqueeze, torch.reshape, torch.add)


def _is_view_index(node: fx.Node) -> bool:
    """``x[:, None]``, ``x[..., 0, :]``: indexing by slices, None, Ellipsis and integers."""
    if not (node.op == "call_function" and node.target is operator.getitem):
        return False
    key = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    return all(k is None or k is Ellipsis or isinstance(k, (slice, int)) for k in key)


def _is_tree_attention(node: fx.Node) -> bool:
    """A tree attention op: its first three operands are the queries (or scores), keys and
    values; the others its masks, score sides and buffers, which it ANDs with the tree."""
    t = node.target
    return node.op == "call_function" and (
        t is tree_attention_dense or isinstance(t, (TreeFlexAttention, TreePartFlexAttention,
                                                    TreeScoredAttention, TreePartAttention)))


def check_key_selections(ctx: GraphContext) -> None:
    """After all passes: every selection reaches tree attention only (which ANDs the tree
    mask into it), through elementwise and shape ops."""
    for node in ctx.graph.nodes:
        if not (node.meta.get(KEY_SELECTION) and is_call(node, torch.scatter,
                                                         methods=("scatter",))):
            continue
        stack, seen = [node], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            for u in n.users:
                if u.target is torch.ops.treefx.pad_rows_to_block.default:
                    stack.append(u)  # a score_mod's buffer, read by a tree attention
                    continue
                if _is_tree_attention(u) and n not in u.args[:3] and n not in u.kwargs.values():
                    continue  # a mask, bias or score side: not the queries, keys or values
                if is_call(u, *_CARRY_FUNCS, methods=_CARRY_METHODS) or _is_view_index(u):
                    stack.append(u)
                    continue
                raise token_axis_error(u, "the keys an indexer selected (a top-k over a score "
                                          f"row) reach `{describe(u)}`, not only a tree "
                                          "attention's mask; on the tree that is correct only "
                                          "inside attention, which masks the keys of other "
                                          "branches")


# ---------------------------------------------------------------------------- loss

def check_loss_found(ctx: GraphContext) -> None:
    """A training step (a graph with loss weights) must have had its loss rewritten."""
    if ctx.is_step and not ctx.root.loss_sites:
        raise TreeCompileError(
            "the training step computes no cross-entropy treefx can find (F.cross_entropy on "
            "shifted logits and labels, or a Hugging Face model called with labels=); without "
            "it the step's loss cannot be made per-sequence"
        )
