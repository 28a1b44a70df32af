"""What the balancing reads of a tree: its attended pairs; a tree or a list of them, checked."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..tree import Tree

__all__ = ["attended_pairs", "tree_list"]


def attended_pairs(tree: Tree) -> int:
    """The number of (query, key) pairs tree attention computes for a tree.

    The (query, key) pairs tree attention computes for ``tree``: Σ over its unique tokens of
    (the token's position in its own sequence + 1), since a query sees every token of its path
    up to itself (what ``batch.dense_mask()`` allows; padding excluded). A node of length ℓ
    whose first token is at position d adds ℓ·d + ℓ(ℓ+1)/2."""
    if not isinstance(tree, Tree):
        raise TypeError(f"expected a treefx.Tree, got {type(tree).__name__}")
    lens = tree.segment_lengths.astype(np.int64)
    depth = np.asarray(tree.node_depths, dtype=np.int64)
    return int((lens * depth).sum() + (lens * (lens + 1) // 2).sum())


def tree_list(trees, what: str) -> list[Tree]:
    if isinstance(trees, Tree):
        return [trees]
    if not isinstance(trees, Iterable) or isinstance(trees, (str, bytes)):
        raise TypeError(f"{what} must be a treefx.Tree or a list of them, got "
                        f"{type(trees).__name__}")
    out = list(trees)
    for i, t in enumerate(out):
        if not isinstance(t, Tree):
            raise TypeError(f"{what}[{i}] is a {type(t).__name__}, not a treefx.Tree")
    return out
