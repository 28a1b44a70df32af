"""Dead-code elimination that keeps every node with an effect.

``torch.fx.Graph.eliminate_dead_code`` treats a method call as pure, so it removes in-place
calls whose result is unused: the ``copy_`` that fills a key built with ``new_empty``
(multi-head latent attention), the ``scatter_`` that masks a group-limited MoE router, the
functorch nesting calls around an ``associative_scan``. Removing those changes what the model
computes. The passes only need to drop what their rewrites orphaned, so a node goes only when
nothing reads it and it provably has no effect: not in-place, not random (removing a draw
would shift every later one), not a higher-order op, not a call into torch's global state.
In-place writes go only with the buffer they fill, when the graph made that buffer itself and
nothing but such writes ever touches it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

__all__ = ["has_effect", "draws_random", "eliminate_dead_code"]

_INPLACE_OPERATORS = {
    operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
    operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul,
    operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
}
# Random ops without "rand" in their name: dead draws still advance the generator.
_RANDOM = {"dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d",
           "dropout3d", "bernoulli", "multinomial", "normal", "poisson", "rrelu"}
_DROPOUTS = {torch.nn.functional.dropout, torch.dropout, torch.nn.functional.alpha_dropout,
             torch.nn.functional.feature_alpha_dropout, torch.nn.functional.dropout1d,
             torch.nn.functional.dropout2d, torch.nn.functional.dropout3d}
# Calls into global state that Dynamo records as graph nodes.
_STATE_PREFIXES = ("_set_", "_enter_", "_exit_", "_increment_", "_decrement_", "_push_",
                   "_pop_", "set_", "manual_seed", "seed")


def _dropout_draws(node: fx.Node) -> bool:
    """A dropout call draws random numbers (or works in place) unless its p is 0 or it is
    called with training=False; p and training are constants in a captured graph."""
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    training = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", True)
    inplace = node.args[3] if len(node.args) > 3 else node.kwargs.get("inplace", False)
    if inplace is not False:
        return True
    return not ((isinstance(p, (int, float)) and p == 0) or training is False)


def _is_inplace_name(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__")


def draws_random(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers (dropout in training mode, ``rand*``, ...)."""
    if node.op not in ("call_function", "call_method"):
        return False
    target = node.target
    if target in _DROPOUTS:
        return _dropout_draws(node)
    name = target if node.op == "call_method" else (getattr(target, "__name__", "") or "")
    if name.rstrip("_") in _RANDOM or "rand" in name:
        return True
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def has_effect(node: fx.Node) -> bool:
    """Whether removing ``node`` could change what the graph computes even when nothing
    reads its value."""
    if node.op in ("placeholder", "output", "call_module"):
        return True
    if node.op == "get_attr":
        return False
    target = node.target
    if "out" in node.kwargs or draws_random(node):
        return True
    if node.op == "call_method":
        return _is_inplace_name(target)
    if target in _DROPOUTS:
        return False  # p == 0 or not training: an identity (draws_random said so)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return True
    if target in _INPLACE_OPERATORS:
        return True
    if node.is_impure():  # torch's own list, mutable aten schemas, random aten ops
        return True
    name = getattr(target, "__name__", "") or ""
    module = getattr(target, "__module__", "") or ""
    # operator.and_ / or_ / not_ are not in place (its in-place ones are listed above)
    if _is_inplace_name(name) and module not in ("_operator", "operator"):
        return True
    if module.startswith(("torch._C._functorch", "torch._functorch", "torch.random")):
        return True
    if module.startswith("torch._C") and name.startswith(_STATE_PREFIXES):
        return True
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        schema = getattr(target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return True
    return False


# Allocations of a fresh tensor: nothing outside the graph can alias it.
_FRESH_FUNCS = {torch.zeros, torch.ones, torch.empty, torch.full, torch.zeros_like,
                torch.ones_like, torch.empty_like, torch.full_like}
_FRESH_METHODS = {"new_zeros", "new_ones", "new_empty", "new_full", "clone"}
# Views that alias their input (writes through them land in it).
_VIEW_METHODS = {"view", "reshape", "select", "narrow", "unsqueeze", "squeeze", "transpose",
                 "permute", "expand", "flatten", "unflatten", "__getitem__"}


def _write_only(node: fx.Node, seen: set) -> bool:
    """Whether every use of ``node`` (a fresh buffer or a view of one) only writes into it:
    in-place calls on it whose results nobody reads, and views used the same way."""
    for user in node.users:
        if user in seen:
            continue
        seen.add(user)
        first = user.args[0] if user.args else None
        if first is not node:
            return False  # read as an operand (the source of a copy, say)
        if user.op == "call_method" and _is_inplace_name(user.target) or \
                user.op == "call_function" and user.target is operator.setitem:
            if any(isinstance(a, fx.Node) and a is node for a in user.args[1:]) or \
                    "out" in user.kwargs or draws_random(user):
                return False
            # `buf.copy_(x)` returns buf itself: its readers read the buffer
            if not _write_only(user, seen):
                return False
        elif user.op == "call_method" and user.target in _VIEW_METHODS or \
                user.op == "call_function" and user.target is operator.getitem:
            if not _write_only(user, seen):
                return False
        else:
            return False
    return True


def _dead_buffers(graph: fx.Graph) -> set:
    """Writes into buffers nobody reads: a fresh tensor made in the graph (``zeros_like``,
    ``new_empty``, ``clone``, ...) whose every use, through views, is an in-place write (a
    cache a model fills with a recurrence's final state, which a tree's row does not have).
    Removing them with the buffer changes nothing the graph computes."""
    dead: set = set()
    for node in graph.nodes:
        fresh = node.op == "call_function" and node.target in _FRESH_FUNCS or \
            node.op == "call_method" and node.target in _FRESH_METHODS
        if not fresh or not node.users or "out" in node.kwargs:
            continue
        seen: set = set()
        if _write_only(node, seen):
            dead |= seen | {node}
    return dead


def eliminate_dead_code(graph: fx.Graph) -> int:
    """Remove unread nodes without effects (see :func:`has_effect`) and writes into fresh
    buffers nobody reads (:func:`_dead_buffers`); returns how many."""
    removed = 0
    while True:
        dead = _dead_buffers(graph)
        before = removed
        for node in reversed(list(graph.nodes)):
            if not node.users and (node in dead or not has_effect(node)):
                graph.erase_node(node)
                removed += 1
        if not dead or removed == before:
            return removed
