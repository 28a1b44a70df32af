"""A tree's nodes: the compressed trie of token lists (:meth:`treefx.Tree.from_sequences`), and
the checks of nodes given explicitly (:meth:`treefx.Tree.from_nodes`): parents before their
children, sequence ends, every node on a sequence, siblings starting with different tokens."""

from __future__ import annotations

import numbers

import numpy as np


def build_trie(seqs: list[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Compressed trie of ``seqs``: (segments, parents, end node per sequence), nodes in DFS
    preorder.

    Sort the sequences, take the longest common prefix of neighbours, and walk a stack of the
    current path (as when building a suffix tree from a suffix array): O(total tokens) after the
    sort, no per-token Python loop.
    """
    # Token ids are non-negative, so their big-endian bytes sort as the id lists do (a
    # prefix first), compared in C rather than element by element in Python.
    keys = [s.astype(">i8").tobytes() for s in seqs]
    order = sorted(range(len(seqs)), key=keys.__getitem__)
    # Mutable nodes: [start, end, source sequence, children, ends-here]
    nodes: list[list] = []
    roots: list[int] = []
    end_node = np.empty(len(seqs), dtype=np.int64)
    stack: list[int] = []
    prev = None
    for i in order:
        s = seqs[i]
        if prev is None:
            lcp = 0
        else:
            m = min(len(prev), len(s))
            diff = np.flatnonzero(prev[:m] != s[:m])
            lcp = int(diff[0]) if diff.size else m
        while stack and nodes[stack[-1]][0] >= lcp:
            stack.pop()
        if stack and nodes[stack[-1]][1] > lcp:
            # Split the top node at lcp: its tail keeps its children and its sequence ends.
            top = nodes[stack[-1]]
            tail = [lcp, top[1], top[2], top[3], top[4]]
            nodes.append(tail)
            top[1], top[3], top[4] = lcp, [len(nodes) - 1], []
        if lcp < len(s):
            nodes.append([lcp, len(s), i, [], []])
            new = len(nodes) - 1
            (nodes[stack[-1]][3] if stack else roots).append(new)
            stack.append(new)
        nodes[stack[-1]][4].append(i)
        prev = s
    # Preorder renumbering.
    segments: list[np.ndarray] = []
    parents: list[int] = []
    work = [(r, -1) for r in reversed(roots)]
    while work:
        n, p = work.pop()
        start, end, src, children, ends = nodes[n]
        k = len(segments)
        segments.append(seqs[src][start:end])
        parents.append(p)
        for e in ends:
            end_node[e] = k
        work.extend((c, k) for c in reversed(children))
    return segments, np.asarray(parents, dtype=np.int64), end_node


def check_parents(parents, num_nodes: int) -> list:
    """``parents`` as a list, each entry -1 (a root) or an earlier node's index."""
    par = list(parents)
    if len(par) != num_nodes:
        raise ValueError(f"parents has {len(par)} entries but there are {num_nodes} segments")
    for i, p in enumerate(par):
        if not isinstance(p, numbers.Integral) or isinstance(p, bool):
            raise TypeError(f"parents[{i}] = {p!r} is not an integer node index")
        if p < -1 or p >= num_nodes:
            raise ValueError(
                f"parents[{i}] = {p} is out of range; use -1 for a root or 0..{num_nodes - 1}"
            )
        if p == i:
            raise ValueError(f"parents[{i}] = {p}: node {i} is its own parent (a cycle)")
        if p > i:
            raise ValueError(
                f"parents[{i}] = {p}: parent comes after its child; list parents before "
                "children (this also rules out cycles)"
            )
    return par


def node_sequence_ends(sequence_ends, parents: np.ndarray) -> np.ndarray:
    """The node each sequence ends in: ``sequence_ends`` checked, or one sequence per leaf in
    node order when it is None."""
    num_nodes = len(parents)
    if sequence_ends is None:
        has_child = np.zeros(num_nodes, dtype=bool)
        has_child[parents[parents >= 0]] = True
        return np.flatnonzero(~has_child).astype(np.int64)
    ends_list = list(sequence_ends)
    if not ends_list:
        raise ValueError("sequence_ends is empty; a tree needs at least one sequence")
    for i, e in enumerate(ends_list):
        if not isinstance(e, numbers.Integral) or isinstance(e, bool):
            raise TypeError(f"sequence_ends[{i}] = {e!r} is not an integer node index")
        if not 0 <= e < num_nodes:
            raise ValueError(f"sequence_ends[{i}] = {e} is out of range 0..{num_nodes - 1}")
    return np.asarray(ends_list, dtype=np.int64)


def check_every_node_on_a_sequence(ends: np.ndarray, parents: np.ndarray) -> None:
    """Every node lies on the path of some sequence (is an end, or above one)."""
    on_path = np.zeros(len(parents), dtype=bool)
    for e in ends.tolist():
        while e >= 0 and not on_path[e]:
            on_path[e] = True
            e = int(parents[e])
    off = np.flatnonzero(~on_path)
    if off.size:
        raise ValueError(
            f"node {int(off[0])} lies on no sequence (no entry of sequence_ends is it or below "
            "it); remove it or add a sequence ending there"
        )


def check_siblings(parents: list, segments: list[np.ndarray]) -> None:
    """No two children of one parent (or two roots) start with the same token."""
    first_seen: dict[tuple[int, int], int] = {}
    for i, (p, seg) in enumerate(zip(parents, segments)):
        other = first_seen.setdefault((int(p), int(seg[0])), i)
        if other != i:
            # Such siblings share a prefix: the tree would compute it twice and count its
            # tokens twice. Tree.from_sequences builds the merged tree.
            raise ValueError(
                f"nodes {other} and {i} have the same parent ({p}) and both start with token "
                f"{int(seg[0])}; siblings must start with different tokens (use "
                "Tree.from_sequences to merge shared prefixes)"
            )
