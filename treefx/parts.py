"""Cut a packed tree row into parts that fit a token budget, each token computed once.

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

import bisect
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from .layout import TreeBatch, move_tensors, remember_host_row

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
    again first; only open parts held beyond the budget are, and only when planned with
    ``beyond="recompute"`` (the default). ``host``: what its forward saves for its backward is
    held in host memory between the two (an open part held beyond the budget, planned with
    ``beyond="host"``): its forward runs once."""

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
    host: bool = False

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(eq=False)
class PartPlan:
    """The parts of one packed batch, in DFS order.

    ``max_tokens``: the budget.
    ``part_of_token`` [N]: which part holds each token.
    ``beyond``: where the open parts held beyond the budget keep their activations
    (:func:`plan`'s)."""

    batch: TreeBatch
    parts: list[Part]
    max_tokens: int
    part_of_token: np.ndarray
    beyond: str = "recompute"

    @property
    def num_parts(self) -> int:
        return len(self.parts)

    @property
    def host_tokens(self) -> int:
        """Tokens of the host parts: what their forwards save for their backwards is held in
        host memory between the two (copied out, then back), not on the device."""
        return sum(p.num_tokens for p in self.parts if p.host)

    @property
    def recompute_tokens(self) -> int:
        """Tokens whose forward runs twice: those of the recompute parts (without keeping
        activations, then again with them at their backward)."""
        return sum(p.num_tokens for p in self.parts if p.recompute)

    def peak_held_tokens(self) -> int:
        """The most tokens whose activations are held at once when the parts run in order and
        each part's backward runs as soon as nothing after it reads it (what
        :func:`treefx.backward` does): the current part's and those of the parts held
        for their backward, but not of recompute or host parts other than the current one
        (they hold no activations on the device between their forward and their backward).
        At most ``max_tokens`` (unless planned with ``beyond="device"``). A recompute part's
        backward, which builds its activations again, or a host part's, which copies them
        back, holds no more than its forward did (the parts held then were all held then
        too)."""
        peak = 0
        for j, held in schedule(self):
            peak = max(peak, sum(self.parts[i].num_tokens for i in held
                                 if i == j or not (self.parts[i].recompute
                                                   or self.parts[i].host)))
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


class _Shape:
    """What planning reads of a batch, whatever the budget, computed once: :func:`plan_even`
    plans the same batch at about log2(max_tokens) budgets, and none of this depends on the
    budget. The tree tensors on the host; per node (lists of ints, read one at a time by
    :func:`_units`): its first token, its length, its subtree's size, its parent, its
    children (and the roots) in node order, its largest child subtree and its children's
    second largest breakpoint (see :func:`_kept`)."""

    def __init__(self, batch: TreeBatch):
        self.batch = batch
        self.parent = batch.parent_token.cpu().numpy()
        self.subtree_end = se = batch.subtree_end.cpu().numpy()
        self.n_real = batch.num_real_tokens
        self.num_tokens = batch.num_tokens
        self.node_offset = off = batch.node_offset.cpu().numpy()
        self.node_length = ln = batch.node_length.cpu().numpy()
        npar = batch.node_parent.cpu().numpy()
        n = len(off)
        self.offset = off.tolist()
        self.length = length = ln.astype(np.int64).tolist()
        self.size = size = (se[off] - off).tolist()
        self.node_parent = npar.tolist()
        self.children = children = [[] for _ in range(n)]
        self.roots = roots = []
        for i, p in enumerate(self.node_parent):
            (children[p] if p >= 0 else roots).append(i)
        # the two largest "breakpoints" of each subtree (see _kept): the longest path's tokens,
        # then the next one not sharing its top; nodes in DFS order, so children after parents
        top1, top2 = [0] * n, [0] * n
        self.second = second = [0] * n  # the children's second largest, for _kept
        self.largest = largest = [0] * n  # the largest child subtree
        for v in range(n - 1, -1, -1):
            kids = children[v]
            if not kids:
                top1[v] = length[v]
                continue
            best = sorted((x for c in kids for x in (top1[c], top2[c])), reverse=True)[:2]
            best += [0] * (2 - len(best))
            top1[v], top2[v], second[v] = length[v] + best[0], best[1], best[1]
            largest[v] = max(size[c] for c in kids)
        self._by_parent = None
        self._node_of = None

    def context(self, s: int) -> np.ndarray:
        """Tokens on the path from the root to token ``s``, ``s`` excluded (ascending): its
        ancestor nodes' tokens, then those of its own node before it."""
        if self._node_of is None:
            self._node_of = np.repeat(np.arange(len(self.offset)), self.node_length)
        v = int(self._node_of[s])
        path = []
        p = self.node_parent[v]
        while p >= 0:
            path.append(p)
            p = self.node_parent[p]
        path.reverse()
        lens = self.node_length[path].astype(np.int64)
        # each ancestor's tokens: its offset, then one more per token
        shift = np.repeat(self.node_offset[path] - (np.cumsum(lens) - lens), lens)
        head = shift + np.arange(len(shift), dtype=np.int64)
        return np.concatenate([head, np.arange(self.offset[v], s)]).astype(np.int64)

    def predicted(self, s: int, e: int) -> np.ndarray:
        """The tokens whose predecessor lies in ``[s, e)``, ascending: a slice of the tokens
        sorted by predecessor (one sort for every part, not a pass over the row each)."""
        if self._by_parent is None:
            order = np.argsort(self.parent, kind="stable")
            self._by_parent = order, self.parent[order]
        order, sorted_parent = self._by_parent
        lo, hi = np.searchsorted(sorted_parent, (s, e))
        return np.sort(order[lo:hi])


def _units(shape: _Shape, max_tokens: int):
    """(start, end, open, recompute, room) ranges in DFS order: closed subtrees that fit the
    room left, open nodes' tokens in chunks. ``room`` = ``max_tokens`` minus the open tokens
    *kept* above the unit (held with their activations), never below a quarter of
    ``max_tokens`` unless every subtree below fits in less. An open node keeps as many of its
    tokens as leave its children the room they need (:func:`_kept`); the rest, first in the
    node, are recompute chunks of at most
    the room. A leaf node longer than the room recomputes all but its last ``room`` tokens,
    which run last and are held by nothing after them. Only the open nodes and their
    children are visited: what depends on the budget (the tree's own quantities are
    ``shape``'s)."""
    floor = max(1, max_tokens // 4)
    offset, length, sizes = shape.offset, shape.length, shape.size
    children, second, largest = shape.children, shape.second, shape.largest
    units = []
    stack = [(v, 0) for v in shape.roots[::-1]]
    while stack:
        v, kept = stack.pop()
        off = offset[v]
        room = max_tokens - kept
        size = sizes[v]
        if size <= room:
            units.append((off, off + size, False, False, room))
            continue
        own = length[v]
        if children[v]:
            # the room the children need: a quarter of the budget (parts large enough), or
            # less when every child's subtree fits in less (then all of them are closed)
            keep = _kept(own, room, max(second[v], min(floor, largest[v])), floor)
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
    max_tokens = _check_budget(max_tokens)
    if not isinstance(batch, TreeBatch):
        raise TypeError(f"expected a treefx.TreeBatch, got {type(batch).__name__}")
    mode = _beyond(recompute, beyond)
    small = _min_part(min_part, max_tokens, mode)
    shape = _Shape(batch)
    return _build(shape, _ranges(shape, max_tokens, mode, small), max_tokens, block_size, mode)


def _ranges(shape: _Shape, max_tokens: int, beyond: str, min_part: int = 0):
    """The parts' (start, end, open, beyond the budget) in DFS order, without building them:
    all :func:`plan_even`'s bisection needs (their count)."""
    units = _units(shape, max_tokens)
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
    ranges = _fewer_parts(_no_single_tokens(ranges), shape.subtree_end, max_tokens)
    if min_part > 0 or beyond == "host":
        ranges = _merge_small(ranges, shape.subtree_end, max_tokens, min_part,
                              host=beyond == "host")
    return ranges


def _merge_small(ranges, subtree_end, max_tokens: int, min_part: int, *, host: bool):
    """The fixed cost of a part in the plan's objective: adjacent parts merged, wherever the
    merged part fits ``max_tokens`` and the tokens held on the device at once
    (:func:`_held_tokens`) stay within the bound, when that saves a part at no other cost:

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
        return int(_held_tokens(starts, ends, release, [bool(r[3]) for r in rs]).max())

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


def _build(shape: _Shape, ranges, max_tokens: int, block_size: int,
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
    max_tokens = _check_budget(max_tokens)
    if not isinstance(num_parts, numbers.Integral) or isinstance(num_parts, bool) \
            or num_parts < 1:
        raise ValueError(f"num_parts must be a positive integer, got {num_parts!r}")
    if not isinstance(batch, TreeBatch):
        raise TypeError(f"expected a treefx.TreeBatch, got {type(batch).__name__}")
    mode = _beyond(recompute, beyond)
    small = _min_part(min_part, max_tokens, mode)
    shape = _Shape(batch)  # once for every budget tried
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


def _free(starts, release) -> list[int]:
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


def _held_tokens(starts: np.ndarray, ends: np.ndarray, release: np.ndarray,
                 recompute: np.ndarray | None = None, free=None) -> np.ndarray:
    """Tokens holding activations during each part's forward when parts run as
    :func:`schedule` runs them: part i is freed after the first part that ends at or past its
    release and those of its readers (later parts starting before its release), so it is
    held during part j > i while that point (:func:`_free`) lies after j's start. A
    *recompute* part (``recompute[i]``) holds activations during its own forward only (and
    during its backward, when no more is held than during its forward: see
    :meth:`PartPlan.peak_held_tokens`). ``free``: :func:`_free`'s, when known."""
    n = len(starts)
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    if free is None:
        free = _free(starts.tolist(), np.asarray(release).tolist())
    last = np.searchsorted(starts, np.asarray(free, dtype=np.int64))  # held: parts i .. last-1
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
    keep the recompute part's keys and values after its subtree is done, off the open path).

    ``ranges`` tile the row. What is held is counted once, then updated at each merge (not
    counted again: that made planning quadratic in the parts). Held during part j is
    ``size_j`` plus the size of every earlier part p, not a recompute part, with
    ``free_p > start_j`` (:func:`_free`). Merging parts i and i + 1 into m (neither a
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
    free = _free(starts, release)
    held = _held_tokens(starts, ends, release, rec, free).tolist()
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


def part_tensors(plan: PartPlan, part: Part, device=None, *, min_tokens: int = 2,
                 keep_labels: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """The tensors a part's graph takes, in the extended row's coordinates (see the module's
    docstring): ``input_ids`` [1, n]; ``tree_info`` [3, n] (positions, predecessor, subtree
    end); ``part_info`` [3, A] (the same for the context row, A = ``part.context_pad``; the
    padding is seen by no query); ``state_entry`` [n] (row of ``ctx_state`` a token's node
    starts from, -1: none); ``state_exit`` [X] (rows whose state is handed on; at least 2,
    repeated); ``labels`` [2, m] (predecessor row, token id; at least 2, padded with row 0);
    ``label_tokens`` (the predicted tokens, the first entries of ``labels``). On the host
    when ``device`` is None. A part of fewer than ``min_tokens`` tokens (at least 2: Dynamo
    specializes a graph to a row of one token) gets inert tokens after its own, each its own
    root that nothing reads. ``keep_labels`` (a mask over ``part.label_tokens``): predict
    only those (the trained ones, for a loss that reads no others)."""
    b = plan.batch
    s, e, a = part.start, part.end, part.context_pad
    pos = b.position_ids[0].cpu().numpy()
    parent = b.parent_token.cpu().numpy()
    se = b.subtree_end.cpu().numpy()
    ids = b.input_ids[0].cpu().numpy()
    ctx = part.context
    k = len(ctx)
    par = parent[s:e]
    # a predecessor before the part lies on the context path (ascending): its row there
    par_ext = np.where(par >= s, a + par - s,
                       np.where(par >= 0, np.searchsorted(ctx, par), -1))
    tree_info = np.stack([pos[s:e], par_ext, a + np.minimum(se[s:e], e) - s])
    p_pos = np.zeros(a, dtype=np.int64)
    p_par = np.full(a, -1, dtype=np.int64)
    p_se = np.zeros(a, dtype=np.int64)
    if k:
        p_pos[:k] = pos[ctx]
        p_par[:k] = np.arange(-1, k - 1)  # a path: each token's predecessor is the one before
        p_se[:k] = a + np.clip(se[ctx] - s, 0, e - s)
    part_info = np.stack([p_pos, p_par, p_se])
    exits_local = part.exits - s
    if len(exits_local) < 2:
        exits_local = np.concatenate([exits_local, np.full(2 - len(exits_local), e - s - 1)])
    rows, toks = part.label_rows, part.label_tokens
    if keep_labels is not None:
        rows, toks = rows[keep_labels], toks[keep_labels]
    predicted = toks
    if len(rows) < 2:
        pad = 2 - len(rows)
        rows = np.concatenate([rows, np.zeros(pad, np.int64)])
        toks = np.concatenate([toks, np.full(pad, -1)])
    labels = np.stack([rows, np.where(toks >= 0, ids[np.maximum(toks, 0)], 0)])

    own_ids, entry = ids[s:e], part.entry_of_token
    extra = max(2, min_tokens) - (e - s)
    if extra > 0:  # inert tokens: each sees only itself, nothing reads them. Their id is the
        # part's last token's, a real one: id 0 is a padding id in some models, whose zero
        # embedding row made Gemma 3n's AltUp take sqrt(0), whose backward is 0 * inf = NaN
        filler = own_ids[-1] if len(own_ids) else 0
        own_ids = np.append(own_ids, np.full(extra, filler, np.int64))
        entry = np.append(entry, np.full(extra, -1))
        rows = a + (e - s) + np.arange(extra)
        tree_info = np.concatenate(
            [tree_info, np.stack([np.zeros(extra, np.int64), np.full(extra, -1), rows + 1])],
            axis=1)

    def t(x):
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))

    host = {"input_ids": t(own_ids)[None], "tree_info": t(tree_info),
            "part_info": t(part_info), "state_entry": t(entry),
            "state_exit": t(exits_local), "labels": t(labels),
            "label_tokens": t(predicted)}
    if device is None:
        return host
    # one pinned copy per dtype, not waiting for the device's queue; the rows the part's ops
    # read on the host (its predecessors, where its states enter and leave) keep their host
    # copies, so those ops copy nothing back (treefx.ops.host_row)
    moved = dict(zip(host, move_tensors(list(host.values()), torch.device(device))))
    keep_host_rows(moved, host)
    return moved


def keep_host_rows(moved: dict, host: dict, *, pinned: bool = False) -> list:
    """Register the host copies of a part's rows that its ops read on the host (its
    predecessors, where its states enter and leave; :mod:`treefx.ops.host_row`) for their
    moved device rows, so that those ops copy nothing back (which would wait for the
    device). ``pinned``: kept until :func:`treefx.layout.forget_host_rows` of the returned
    keys (a part's backward reads them after every later part's forward)."""
    return [remember_host_row(dev, h, pinned=pinned)
            for dev, h in ((moved["tree_info"][1], host["tree_info"][1]),
                           (moved["state_entry"], host["state_entry"]),
                           (moved["state_exit"], host["state_exit"]))]
