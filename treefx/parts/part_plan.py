"""A plan's parts (:class:`Part`, :class:`PartPlan`) and the order they run in: each part's
forward in DFS order, its backward once it is released and nothing after it reads it
(:func:`schedule`, :func:`ready`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..layout import TreeBatch

__all__ = ["Part", "PartPlan", "ready", "schedule"]


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

    def held_on_device(self) -> list[tuple[int, int]]:
        """After each part's forward, in :func:`schedule`'s order: (tokens, parts) held on the
        device for their backward. The current part counts, and so do the parts held for
        their backward, but not recompute or host parts other than the current one (they hold
        nothing on the device between their forward and their backward). A recompute part's
        backward, which builds its activations again, or a host part's, which copies them
        back, holds no more than its forward did (the parts held then were all held then
        too)."""
        out = []
        for j, held in schedule(self):
            on = [i for i in held if i == j or not (self.parts[i].recompute
                                                     or self.parts[i].host)]
            out.append((sum(self.parts[i].num_tokens for i in on), len(on)))
        return out

    def peak_held_tokens(self) -> int:
        """The most tokens whose activations are held at once when the parts run in order and
        each part's backward runs as soon as nothing after it reads it (what
        :func:`treefx.backward` does; :meth:`held_on_device`). At most ``max_tokens`` (unless
        planned with ``beyond="device"``)."""
        return max((tokens for tokens, _ in self.held_on_device()), default=0)

    def peak_context_tokens(self) -> int:
        """The longest *open path*: the most context tokens a part reads, the keys and values
        (and conv inputs) earlier parts keep for it at every site, whatever the budget. They
        are the held recompute parts' own columns (which lie on that path) and part of the
        held parts'. Bytes: tokens × layers × 2 × KV heads × head dim × dtype size for the
        keys and values."""
        return max((len(p.context) for p in self.parts), default=0)


    @cached_property
    def exported_rows(self) -> list[np.ndarray]:
        """For each part, the rows (from its start, ascending) of its tokens that a later
        part reads as context: the only own columns (keys, values, conv inputs) it keeps for
        the parts after it, and the only rows whose gradients come back to it."""
        out = [[] for _ in self.parts]
        for p in self.parts:
            owner = self.part_of_token[p.context]
            for i in np.unique(owner).tolist():
                out[i].append(p.context[owner == i] - self.parts[i].start)
        return [np.unique(np.concatenate(r)) if r else np.zeros(0, np.int64) for r in out]

    def peak_exported_tokens(self) -> int:
        """The most exported rows (:attr:`exported_rows`) held at once: each part's from its
        forward to its backward, in :func:`schedule`'s order."""
        sizes = [len(r) for r in self.exported_rows]
        return max((sum(sizes[i] for i in held) for _, held in schedule(self)), default=0)


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
