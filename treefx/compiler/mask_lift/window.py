"""A sliding window read off the lifted mask's structure: the largest query-key distance one of
its conjuncts admits."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph import is_call
from .lifted import SHAPE_FUNCS, LiftedMask, axis_role, is_pure_view_key

__all__ = ["window_of"]


_COMPARISONS = {operator.gt: ">", operator.ge: ">=", operator.lt: "<", operator.le: "<=",
                torch.gt: ">", torch.ge: ">=", torch.lt: "<", torch.le: "<=",
                "gt": ">", "ge": ">=", "lt": "<", "le": "<=", "__gt__": ">", "__ge__": ">=",
                "__lt__": "<", "__le__": "<="}
_ANDS = (operator.and_, torch.logical_and, torch.bitwise_and)
_AND_METHODS = ("logical_and", "bitwise_and", "__and__")
_SAME_VALUE_METHODS = ("expand", "expand_as", "view", "reshape", "contiguous", "unsqueeze",
                       "broadcast_to")


def _target_key(node: fx.Node):
    return node.target if node.op in ("call_function", "call_method") else None


def _dtypes(node: fx.Node) -> list:
    """The dtypes a ``to`` names (none: a device move)."""
    return [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, torch.dtype)]


def _same_value(node: fx.Node, dtype=None) -> bool:
    """A shape op, or a ``to`` that moves a tensor without casting it (to ``dtype`` at most)."""
    if is_call(node, methods=_SAME_VALUE_METHODS) or is_call(node, *SHAPE_FUNCS):
        return True
    return is_call(node, methods=("to",)) and all(d is dtype for d in _dtypes(node))


def _same_bool(node: fx.Node) -> bool:
    """A shape op, or a ``to`` that moves a tensor without changing its dtype from bool."""
    return _same_value(node, torch.bool)


def _conjuncts(mask: fx.Node) -> list[fx.Node]:
    """The terms of the AND that ``mask`` is (itself when it is no AND)."""
    out, stack = [], [mask]
    while stack:
        n = stack.pop()
        if isinstance(n, fx.Node) and (is_call(n, *_ANDS, methods=_AND_METHODS)):
            stack.extend(n.args[:2])
        elif isinstance(n, fx.Node) and _same_bool(n) and isinstance(n.args[0], fx.Node):
            stack.append(n.args[0])
        else:
            out.append(n)
    return out


def _affine(node, lifted: LiftedMask):
    """``node`` as ``(a_q, a_kv, c)``: ``a_q * q_pos + a_kv * kv_pos + c`` with integers, or
    None."""
    if isinstance(node, bool) or node is None:
        return None
    if isinstance(node, int):
        return (0, 0, node)
    if not isinstance(node, fx.Node):
        return None
    if node is lifted.positions:
        return None  # a position without a broadcast: its role is not known
    if is_call(node, operator.getitem) and node.args[0] in lifted.vectors \
            and node not in lifted.vectors and is_pure_view_key(node.args[1]):
        coef = _vector_affine(node.args[0], lifted)
        role = axis_role(node)
        if coef is None or role not in ("q", "kv"):
            return None
        a, c = coef
        return (a, 0, c) if role == "q" else (0, a, c)
    if _same_value(node):
        return _affine(node.args[0], lifted)
    if is_call(node, operator.add, torch.add, operator.sub, torch.sub, methods=("add", "sub")):
        x, y = _affine(node.args[0], lifted), _affine(node.args[1], lifted)
        if x is None or y is None:
            return None
        sign = -1 if node.target in (operator.sub, torch.sub, "sub") else 1
        return tuple(a + sign * b for a, b in zip(x, y))
    if is_call(node, operator.neg, torch.neg, methods=("neg",)):
        x = _affine(node.args[0], lifted)
        return None if x is None else tuple(-a for a in x)
    if is_call(node, operator.mul, torch.mul, methods=("mul",)):
        x, y = _affine(node.args[0], lifted), _affine(node.args[1], lifted)
        if x is None or y is None:
            return None
        if x[:2] == (0, 0):
            return tuple(x[2] * b for b in y)
        if y[:2] == (0, 0):
            return tuple(a * y[2] for a in x)
    return None


def _vector_affine(node, lifted: LiftedMask):
    """A 1-D index vector as ``(a, c)``: ``a * position + c``, or None."""
    if node is lifted.positions:
        return (1, 0)
    if not isinstance(node, fx.Node):
        return None
    if is_call(node, operator.add, torch.add, operator.sub, torch.sub, methods=("add", "sub")):
        x, y = node.args[:2]
        sign = -1 if node.target in (operator.sub, torch.sub, "sub") else 1
        if isinstance(y, int) and not isinstance(y, bool):
            inner = _vector_affine(x, lifted)
            return None if inner is None else (inner[0], inner[1] + sign * y)
        if isinstance(x, int) and not isinstance(x, bool) and sign == 1:
            return _vector_affine(y, lifted)
    if _same_value(node):
        return _vector_affine(node.args[0], lifted)
    return None


def window_of(lifted: LiftedMask | None) -> int | None:
    """The largest ``q_pos - kv_pos`` the lifted mask admits, when one of its conjuncts bounds
    it (a sliding window: ``kv > q - W`` and its rearrangements), else None.

    Read from the mask's structure, not probed: the mask is an AND of its conjuncts, so a
    conjunct that is False at every distance beyond D makes the mask False there, whatever the
    other conjuncts and buffers are. The tree's block mask may then drop every key block whose
    tokens are all farther than D from the query block's (:func:`treefx.mask.tree_block_tensors`).
    """
    if lifted is None or lifted.negate or not lifted.boolean:
        return None
    best = None
    for term in _conjuncts(lifted.mask):
        op = _COMPARISONS.get(_target_key(term)) if isinstance(term, fx.Node) else None
        if op is None or len(term.args) < 2:
            continue
        left, right = _affine(term.args[0], lifted), _affine(term.args[1], lifted)
        if left is None or right is None:
            continue
        a_q, a_kv, c = (x - y for x, y in zip(left, right))
        if op in ("<", "<="):  # e < 0  <=>  -e > 0
            a_q, a_kv, c, op = -a_q, -a_kv, -c, ">" if op == "<" else ">="
        # a_kv * (kv - q) + c (op) 0 with a_kv > 0:  q - kv (<, <=) c / a_kv
        if a_kv <= 0 or a_q != -a_kv:
            continue
        d = -((-c) // a_kv) - 1 if op == ">" else c // a_kv  # ceil(c/a) - 1, floor(c/a)
        best = d if best is None else min(best, d)
    return best
