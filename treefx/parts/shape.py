"""What planning reads of a packed batch, whatever the budget (:class:`TreeShape`)."""

from __future__ import annotations

import numpy as np

from ..layout import TreeBatch


class TreeShape:
    """What planning reads of a batch, whatever the budget, computed once: :func:`plan_even`
    plans the same batch at about log2(max_tokens) budgets, and none of this depends on the
    budget. The tree tensors on the host; per node (lists of ints, read one at a time by
    :func:`plan_units`): its first token, its length, its subtree's size, its parent, its
    children (and the roots) in node order, its largest child subtree and its children's
    second largest breakpoint (see :func:`tokens_kept`)."""

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
        # the two largest "breakpoints" of each subtree (see tokens_kept): the longest path's
        # tokens, then the next one not sharing its top; nodes in DFS order, so children after
        # parents
        top1, top2 = [0] * n, [0] * n
        self.second = second = [0] * n  # the children's second largest, for tokens_kept
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
