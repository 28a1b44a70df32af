"""A frozen copy of ``treefx/parts.py``'s planner as it was before it was made faster
(commit c811ca2): the functions that changed (:func:`plan`, :func:`plan_even`, ``_units``,
``_held_tokens``, ``_fewer_parts``, ``_path_before``), word for word; what did not change
(``Part``, ``PartPlan``, ``_kept``, ``_chunks``, ...) is imported from the package.
``tests/test_parts_planner.py`` checks that the package's planner gives exactly the plans this
one gives. Do not edit."""

from __future__ import annotations

import numbers

import numpy as np

from treefx.layout import TreeBatch
from treefx.parts import Part, PartPlan  # noqa: F401
from treefx.parts.merge import no_single_tokens as _no_single_tokens  # noqa: F401
from treefx.parts.planner import check_budget as _check_budget
from treefx.parts.units import chunks as _chunks, tokens_kept as _kept


def _units(node_offset, node_length, node_parent, subtree_end_of_node, max_tokens):
    """(start, end, open, recompute, room) ranges in DFS order: closed subtrees that fit the
    room left, open nodes' tokens in chunks. ``room`` = ``max_tokens`` minus the open tokens
    *kept* above the unit (held with their activations), never below a quarter of
    ``max_tokens`` unless every subtree below fits in less. An open node keeps as many of its
    tokens as leave its children the room they need (:func:`_kept`); the rest, first in the
    node, are recompute chunks of at most
    the room. A leaf node longer than the room recomputes all but its last ``room`` tokens,
    which run last and are held by nothing after them."""
    floor = max(1, max_tokens // 4)
    n = len(node_offset)
    length = node_length.astype(np.int64)
    children: list[list[int]] = [[] for _ in range(n)]
    roots = []
    for i, p in enumerate(node_parent.tolist()):
        (children[p] if p >= 0 else roots).append(i)
    # the two largest "breakpoints" of each subtree (see _kept): the longest path's tokens,
    # then the next one not sharing its top; nodes in DFS order, so children after parents
    top1 = np.zeros(n, dtype=np.int64)
    top2 = np.zeros(n, dtype=np.int64)
    second = np.zeros(n, dtype=np.int64)  # the children's second largest, for _kept
    for v in range(n - 1, -1, -1):
        best = sorted((x for c in children[v] for x in (top1[c], top2[c])), reverse=True)[:2]
        best += [0] * (2 - len(best))
        top1[v], top2[v], second[v] = length[v] + best[0], best[1], best[1]
    units = []
    stack = [(v, 0) for v in roots[::-1]]
    while stack:
        v, kept = stack.pop()
        off = int(node_offset[v])
        room = max_tokens - kept
        size = int(subtree_end_of_node[v]) - off
        if size <= room:
            units.append((off, off + size, False, False, room))
            continue
        own = int(length[v])
        if children[v]:
            # the room the children need: a quarter of the budget (parts large enough), or
            # less when every child's subtree fits in less (then all of them are closed)
            largest = max(int(subtree_end_of_node[c] - node_offset[c]) for c in children[v])
            keep = _kept(own, room, max(int(second[v]), min(floor, largest)), floor)
            rest = own - keep
            if rest == 1 and keep > 2:
                keep, rest = keep - 1, 2  # no chunk of one token (see _no_single_tokens)
        else:  # a leaf: its last `room` tokens run last and are held by nothing after them
            rest, keep = own - room, room
            if rest == 1 and keep > 2:
                keep, rest = keep - 1, 2
        s = off
        for size in _chunks(rest, room):
            units.append((s, s + size, True, True, room))
            s += size
        if keep:
            units.append((s, s + keep, True, False, room))
        if children[v]:
            stack.extend((c, kept + keep) for c in children[v][::-1])
    return units


def plan(batch: TreeBatch, max_tokens: int, *, block_size: int = 128,
         recompute: bool = True) -> PartPlan:
    """Plan the parts of a packed batch under a token budget.

    Cut ``batch``'s row into parts of at most ``max_tokens`` tokens (see the module's
    docstring for how, and for the memory bound this gives). ``block_size``: the context row
    is padded to a multiple of it (FlexAttention's blocks). ``recompute=False``: no recompute
    parts; the open tokens the budget cannot hold are held with their activations all the
    same, so ``peak_held_tokens()`` may exceed ``max_tokens`` (:func:`treefx.backward` plans
    so under FSDP2, whose ranks' backward rounds a second forward would put out of step)."""
    max_tokens = _check_budget(max_tokens)
    if not isinstance(batch, TreeBatch):
        raise TypeError(f"expected a treefx.TreeBatch, got {type(batch).__name__}")
    parent = batch.parent_token.cpu().numpy()
    se = batch.subtree_end.cpu().numpy()
    n_real = batch.num_real_tokens
    off = batch.node_offset.cpu().numpy()
    ln = batch.node_length.cpu().numpy()
    npar = batch.node_parent.cpu().numpy()
    units = _units(off, ln, npar, se[off], max_tokens)
    if not recompute:
        units = [(s, e, o, False, room) for s, e, o, _, room in units]
    # Padding tokens (each its own root) close the row as closed units of one token each.
    units += [(t, t + 1, False, False, max_tokens) for t in range(n_real, batch.num_tokens)]

    ranges: list[tuple[int, int, bool, bool, int]] = []
    for s, e, is_open, rec, room in units:
        if ranges and not is_open and not ranges[-1][2] and \
                e - ranges[-1][0] <= min(ranges[-1][4], room):
            ranges[-1] = (ranges[-1][0], e, False, False, min(ranges[-1][4], room))
        else:
            ranges.append((s, e, is_open, rec, room))
    ranges = _fewer_parts(_no_single_tokens(ranges), se, max_tokens)
    n = batch.num_tokens
    part_of = np.empty(n, dtype=np.int64)
    for j, (s, e, _, _) in enumerate(ranges):
        part_of[s:e] = j
    # node of each token, for the context paths
    node_of = np.repeat(np.arange(len(off)), ln)
    has_succ = np.zeros(n, dtype=bool)
    later_child = parent >= 0
    parts = []
    for j, (s, e, is_open, rec) in enumerate(ranges):
        ctx = _path_before(s, node_of, off, ln, npar) if s < n_real else np.zeros(0, np.int64)
        pad = max(block_size, -(-len(ctx) // block_size) * block_size)
        par = parent[s:e]
        ext = (par >= 0) & (par < s)
        entries, inv = np.unique(par[ext], return_inverse=True)
        entry_of = np.full(e - s, -1, dtype=np.int64)
        entry_of[ext] = inv
        # predicted tokens: every token whose predecessor lies in [s, e)
        pred = np.flatnonzero(later_child & (parent >= s) & (parent < e))
        rows = parent[pred] - s
        succ_later = pred[pred >= e]
        exits = np.unique(parent[succ_later])
        has_succ[exits] = True
        parts.append(Part(
            index=j, start=s, end=e, context=ctx, context_pad=pad, entries=entries,
            entry_of_token=entry_of, exits=exits, label_rows=rows, label_tokens=pred,
            release=int(se[s:e].max()), open=is_open, recompute=rec))
    return PartPlan(batch=batch, parts=parts, max_tokens=max_tokens, part_of_token=part_of)


def plan_even(batch: TreeBatch, max_tokens: int, num_parts: int, *, block_size: int = 128,
              recompute: bool = True) -> PartPlan:
    """Plan at most ``num_parts`` parts, the largest as small as the trees allow.

    :func:`plan` at the smallest budget between ``tokens / num_parts`` and ``max_tokens`` that
    keeps the count, found by bisection (the count falls as the budget grows); the plan at ``max_tokens`` where no smaller budget keeps the count, or where
    that one would hold more tokens at once.
    Under FSDP2 :func:`treefx.backward` runs every rank's parts in common rounds, each as long
    as its largest part: ranks that cut their trees into as many even parts wait less for
    each other (a rank's first plan may have fewer parts, of very different sizes)."""
    max_tokens = _check_budget(max_tokens)
    if not isinstance(num_parts, numbers.Integral) or isinstance(num_parts, bool) \
            or num_parts < 1:
        raise ValueError(f"num_parts must be a positive integer, got {num_parts!r}")
    first = plan(batch, max_tokens, block_size=block_size, recompute=recompute)
    if first.num_parts > num_parts:
        return first
    best = first
    # About log2(max_tokens) plans: a plan of 35k tokens takes a few ms on a CPU core, one of
    # 100-130k tokens 0.03-0.12 s (its _fewer_parts), so 0.5-1.5 s a step at that size.
    lo, hi = max(1, -(-batch.num_tokens // int(num_parts))), max_tokens - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        candidate = plan(batch, mid, block_size=block_size, recompute=recompute)
        if candidate.num_parts <= num_parts:
            best, hi = candidate, mid - 1
        else:
            lo = mid + 1
    if best is not first and (best.recompute_tokens > first.recompute_tokens
                              or best.peak_held_tokens() > max(first.peak_held_tokens(),
                                                               max_tokens)):
        return first
    return best


def _held_tokens(starts: np.ndarray, ends: np.ndarray, release: np.ndarray,
                 recompute: np.ndarray | None = None) -> np.ndarray:
    """Tokens holding activations during each part's forward when parts run as
    :func:`schedule` runs them: part i is freed after the first part that ends at or past its
    release and those of its readers (later parts starting before its release), so it is
    held during part j > i while that point lies after j's start. A *recompute* part
    (``recompute[i]``) holds activations during its own forward only (and during its
    backward, when no more is held than during its forward: see :meth:`PartPlan.peak_held_tokens`)."""
    n = len(starts)
    free = release.copy()
    for i in range(n - 1, -1, -1):
        k = int(np.searchsorted(starts, release[i]))
        if k > i + 1:
            free[i] = max(release[i], free[i + 1:k].max())
    last = np.searchsorted(starts, free)  # held during parts i .. last-1
    own = np.arange(n) + 1
    last = np.maximum(last, own)
    if recompute is not None:
        last = np.where(recompute, own, last)
    diff = np.zeros(n + 1, dtype=np.int64)
    np.add.at(diff, np.arange(n), ends - starts)
    np.add.at(diff, last, -(ends - starts))
    return np.cumsum(diff)[:n]


def _fewer_parts(ranges, subtree_end, max_tokens: int):
    """Adjacent parts merged, left to right, while the merged part fits ``max_tokens`` and the
    most tokens held at once (:func:`_held_tokens`) stays within ``max_tokens``.
    Each part pays work of the size of the weights (their gradients, summed into ``.grad``;
    the output projection's and embedding's gradients), so fewer parts are faster; an open
    node's tokens share a part with what precedes them where that part may be held longer.
    A recompute part is merged with nothing (its tokens, and only those, are recomputed),
    and no part held past its end may hold a recompute part's release inside it (that would
    keep the recompute part's keys and values after its subtree is done, off the open path)."""
    if len(ranges) < 2:
        return ranges
    starts = np.array([r[0] for r in ranges], dtype=np.int64)
    ends = np.array([r[1] for r in ranges], dtype=np.int64)
    release = np.array([subtree_end[s:e].max() for s, e, _, _ in ranges], dtype=np.int64)
    rec = np.array([r[3] for r in ranges], dtype=bool)
    rec_release = np.unique(release[rec])
    bound = max(max_tokens, int(_held_tokens(starts, ends, release, rec).max()))
    i = 0
    while i + 1 < len(starts):
        s, e = starts[i], ends[i + 1]
        rel = max(release[i], release[i + 1])
        straddles = rel > e and np.any((rec_release > s) & (rec_release < e))
        if e - s <= max_tokens and not rec[i] and not rec[i + 1] and not straddles:
            st = np.delete(starts, i + 1)
            en = np.delete(ends, i)
            re = np.delete(release, i + 1)
            re[i] = rel
            rc = np.delete(rec, i + 1)
            if _held_tokens(st, en, re, rc).max() <= bound:
                starts, ends, release, rec = st, en, re, rc
                ranges = ranges[:i] + [(ranges[i][0], ranges[i + 1][1],
                                        ranges[i][2] or ranges[i + 1][2], False)] + \
                    ranges[i + 2:]
                continue
        i += 1
    return ranges


def _path_before(s: int, node_of, off, ln, npar) -> np.ndarray:
    """Tokens on the path from the root to token ``s``, ``s`` excluded (ascending)."""
    v = int(node_of[s])
    pieces = [np.arange(int(off[v]), s)]
    p = int(npar[v])
    while p >= 0:
        pieces.append(np.arange(int(off[p]), int(off[p]) + int(ln[p])))
        p = int(npar[p])
    return np.concatenate(pieces[::-1]).astype(np.int64)

