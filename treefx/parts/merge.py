"""Adjacent parts merged while the tokens held at once stay within the bound: closed parts of
one token (:func:`no_single_tokens`), then left to right (:func:`fewer_parts`), then small
parts and parts beyond the budget (:func:`merge_small`); what is held during each part's
forward (:func:`held_tokens`, :func:`free_points`)."""

from __future__ import annotations

import bisect

import numpy as np


def no_single_tokens(ranges):
    """Closed parts of one token merged into an adjacent closed part that has room (both
    finish right after their forward, so the memory bound holds). A graph compiled for a row
    of one token is specialized to it (Dynamo guards sizes 0 and 1), so every such part would
    compile anew; the rest (an open node's single token, which must stay on its own to be
    released with its subtree) is padded with one inert token (:func:`part_tensors`)."""
    out = [list(r) for r in ranges]
    i = 0
    while i < len(out):
        s, e, is_open, _, room = out[i]
        if e - s != 1 or is_open:
            i += 1
            continue
        nxt = out[i + 1] if i + 1 < len(out) else None
        prv = out[i - 1] if i > 0 else None
        if nxt is not None and not nxt[2] and nxt[1] - s <= min(room, nxt[4]):
            out[i + 1] = [s, nxt[1], False, False, min(room, nxt[4])]
            del out[i]
            continue
        if prv is not None and not prv[2] and e - prv[0] <= min(room, prv[4]):
            out[i - 1] = [prv[0], e, False, False, min(room, prv[4])]
            del out[i]
            continue
        i += 1
    return [tuple(r[:4]) for r in out]


def free_points(starts, release) -> list[int]:
    """Per part i (lists of ints, ``release[i] >= starts[i + 1]``): the point of the row
    after which it is freed when parts run as :func:`schedule` runs them, the largest release
    of the parts it reaches: itself, its readers (later parts starting before its release),
    theirs, and so on. The parts reached from i are those of ``[i, m)`` for some m, and the
    ranges of two parts are nested or apart; right to left, a stack holds the ranges not yet
    reached from a part on their left (the nearest on top) with their largest release: part i
    takes those that start before its release (one pass, not a range maximum per part)."""
    n = len(starts)
    free = [0] * n
    blocks: list[tuple[int, int]] = []  # (first part, free), the nearest last
    for i in range(n - 1, -1, -1):
        k = bisect.bisect_left(starts, release[i], i + 1)  # the parts before k read part i
        f = release[i]
        while blocks and blocks[-1][0] < k:
            f = max(f, blocks.pop()[1])
        blocks.append((i, f))
        free[i] = f
    return free


def held_tokens(starts: np.ndarray, ends: np.ndarray, release: np.ndarray,
                 recompute: np.ndarray | None = None, free=None) -> np.ndarray:
    """Tokens holding activations during each part's forward when parts run as
    :func:`schedule` runs them: part i is freed after the first part that ends at or past its
    release and those of its readers (later parts starting before its release), so it is
    held during part j > i while that point (:func:`free_points`) lies after j's start. A
    *recompute* part (``recompute[i]``) holds activations during its own forward only (and
    during its backward, when no more is held than during its forward: see
    :meth:`PartPlan.peak_held_tokens`). ``free``: :func:`free_points`'s, when known."""
    n = len(starts)
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    if free is None:
        free = free_points(starts.tolist(), np.asarray(release).tolist())
    last = np.searchsorted(starts, np.asarray(free, dtype=np.int64))  # held: parts i .. last-1
    own = np.arange(n) + 1
    last = np.maximum(last, own)
    if recompute is not None:
        last = np.where(recompute, own, last)
    diff = np.zeros(n + 1, dtype=np.int64)
    np.add.at(diff, np.arange(n), ends - starts)
    np.add.at(diff, last, -(ends - starts))
    return np.cumsum(diff)[:n]


def fewer_parts(ranges, subtree_end, max_tokens: int):
    """Adjacent parts merged, left to right, while the merged part fits ``max_tokens`` and the
    most tokens held at once (:func:`held_tokens`) stays within ``max_tokens``.
    Each part pays work of the size of the weights (their gradients, summed into ``.grad``;
    the output projection's and embedding's gradients), so fewer parts are faster; an open
    node's tokens share a part with what precedes them where that part may be held longer.
    A recompute part is merged with nothing (its tokens, and only those, are recomputed),
    and no part held past its end may hold a recompute part's release inside it (that would
    keep the recompute part's keys and values after its subtree is done, off the open path).

    ``ranges`` tile the row. What is held is counted once, then updated at each merge (not
    counted again: that made planning quadratic in the parts). Held during part j is
    ``size_j`` plus the size of every earlier part p, not a recompute part, with
    ``free_p > start_j`` (:func:`free_points`). Merging parts i and i + 1 into m (neither a
    recompute part) leaves what is held during the parts before i as it was, holds
    ``held[i] + size_{i+1}`` during m, and adds one amount to what is held during the parts
    after, those that start in one interval:

    - part i + 1 reads part i (``free_i > end_i``): m is freed at ``free_i``, and part i + 1's
      ``size_{i+1}`` is now held during the parts starting in ``[free_{i+1}, free_i)``;
    - it does not (``free_i = end_i``): m is freed at ``free_{i+1}``, and so is every earlier
      part freed within part i (those held during part i, not during part i + 1): during the
      parts starting before ``free_{i+1}``, ``size_i`` and those parts are now held too,
      ``held[i] - size_i - (held[i+1] - size_{i+1})`` tokens.

    The merge is kept when neither m nor those parts hold more than the bound, exactly as
    when everything held is counted again after it."""
    if len(ranges) < 2:
        return ranges
    ranges = list(ranges)
    starts = [r[0] for r in ranges]
    ends = [r[1] for r in ranges]
    release = np.maximum.reduceat(subtree_end[:ends[-1]], starts).tolist()
    rec = [bool(r[3]) for r in ranges]
    rec_release = sorted({r for r, c in zip(release, rec) if c})
    free = free_points(starts, release)
    held = held_tokens(starts, ends, release, rec, free).tolist()
    bound = max(max_tokens, max(held))
    i = 0
    while i + 1 < len(starts):
        s, e = starts[i], ends[i + 1]
        rel = max(release[i], release[i + 1])
        if rel > e:  # a recompute part's release inside the merged part
            k = bisect.bisect_right(rec_release, s)
            straddles = k < len(rec_release) and rec_release[k] < e
        else:
            straddles = False
        if e - s <= max_tokens and not rec[i] and not rec[i + 1] and not straddles:
            size = ends[i + 1] - starts[i + 1]
            if free[i] > ends[i]:
                add, lo, hi = size, free[i + 1], free[i]
            else:
                add, lo, hi = held[i] + size - held[i + 1], ends[i + 1], free[i + 1]
            a = bisect.bisect_left(starts, lo, i + 2)
            b = bisect.bisect_left(starts, hi, a)
            peak = held[i] + size
            if a < b:
                peak = max(peak, max(held[a:b]) + add)
            if peak <= bound:
                for j in range(a, b):
                    held[j] += add
                held[i] += size
                free[i] = max(free[i], free[i + 1])
                release[i], ends[i] = rel, e
                ranges[i] = (ranges[i][0], ranges[i + 1][1], ranges[i][2] or ranges[i + 1][2],
                             False)
                for x in (starts, ends, release, rec, free, held, ranges):
                    del x[i + 1]
                continue
        i += 1
    return ranges


def merge_small(ranges, subtree_end, max_tokens: int, min_part: int, *, host: bool):
    """The fixed cost of a part in the plan's objective: adjacent parts merged, wherever the
    merged part fits ``max_tokens`` and the tokens held on the device at once
    (:func:`held_tokens`) stay within the bound, when that saves a part at no other cost:

    - two parts beyond the budget (host parts: the same tokens go to the host; recompute
      parts: the same tokens are recomputed);
    - a part smaller than ``min_part`` and a neighbour within the budget;
    - with ``host``, a part smaller than ``min_part`` and a host part beside it: the merged
      part is a host part (the small part's activations go to the host too, which costs
      less than a part of its own). A recompute part never takes in other tokens (they
      would be computed twice).

    The smallest parts first, each with its smaller neighbour first; then pairs beyond the
    budget left to right, until nothing merges. What is held is counted again for each
    merge tried (few parts are small)."""
    if len(ranges) < 2:
        return ranges
    out = [tuple(r[:4]) for r in ranges]
    se = np.asarray(subtree_end)

    def held_peak(rs) -> int:
        starts = [r[0] for r in rs]
        ends = [r[1] for r in rs]
        release = np.maximum.reduceat(se[:ends[-1]], starts).tolist()
        return int(held_tokens(starts, ends, release, [bool(r[3]) for r in rs]).max())

    bound = max(max_tokens, held_peak(out))

    def mergeable(a, b) -> bool:
        if b[1] - a[0] > max_tokens:
            return False
        small = min(a[1] - a[0], b[1] - b[0]) < min_part
        if a[3] and b[3]:
            return True
        if a[3] or b[3]:
            return host and small
        return small

    def try_merge(i) -> bool:
        a, b = out[i], out[i + 1]
        if not mergeable(a, b):
            return False
        merged = (a[0], b[1], a[2] or b[2], a[3] or b[3])
        candidate = out[:i] + [merged] + out[i + 2:]
        if held_peak(candidate) > bound:
            return False
        out[i:i + 2] = [merged]
        return True

    changed = True
    while changed and len(out) > 1:
        changed = False
        for k in sorted(range(len(out)), key=lambda k: out[k][1] - out[k][0]):
            if out[k][1] - out[k][0] >= min_part:
                break
            sides = [i for i in (k - 1, k) if 0 <= i < len(out) - 1]
            sides.sort(key=lambda i: out[i + 1 if i == k else i][1] - out[i + 1 if i == k
                                                                          else i][0])
            if any(try_merge(i) for i in sides):
                changed = True
                break
        if changed:
            continue
        i = 0
        while i + 1 < len(out):
            if out[i][3] and out[i + 1][3] and try_merge(i):
                changed = True
                continue
            i += 1
    return out
