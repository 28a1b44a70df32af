"""The registries the model families (:mod:`treefx.families`) fill with what treefx knows of
them: the compiler consults them and never imports a family.

- rewrites: a pass's graph rewrites of one family's form (``fn(ctx) -> int``, how many),
  run in the pass named (``"heads"``: attention over merged batch·head rows);
- node rewrites: rewrites of one node the positions pass asks about
  (``fn(ctx, node) -> bool``, whether it rewrote it: a table cut to the token count);
- finders: recognisers of sites of a kind (``fn(ctx)`` yields sites, lowered in turn;
  ``"selection"``: a top-k over the keys of a score row);
- score columns: recognisers of an extra column concatenated to an attention's scores
  (``fn(parts, dim) -> the column node or None``: an attention sink).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["finders", "node_rewrites", "register_finder", "register_node_rewrite",
           "register_rewrite", "register_score_column", "rewrites", "score_columns"]

_REWRITES: dict[str, list[Callable]] = {}
_NODE_REWRITES: dict[str, list[Callable]] = {}
_FINDERS: dict[str, list[Callable]] = {}
_SCORE_COLUMNS: list[Callable] = []


def _add(table: dict, key: str, fn: Callable) -> Callable:
    fns = table.setdefault(key, [])
    if fn not in fns:
        fns.append(fn)
    return fn


def register_rewrite(pass_name: str, fn: Callable) -> Callable:
    """Run ``fn(ctx) -> int`` (rewrites made) in the pass ``pass_name``, on every graph."""
    return _add(_REWRITES, pass_name, fn)


def rewrites(pass_name: str) -> list[Callable]:
    """The rewrites registered for the pass ``pass_name``, in registration order."""
    return list(_REWRITES.get(pass_name, ()))


def register_node_rewrite(pass_name: str, fn: Callable) -> Callable:
    """Ask ``fn(ctx, node) -> bool`` (whether it rewrote ``node``) about the nodes the pass
    ``pass_name`` hands to families."""
    return _add(_NODE_REWRITES, pass_name, fn)


def node_rewrites(pass_name: str) -> list[Callable]:
    """The node rewrites registered for the pass ``pass_name``, in registration order."""
    return list(_NODE_REWRITES.get(pass_name, ()))


def register_finder(kind: str, fn: Callable) -> Callable:
    """``fn(ctx)`` yields the sites of ``kind`` in a graph (each lowered before the next)."""
    return _add(_FINDERS, kind, fn)


def finders(kind: str) -> list[Callable]:
    """The finders registered for ``kind``, in registration order."""
    return list(_FINDERS.get(kind, ()))


def register_score_column(fn: Callable) -> Callable:
    """``fn(cat) -> (column, scores) | None``: an extra column ``cat`` concatenates to an
    attention's scores (an attention sink), which the softmax sees and the model drops after
    it."""
    if fn not in _SCORE_COLUMNS:
        _SCORE_COLUMNS.append(fn)
    return fn


def score_columns() -> list[Callable]:
    """The registered score-column recognisers, in registration order."""
    return list(_SCORE_COLUMNS)
