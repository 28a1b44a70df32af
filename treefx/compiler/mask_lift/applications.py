"""A mask's constants (a 0, a -inf or the dtype's min) and the ways a model applies a mask to
its attention scores."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph import GraphContext, is_call

__all__ = ["is_zero", "mask_applications", "very_negative"]


_CAST_METHODS = ("to", "type", "type_as", "float", "half", "bfloat16")


def _constant(ctx: GraphContext, x):
    """The number a node holds everywhere, through casts: ``c``, ``torch.zeros(...)``,
    ``torch.full(..., c)``, ``torch.tensor(c)`` (transformers 5.17's eager mask writes its 0
    this way); None when it is not a constant."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return x
    if is_call(x, torch.zeros_like, torch.zeros, methods=("new_zeros",)):
        return 0
    if is_call(x, torch.full, torch.full_like, methods=("new_full",)) and len(x.args) > 1:
        return _constant(ctx, x.args[1])
    if is_call(x, torch.full) and "fill_value" in x.kwargs:
        return _constant(ctx, x.kwargs["fill_value"])
    if is_call(x, torch.tensor, torch.scalar_tensor) and x.args:
        return _constant(ctx, x.args[0])
    if is_call(x, methods=_CAST_METHODS):
        return _constant(ctx, ctx.resolve(x.args[0]))
    return None


def is_zero(ctx: GraphContext, x) -> bool:
    """A constant zero (see :func:`_constant`)."""
    return _constant(ctx, x) == 0


def very_negative(ctx: GraphContext, x) -> bool:
    """A constant at or below -1e4 (-inf, the dtype's min): adding it masks a score out."""
    c = _constant(ctx, x)
    return c is not None and c <= -1e4


def mask_applications(ctx: GraphContext, node) -> list[tuple[fx.Node, str, fx.Node]]:
    """The ways ``node`` may apply a mask to a score tensor, as ``(scores, how, mask)``:
    ``masked_fill(s, blocked, -big)`` ("blocked"), ``where(allowed, s, -big)`` ("allowed"),
    ``s + m`` ("additive", either operand may be the scores); [] for anything else. The caller
    knows which operand is its scores."""
    if not isinstance(node, fx.Node):
        return []

    def negative(v):
        return very_negative(ctx, ctx.resolve(v) if isinstance(v, fx.Node) else v)

    if is_call(node, torch.masked_fill, methods=("masked_fill",)) and len(node.args) >= 2:
        value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value")
        return [(node.args[0], "blocked", node.args[1])] if negative(value) else []
    if is_call(node, torch.where) and len(node.args) == 3:
        return [(node.args[1], "allowed", node.args[0])] if negative(node.args[2]) else []
    if is_call(node, torch.add, operator.add, methods=("add",)) and len(node.args) >= 2:
        a, b = node.args[:2]
        return [(a, "additive", b), (b, "additive", a)]
    return []
