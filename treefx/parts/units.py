"""A row cut into units under a budget: closed subtrees that fit the room left, open nodes'
tokens kept (held with their activations) or in recompute chunks."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .shape import TreeShape


def plan_units(shape: TreeShape, max_tokens: int):
    """(start, end, open, recompute, room) ranges in DFS order: closed subtrees that fit the
    room left, open nodes' tokens in chunks. ``room`` = ``max_tokens`` minus the open tokens
    *kept* above the unit (held with their activations), never below a quarter of
    ``max_tokens`` unless every subtree below fits in less. An open node keeps as many of its
    tokens as leave its children the room they need (:func:`tokens_kept`); the rest, first in the
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
            keep = tokens_kept(own, room, max(second[v], min(floor, largest[v])), floor)
            rest = own - keep
            if rest == 1 and keep > 2:
                keep, rest = keep - 1, 2  # no chunk of one token (see no_single_tokens)
        else:  # a leaf: its last `room` tokens run last and are held by nothing after them
            rest, keep = own - room, room
            if rest == 1 and keep > 2:
                keep, rest = keep - 1, 2
        s = off
        for size in chunks(rest, room):
            units.append((s, s + size, True, True, room))
            s += size
        if keep:
            units.append((s, s + keep, True, False, room))
        if children[v]:
            stack.extend((c, kept + keep) for c in children[v][::-1])
    return units


def tokens_kept(own: int, room: int, need: int, floor: int) -> int:
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


def chunks(total: int, room: int) -> list[int]:
    """``total`` tokens in the fewest chunks of at most ``room``, as equal as can be."""
    if total <= 0:
        return []
    k = -(-total // room)
    q, r = divmod(total, k)
    return [q + 1] * r + [q] * (k - r)
