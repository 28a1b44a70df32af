"""A frozen copy of ``treefx/parts.py``'s planner as it was before it was made faster
(commit c811ca2): :func:`plan` and :func:`plan_even` with their helpers, word for word but
for the import of ``TreeBatch`` and without ``part_tensors``. ``tests/test_parts_planner.py``
checks that the package's planner gives exactly the plans this one gives. Do not edit.

The original module docstring follows.

Cut a packed tree row into parts that fit a token budget, each token computed once.

Redundancy-free parts: a packed tree row cut into parts that fit a token budget, each token
computed once (see :func:`treefx.backward`, which runs them).

A part is a contiguous range ``[start, end)`` of the DFS row; boundaries may fall anywhere,
inside a node too (a sequence longer than the budget becomes a chain of parts). What a part
needs from earlier parts is what its tokens read of their **ancestors** there, and every such
ancestor is an ancestor of the part's first token (a token before ``start`` whose subtree holds
a later token holds ``start`` too): its *context* is the path from the root to ``start``.

- Context tokens: their keys and values (and conv inputs) at every site, read from the parts
  that computed them. They sit before the part's own tokens in an *extended row*
  ``[context (padded to a block multiple); part]`` whose tree tensors (positions, parents,
  subtree ends) are in that row's coordinates, so the tree mask stays the interval test.
- Entries: the part's tokens whose predecessor lies in an earlier part; each starts its node
  from the recurrent state after that predecessor, an *exit* of the earlier part (a token with
  a successor in a later part).
- Labels: the log-probability of token t is read from its predecessor's logits, so it belongs
  to the part of the predecessor: a part predicts every token whose predecessor it holds, its
  own and the first tokens of later parts.

Planning (:func:`plan`): a part of *closed* units (whole subtrees) is finished, forward and
backward, as soon as it ran; a part of an *open* node's own tokens (a node whose subtree does
not fit) is held until the node's subtree is done. The planner bounds the tokens holding
activations at once by ``max_tokens``, whatever the tree's shape (a comb-shaped agent tree,
whose whole trunk is open; a sequence longer than the budget): below *kept* open tokens
``K``, a subtree that fits in the room ``max_tokens - K`` is a closed unit (consecutive ones
share a part while they fit), a larger one is open. An open node keeps as many of its tokens
(held with their activations; its children then plan with them added to ``K``) as leave its
children the room they need, and never so many that the room drops below a quarter of
``max_tokens`` (parts stay large enough to keep a GPU busy) unless each child's subtree fits
in less; its other tokens, first in the
node, are *recompute* parts: their forward keeps no activations, only what later parts read
(their keys, values and conv inputs at every site, their exit states), and their backward
runs the forward again first. A leaf node longer than the room recomputes all but its last
``room`` tokens. How many to keep is exact for the fewest recomputed tokens (without the
quarter's floor and the rounding of chunks: see ``_kept``): a node keeps down to its
children's second largest "breakpoint", so on a comb the trunk keeps what leaves the longest
completion below room, and a chain keeps nothing. Nothing is recomputed while every root-to-leaf
path leaves a quarter of ``max_tokens``.

The keys and values of the *open path* (the context a part reads: the root to its first
token) are kept whatever the budget, since later parts attend to them:
:meth:`PartPlan.peak_context_tokens` is the longest, beside
:meth:`PartPlan.peak_held_tokens` (activations, at most ``max_tokens``) and
:attr:`PartPlan.recompute_tokens`. Bytes per open-path token: attention layers × 2 × KV
heads × head dim × dtype size (and each causal conv's input width × dtype size).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np
import torch

from treefx.layout import TreeBatch

__all__ = ["Part", "PartPlan", "plan", "plan_even"]


@dataclass(eq=False)
class Part:
    """One part of a plan: a range of the DFS row and what it reads from earlier parts.

    One part of a :class:`PartPlan` (numpy arrays on the host; indices into the DFS row
    unless said otherwise).

    ``start``/``end``: its tokens. ``context``: the path from the root to ``start``
    (ascending), whose keys and values it reads. ``entries``: predecessors in earlier parts
    of its tokens (ascending), whose exit states start its nodes; ``entry_of_token`` [n]:
    which entry each token's predecessor is, -1 where it is not in an earlier part. ``exits``:
    its tokens with a successor in a later part (ascending). ``label_rows`` / ``label_tokens``:
    the tokens it predicts (the tree tokens whose predecessor it holds) and, for each, the
    predecessor's row in the part. ``release``: the end of the last subtree that starts in
    it; its backward waits until every token before that ran. ``context_pad``: the context
    row length, padded to a multiple of the block size (at least one block). ``open``: it
    holds tokens of a node whose subtree does not fit the room (held until that subtree is
    done). ``recompute``: its forward keeps no activations (only what later parts read: its
    own keys, values and conv inputs and its exit states), and its backward runs the forward
    again first; only open parts held beyond the budget are."""

    index: int
    start: int
    end: int
    context: np.ndarray
    context_pad: int
    entries: np.ndarray
    entry_of_token: np.ndarray
    exits: np.ndarray
    label_rows: np.ndarray
    label_tokens: np.ndarray
    release: int
    open: bool
    recompute: bool = False

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(eq=False)
class PartPlan:
    """The parts of one packed batch, in DFS order.

    ``max_tokens``: the budget.
    ``part_of_token`` [N]: which part holds each token."""

    batch: TreeBatch
    parts: list[Part]
    max_tokens: int
    part_of_token: np.ndarray

    @property
    def num_parts(self) -> int:
        return len(self.parts)

    @property
    def recompute_tokens(self) -> int:
        """Tokens whose forward runs twice: those of the recompute parts (without keeping
        activations, then again with them at their backward)."""
        return sum(p.num_tokens for p in self.parts if p.recompute)

    def peak_held_tokens(self) -> int:
        """The most tokens whose activations are held at once when the parts run in order and
        each part's backward runs as soon as nothing after it reads it (what
        :func:`treefx.backward` does): the current part's and those of the parts held
        for their backward, but not of recompute parts other than the current one (they
        hold no activations between their forward and their backward). At most
        ``max_tokens``. A recompute part's backward, which builds its activations again,
        holds no more than its forward did (the parts held then were all held then too)."""
        peak = 0
        for j, held in schedule(self):
            peak = max(peak, sum(self.parts[i].num_tokens for i in held
                                 if i == j or not self.parts[i].recompute))
        return peak

    def peak_context_tokens(self) -> int:
        """The longest *open path*: the most context tokens a part reads, the keys and values
        (and conv inputs) earlier parts keep for it at every site, whatever the budget. They
        are the held recompute parts' own columns (which lie on that path) and part of the
        held parts'. Bytes: tokens × layers × 2 × KV heads × head dim × dtype size for the
        keys and values."""
        return max((len(p.context) for p in self.parts), default=0)


def _check_budget(max_tokens) -> int:
    if not isinstance(max_tokens, numbers.Integral) or isinstance(max_tokens, bool) \
            or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    return int(max_tokens)


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


def _kept(own: int, room: int, need: int, floor: int) -> int:
    """How many of an open node's ``own`` tokens to keep (held with their activations while
    its subtree runs; the rest are recomputed), with ``room`` left under the budget and
    ``need`` the room its children should keep (``floor``: a quarter of the budget).

    The fewest recomputed tokens of a subtree as a function of its room r is convex,
    piecewise linear and non-increasing: sum over a multiset of "breakpoints" b of
    max(0, b - r) (a leaf of length L: {L}; a node of length R: its children's multisets
    together, with the largest raised by R, since keeping its tokens or those of the
    deepest path below costs the same). Keeping x of the node's tokens saves x and costs
    the children's function at r - x, whose slope is minus the number of breakpoints above
    r - x: keeping pays while at most one lies above, that is down to the children's second
    largest breakpoint. Among equal costs the planner keeps tokens as high in the tree as it
    can (a kept part's attention saves its context's keys and values: the shorter, the
    better). A kept piece smaller than a sixteenth of the budget is not split off (a part
    of its own costs more than recomputing it)."""
    keep = max(0, min(own, room - need))
    if keep < own and keep < max(1, floor // 4):
        keep = 0
    return keep


def _chunks(total: int, room: int) -> list[int]:
    """``total`` tokens in the fewest chunks of at most ``room``, as equal as can be."""
    if total <= 0:
        return []
    k = -(-total // room)
    q, r = divmod(total, k)
    return [q + 1] * r + [q] * (k - r)


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


def _no_single_tokens(ranges):
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


def schedule(plan: PartPlan):
    """(part index, parts holding activations after its forward) in run order: after the
    forward of part j, every part that is *released* (its subtrees are done: ``release`` at or
    before the end of part j) and whose readers are all finished runs its backward. Yields
    after each forward and lists what is held then (before those backwards)."""
    parts = plan.parts
    held: list[int] = []
    for j, part in enumerate(parts):
        held.append(j)
        yield j, list(held)
        done = set(ready(plan, held, part.end))
        held = [i for i in held if i not in done]


def ready(plan: PartPlan, held: list[int], cursor: int) -> list[int]:
    """The held parts whose backward may run once the row up to ``cursor`` ran, latest
    first: a part is released at ``cursor`` and every later part that reads it (starts
    before its release) has run its backward (or runs it in this round, before it)."""
    parts = plan.parts
    out: list[int] = []
    still = set(held)
    for i in sorted(held, reverse=True):
        p = parts[i]
        if p.release > cursor:
            continue
        readers = [k for k in still if k > i and parts[k].start < p.release]
        if readers:
            continue
        out.append(i)
        still.discard(i)
    return out
