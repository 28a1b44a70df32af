"""Deterministic synthetic agent trajectories, for tests, examples and benchmarks.

One task is a rollout of an agent: a system prompt and a user prompt, then turns. Each turn is
one model call, recorded as one sequence (its context plus what it generated):

- multi-turn: the next call's context is this call's context, its answer and the tool results,
  so calls share growing prefixes;
- think-mode: the reasoning of a call is dropped from the next call's context, so the next call
  branches off before it;
- parallel tool calls / sub-agents: a call may fork into several branches, each continuing with
  its own tool result and its own later turns;
- a group of rollouts (GRPO-style) shares the prompt.

Token ids are random; only the shape matters. The same seed gives the same trees everywhere.

:func:`agent_tree` lives in the core (:mod:`treefx.agent_trees`), which samples such trees
where it measures; this module adds datasets of them and odd-shaped trees for checks.
"""

from __future__ import annotations

import numpy as np

from ..agent_trees import agent_tree
from ..tree import Tree

__all__ = ["agent_tree", "dataset", "iter_dataset", "odd_forest", "odd_tree",
           "random_parent_row", "random_sequences"]


def dataset(n: int, seed: int = 0, **kwargs) -> list[Tree]:
    """A list of synthetic agent trees with consecutive seeds.

    ``n`` agent trees with seeds ``seed, seed + 1, ...`` (same keyword arguments as
    :func:`agent_tree`)."""
    return list(iter_dataset(n, seed, **kwargs))


def iter_dataset(n: int, seed: int = 0, **kwargs):
    """The trees of :func:`dataset`, made one at a time as they are iterated.

    For a large ``n``: ``treefx synth`` writes each tree as it is made, never holding them
    all."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    return (agent_tree(seed + i, **kwargs) for i in range(n))


# ------------------------------------------------------------------ odd trees for checks


def random_sequences(seed: int, vocab: int = 64, n: int = 7, max_len: int = 12) -> list[list[int]]:
    """Random token lists that share prefixes, for tests.

    ``n`` random token lists, most of them branching off an earlier one."""
    rng = np.random.default_rng(seed)
    seqs: list[list[int]] = []
    for _ in range(n):
        if seqs and rng.random() < 0.7:
            base = seqs[rng.integers(len(seqs))]
            cut = int(rng.integers(0, len(base) + 1))
            tail = rng.integers(0, vocab, size=int(rng.integers(0, max_len // 2 + 1))).tolist()
            s = base[:cut] + tail
        else:
            s = rng.integers(0, vocab, size=int(rng.integers(1, max_len + 1))).tolist()
        seqs.append(s or [int(rng.integers(vocab))])
    return seqs


def odd_tree(seed: int, vocab: int = 64, *, masks: bool = True) -> Tree:
    """A small random tree with every shape that breaks tree training, for tests.

    A small random tree with every shape that breaks tree training at once: a sequence that
    is a prefix of another, a duplicate, a single-token node, a one-token sequence, random
    weights and (``masks``) loss masks. For checks against the per-sequence oracle."""
    rng = np.random.default_rng(seed + 1000)
    seqs = random_sequences(seed, vocab)
    a = seqs[0] + [1, 2, 3]
    seqs += [
        a,
        a[:2],  # a prefix of another sequence (ends inside the tree)
        list(a),  # a duplicate
        a + [5],  # a single-token node
        a + [6],
        [int(rng.integers(vocab))],  # a one-token sequence: nothing to predict
    ]
    weights = rng.uniform(0.1, 1.0, size=len(seqs))
    loss_masks = [(rng.random(len(s)) < 0.8).astype(int).tolist() for s in seqs] if masks else None
    return Tree.from_sequences(seqs, weights=weights, loss_masks=loss_masks)


def odd_forest(seed: int, vocab: int = 64) -> list[Tree]:
    """Two odd trees, one with loss masks and one without."""
    return [odd_tree(seed, vocab), odd_tree(seed + 1, vocab, masks=False)]


def random_parent_row(seed: int, roots: int = 2, lengths=(1, 2, 30, 64, 65, 100),
                      depth: int = 3, children: int = 3) -> np.ndarray:
    """The predecessor row of a random forest, for kernels that read only the structure.

    ``parent_token`` in DFS order (-1 for a root) of ``roots`` trees: each node's length drawn
    from ``lengths``, up to ``children`` children a node down to ``depth`` (a node with one
    child continues it: a sequence that is a prefix of another)."""
    rng = np.random.default_rng(seed)
    par: list[int] = []

    def node(parent_tok: int, level: int) -> None:
        first = len(par)
        for t in range(int(rng.choice(lengths))):
            par.append(parent_tok if t == 0 else first + t - 1)
        last = len(par) - 1
        if level < depth:
            for _ in range(int(rng.integers(0, children + 1))):
                node(last, level + 1)

    for _ in range(roots):
        node(-1, 0)
    return np.asarray(par)
