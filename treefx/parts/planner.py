"""The planner: :func:`plan` cuts a packed row into parts under a token budget,
:func:`plan_even` into at most a number of parts, the largest as small as the trees allow
(see :mod:`treefx.parts` for how)."""

from __future__ import annotations

import numbers

import numpy as np

from ..layout import TreeBatch
from .merge import fewer_parts, merge_small, no_single_tokens
from .part_plan import Part, PartPlan
from .shape import TreeShape
from .units import plan_units

__all__ = ["BEYOND", "check_budget", "plan", "plan_even"]


def check_budget(max_tokens) -> int:
    if not isinstance(max_tokens, numbers.Integral) or isinstance(max_tokens, bool) \
            or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    return int(max_tokens)


BEYOND = ("host", "recompute", "device")


def _beyond(recompute, beyond) -> str:
    """The mode for the open parts the budget cannot hold on the device: ``beyond`` (default
    ``"recompute"``), or the older spelling ``recompute=True`` ("recompute") / ``False``
    ("device")."""
    if recompute is not None:
        old = "recompute" if recompute else "device"
        if beyond is not None and beyond != old:
            raise ValueError(f"recompute={recompute!r} and beyond={beyond!r} disagree")
        return old
    beyond = "recompute" if beyond is None else beyond
    if beyond not in BEYOND:
        raise ValueError(f"beyond must be one of {BEYOND}, got {beyond!r}")
    return beyond


def _min_part(min_part, max_tokens: int, mode: str) -> int:
    if min_part is None:
        # the merges come with host parts: beside recompute parts they would hold recompute
        # parts' keys and values past the current part's context
        return max_tokens // 8 if mode == "host" else 0
    if not isinstance(min_part, numbers.Integral) or isinstance(min_part, bool) or min_part < 0:
        raise ValueError(f"min_part must be a non-negative integer, got {min_part!r}")
    return int(min_part)


def plan(batch: TreeBatch, max_tokens: int, *, block_size: int = 128,
         recompute: bool | None = None, beyond: str | None = None,
         min_part: int | None = None) -> PartPlan:
    """Plan the parts of a packed batch under a token budget.

    Cut ``batch``'s row into parts of at most ``max_tokens`` tokens (see the module's
    docstring for how, and for the memory bound this gives). ``block_size``: the context row
    is padded to a multiple of it (FlexAttention's blocks).

    ``beyond``: what becomes of the open tokens the budget cannot hold on the device beside
    the current part. ``"recompute"`` (the default): *recompute* parts, whose forwards run
    twice (``plan.recompute_tokens``); ``"host"``: *host* parts, whose forwards run once,
    with what they save for their backwards held in host memory until then
    (``plan.host_tokens``; tested on the CPU, not yet measured on a GPU, where its copies run
    on a stream of their own: it becomes the default once measured); ``"device"``: held on the device all the same, so
    ``peak_held_tokens()`` may exceed ``max_tokens``. ``recompute=True`` / ``False`` is the
    older spelling of ``"recompute"`` / ``"device"``.

    ``min_part``: a part pays a fixed cost (the weights' gradients summed into ``.grad``,
    the launches of every layer), so a part smaller than this (default with host parts
    ``max_tokens // 8``, else 0: the merges beside recompute parts are not done yet) is merged into a neighbour wherever the merged part fits ``max_tokens`` and the tokens
    held on the device at once stay within the bound; host parts next to each other merge
    too (wherever they fit), and a small part merges into a host part beside it (its
    activations then held on the host as well). ``min_part=0``: the plan without those
    merges."""
    max_tokens = check_budget(max_tokens)
    if not isinstance(batch, TreeBatch):
        raise TypeError(f"expected a treefx.TreeBatch, got {type(batch).__name__}")
    mode = _beyond(recompute, beyond)
    small = _min_part(min_part, max_tokens, mode)
    shape = TreeShape(batch)
    return _build(shape, _ranges(shape, max_tokens, mode, small), max_tokens, block_size, mode)


def _ranges(shape: TreeShape, max_tokens: int, beyond: str, min_part: int = 0):
    """The parts' (start, end, open, beyond the budget) in DFS order, without building them:
    all :func:`plan_even`'s bisection needs (their count)."""
    units = plan_units(shape, max_tokens)
    if beyond == "device":
        units = [(s, e, o, False, room) for s, e, o, _, room in units]
    # Padding tokens (each its own root) close the row as closed units of one token each.
    units += [(t, t + 1, False, False, max_tokens) for t in range(shape.n_real, shape.num_tokens)]

    ranges: list[tuple[int, int, bool, bool, int]] = []
    for s, e, is_open, rec, room in units:
        if ranges and not is_open and not ranges[-1][2] and \
                e - ranges[-1][0] <= min(ranges[-1][4], room):
            ranges[-1] = (ranges[-1][0], e, False, False, min(ranges[-1][4], room))
        else:
            ranges.append((s, e, is_open, rec, room))
    ranges = fewer_parts(no_single_tokens(ranges), shape.subtree_end, max_tokens)
    if min_part > 0 or beyond == "host":
        ranges = merge_small(ranges, shape.subtree_end, max_tokens, min_part,
                              host=beyond == "host")
    return ranges


def _build(shape: TreeShape, ranges, max_tokens: int, block_size: int,
           beyond: str = "recompute") -> PartPlan:
    """The plan of the given ranges: each part's context, entries, exits and labels; the
    ranges beyond the budget become host or recompute parts (``beyond``)."""
    batch, parent, se, n_real = shape.batch, shape.parent, shape.subtree_end, shape.n_real
    n = shape.num_tokens
    part_of = np.empty(n, dtype=np.int64)
    for j, (s, e, _, _) in enumerate(ranges):
        part_of[s:e] = j
    parts = []
    for j, (s, e, is_open, rec) in enumerate(ranges):
        ctx = shape.context(s) if s < n_real else np.zeros(0, np.int64)
        pad = max(block_size, -(-len(ctx) // block_size) * block_size)
        par = parent[s:e]
        ext = (par >= 0) & (par < s)
        entries, inv = np.unique(par[ext], return_inverse=True)
        entry_of = np.full(e - s, -1, dtype=np.int64)
        entry_of[ext] = inv
        # predicted tokens: every token whose predecessor lies in [s, e)
        pred = shape.predicted(s, e)
        rows = parent[pred] - s
        succ_later = pred[pred >= e]
        exits = np.unique(parent[succ_later])
        parts.append(Part(
            index=j, start=s, end=e, context=ctx, context_pad=pad, entries=entries,
            entry_of_token=entry_of, exits=exits, label_rows=rows, label_tokens=pred,
            release=int(se[s:e].max()), open=is_open,
            recompute=bool(rec) and beyond == "recompute",
            host=bool(rec) and beyond == "host"))
    return PartPlan(batch=batch, parts=parts, max_tokens=max_tokens, part_of_token=part_of,
                    beyond=beyond)


def plan_even(batch: TreeBatch, max_tokens: int, num_parts: int, *, block_size: int = 128,
              recompute: bool | None = None, beyond: str | None = None,
              min_part: int | None = None) -> PartPlan:
    """Plan at most ``num_parts`` parts, the largest as small as the trees allow.

    :func:`plan` at the smallest budget between ``tokens / num_parts`` and ``max_tokens`` that
    keeps the count, found by bisection (the count falls as the budget grows); the plan at ``max_tokens`` where no smaller budget keeps the count, or where
    that one would hold more tokens at once.
    Under FSDP2 :func:`treefx.backward` runs every rank's parts in common rounds, each as long
    as its largest part: ranks that cut their trees into as many even parts wait less for
    each other (a rank's first plan may have fewer parts, of very different sizes).
    ``recompute``, ``beyond``, ``min_part``: as :func:`plan` takes them (``min_part`` at
    ``max_tokens``'s default for every budget tried)."""
    max_tokens = check_budget(max_tokens)
    if not isinstance(num_parts, numbers.Integral) or isinstance(num_parts, bool) \
            or num_parts < 1:
        raise ValueError(f"num_parts must be a positive integer, got {num_parts!r}")
    if not isinstance(batch, TreeBatch):
        raise TypeError(f"expected a treefx.TreeBatch, got {type(batch).__name__}")
    mode = _beyond(recompute, beyond)
    small = _min_part(min_part, max_tokens, mode)
    shape = TreeShape(batch)  # once for every budget tried
    first = _build(shape, _ranges(shape, max_tokens, mode, small), max_tokens, block_size,
                   mode)
    if first.num_parts > num_parts:
        return first
    # About log2(max_tokens) budgets, each only cut into ranges (the count is all the
    # bisection reads); the plan is built once, at the budget found. A 128k-token tree of
    # 115 calls: about 15 budgets, a few ms each (they were 0.03-0.12 s each, whole plans).
    best = None
    lo, hi = max(1, -(-batch.num_tokens // int(num_parts))), max_tokens - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        candidate = _ranges(shape, mid, mode, small)
        if len(candidate) <= num_parts:
            best, hi = (candidate, mid), mid - 1
        else:
            lo = mid + 1
    if best is None:
        return first
    best = _build(shape, best[0], best[1], block_size, mode)
    if best.recompute_tokens + best.host_tokens > first.recompute_tokens + first.host_tokens or \
            best.peak_held_tokens() > max(first.peak_held_tokens(), max_tokens):
        return first
    return best
