"""Filled tensors in a mask's subgraph: a uniform constructor's value (``zeros``, ``full``, ...)
when nothing writes into it, and the ops that keep a value the same at every index."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph import GraphContext, example, is_call
from .lifted import SHAPE_FUNCS, SHAPE_METHODS

__all__ = ["keeps_uniform", "reduces_uniform", "uniform_fill"]


def uniform_fill(node) -> int | float | bool | None:
    """The value a constructor fills a tensor with (``zeros``, ``ones``, ``full``, their
    ``_like`` forms and the ``new_*`` methods; of more or less than one dim) when nothing writes
    into it afterwards, None for anything else. Its inputs give it a shape only, so the lifted
    mask reads its one value at every index instead of evaluating them or reading it per row
    (Git's mask builds token types as ``zeros_like(embeddings)[..., 0]``; Gemma 4's groups are
    ``full((1, N), -1)``, which a part's positions would index past its own N)."""
    val = example(node)
    if not isinstance(val, torch.Tensor) or val.dim() == 1:
        return None  # (a 1-d one may be a vector of an index: read as such)
    if is_call(node, torch.zeros, torch.zeros_like, methods=("new_zeros",)):
        v = 0
    elif is_call(node, torch.ones, torch.ones_like, methods=("new_ones",)):
        v = 1
    elif is_call(node, torch.full, torch.full_like, methods=("new_full",)):
        v = node.args[1] if len(node.args) > 1 else node.kwargs.get("fill_value")
    else:
        return None
    if not isinstance(v, (int, float, bool)) or _written(node):
        return None
    return v


_VIEWS = ("view", "reshape", "expand", "expand_as", "unsqueeze", "squeeze", "transpose",
          "permute", "t", "narrow", "select", "as_strided", "flatten", "unflatten", "movedim",
          "contiguous", "view_as", "reshape_as", "swapaxes", "diagonal", "split", "chunk",
          "unbind")
_INPLACE_OPERATORS = (operator.setitem, operator.iadd, operator.isub, operator.imul,
                      operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow,
                      operator.iand, operator.ior, operator.ixor, operator.ilshift,
                      operator.irshift)


def _written(node: fx.Node) -> bool:
    """Whether anything may write into ``node``'s tensor: an in-place op or ``out=`` on it or
    on a view of it (views followed through ``getitem`` and the usual view ops)."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            name = u.target if isinstance(u.target, str) else getattr(u.target, "__name__", "")
            schema = getattr(u.target, "_schema", None)  # an aten op: its own word on it
            if u.target in _INPLACE_OPERATORS or "out" in u.kwargs or u.kwargs.get("inplace") \
                    or (name.endswith("_") and not name.endswith("__")) \
                    or (schema is not None and schema.is_mutable):
                return True
            if is_call(u, operator.getitem, *SHAPE_FUNCS, torch.transpose, torch.permute,
                       torch.narrow, torch.select, torch.flatten, torch.movedim,
                       torch.split, torch.chunk, torch.unbind, methods=_VIEWS) or (
                    u.op not in ("call_function", "call_method")):
                stack.append(u)  # a view (or a body's use): its writes are the tensor's
    return False


_ELEMENTWISE = {operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
                operator.and_, operator.or_, operator.xor, operator.invert, operator.not_,
                operator.add, operator.sub, operator.mul, operator.neg, torch.where, torch.eq,
                torch.ne, torch.lt, torch.le, torch.gt, torch.ge, torch.logical_and,
                torch.logical_or, torch.logical_not, torch.add, torch.sub, torch.mul,
                operator.getitem, *SHAPE_FUNCS}
_ELEMENTWISE_METHODS = ("eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or",
                        "logical_not", "add", "sub", "mul", "to", "bool", "long", "int", "float",
                        "type_as", "__and__", "__or__", "__invert__", *SHAPE_METHODS)


_KEEPING_REDUCTIONS = (torch.amax, torch.amin, torch.mean, torch.any, torch.all)
_KEEPING_REDUCTION_METHODS = ("amax", "amin", "mean", "any", "all")


def reduces_uniform(node, ctx: GraphContext) -> bool:
    """Whether ``node`` reduces a filled tensor to that same value: a max, min, mean, any or
    all of it, or a sum of zeros (Llama 4 counts left padding as ``zeros_like(..).sum(-1)``)."""
    if is_call(node, *_KEEPING_REDUCTIONS, methods=_KEEPING_REDUCTION_METHODS):
        return True
    if is_call(node, torch.sum, methods=("sum",)) and node.args:
        return uniform_fill(ctx.resolve(node.args[0])) == 0
    return False


def keeps_uniform(node) -> bool:
    """Whether ``node`` maps a value that is the same at every index to one that is too:
    elementwise ops, indexing and shape ops (a reduction over a filled tensor is not its one
    value)."""
    return is_call(node, *_ELEMENTWISE, methods=_ELEMENTWISE_METHODS)
