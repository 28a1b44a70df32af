"""Split a tree that is over a token budget into subtrees that fit.

A subtree here is the tree of a subset of the sequences (:meth:`Tree.subtree`; not a part of
:func:`treefx.backward`, which is a slice of one packed row): whole sequences, each
with its own weight and loss mask, so the subtrees' losses add up exactly to the whole tree's loss
(``L = sum_t w_t l_t`` is a sum over sequences; nothing is renormalised) — provided each subtree is
packed with the whole's sequence count, ``pack(subtree, num_sequences=tree.num_sequences)`` (or the
count of the whole batch the tree is in): a batch's loss is the mean over its sequences, and a
subtree packed alone would average over its own, fewer ones. What a split costs is
the prefix tokens that more than one subtree must compute again, so the goal is the fewest total
tokens, ``sum over subtrees of subtree.num_tokens``, with every subtree within ``max_tokens``.

The unique tokens of a set of sequences are the tokens of the union of their root-to-end node
paths (the tree is a trie, so two paths share a token iff they share its whole prefix). All
planning is done on nodes, never on tokens, so it costs the same for long and short segments.
"""

from __future__ import annotations

import numbers
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from ._progress import Progress
from .tree import Tree

__all__ = ["EXACT_MAX_SEQUENCES", "METHODS", "err", "partition", "partition_ids"]

METHODS = ("greedy", "exact")

#: ``method="exact"`` refuses larger trees: its set-partition DP visits (3^P - 1) / 2 subsets.
EXACT_MAX_SEQUENCES = 16

ProgressArg = bool | Callable[[int, int], None]


def partition(
    tree: Tree, max_tokens: int, *, method: str = "greedy", progress: ProgressArg = False
) -> list[Tree]:
    """Split a tree into subtrees of whole sequences that each fit a token budget.

    The subtrees of ``tree`` (``tree.subtree`` of each group of :func:`partition_ids`), each with
    at most ``max_tokens`` unique tokens.

    Every sequence lands in exactly one subtree with its weight and loss mask unchanged, so the
    subtrees' losses sum to the tree's loss when every subtree is packed with the whole tree's
    sequence count, ``pack(subtree, num_sequences=tree.num_sequences)`` (the losses are means over
    sequences; a subtree packed without it averages over its own sequences only). ``method``: ``"greedy"`` (fast, for any size) or
    ``"exact"`` (fewest total tokens; at most :data:`EXACT_MAX_SEQUENCES` sequences).
    ``progress``: ``True`` draws a bar on stderr; a callable gets ``(done, total)`` after each
    step (planning, then building the subtrees).
    """
    report = _reporter(progress, 2 * _num_sequences(tree), "partitioning")
    groups = _plan(tree, max_tokens, method, report)
    subtrees = []
    for ids in groups:
        subtrees.append(tree.subtree(ids))
        report(len(ids))
    report(None)
    return subtrees


def partition_ids(
    tree: Tree, max_tokens: int, *, method: str = "greedy", progress: ProgressArg = False
) -> list[list[int]]:
    """Which sequences go into each subtree when a tree is split under a token budget.

    Sequence indices of each subtree (sequence ``i`` is ``tree.sequences[i]``), see
    :func:`partition`.

    Groups hold increasing indices and come ordered by their first index. A tree that fits
    whole comes back as one group.

    - ``"exact"``: the minimum of ``sum subtree.num_tokens`` over all partitions (then the fewest
      subtrees), by dynamic programming over subsets of sequences. Time grows about 3x per
      sequence: 4 ms at 12 sequences, 40 ms at 14, 0.2 s and 100 MB at 16 (the limit,
      :data:`EXACT_MAX_SEQUENCES`, for trees that do not fit whole); 17 and 18 would take 0.7 s
      and 1.6 s.
    - ``"greedy"``: places sequences one by one where they add the fewest new tokens, in
      depth-first order (next fit and best fit) and longest first (best fit), merges subtrees
      whose union fits, and keeps the best of the three. Sequences x path nodes x open subtrees;
      0.06-0.2 s for 2,000 sequences and 1M unique tokens. About 1% above the exact optimum on
      average on small random trees (up to ~20% on a few).

    (Times on one core of a 2-core CPU VM, numpy 2.4.)
    """
    report = _reporter(progress, _num_sequences(tree), "partitioning")
    groups = _plan(tree, max_tokens, method, report)
    report(None)
    return groups


def err(tree: Tree, subtrees: Sequence[Tree]) -> float:
    """Effective reuse ratio of a partition: ``1 - sum subtree.num_tokens / baseline tokens``.

    The tree's own POR is the best any split can reach; what a split loses against it is the
    prefix tokens computed again in several subtrees. ``subtrees`` must be a partition of the tree's
    sequences (every sequence in exactly one subtree, as :func:`partition` gives): a ``ValueError``
    names a sequence missing from the subtrees, or one the tree does not hold (as often); the ratio
    of any other list of trees means nothing.
    """
    _num_sequences(tree)
    subtrees = list(subtrees)
    _check_is_partition(tree, subtrees)
    return 1.0 - sum(p.num_tokens for p in subtrees) / tree.num_baseline_tokens


def _check_is_partition(tree: Tree, subtrees: list) -> None:
    """The subtrees' sequences are the tree's, as a multiset (duplicates count)."""
    if not subtrees:
        raise ValueError("subtrees is empty; a partition of a tree has at least one subtree")
    left: Counter = Counter(tuple(s) for s in tree.sequences)
    for k, subtree in enumerate(subtrees):
        if not isinstance(subtree, Tree):
            raise TypeError(f"subtrees[{k}] is a {type(subtree).__name__}, not a treefx.Tree")
        for i, s in enumerate(subtree.sequences):
            key = tuple(s)
            if left[key] == 0:
                more = "more often than the tree holds it" if key in left else "not in the tree"
                raise ValueError(
                    f"subtrees[{k}], its sequence {i} ({_short(s)}) is {more}: subtrees must be a "
                    "partition of the tree's sequences (every sequence in exactly one subtree; "
                    "treefx.partition gives one)"
                )
            left[key] -= 1
    # Some sequence is in no subtree: the first one in order that the subtrees do not account for.
    used = Counter(tuple(s) for s in tree.sequences)
    used.subtract(left)  # how many of each the subtrees hold
    for i, s in enumerate(tree.sequences):
        key = tuple(s)
        if used[key] == 0:
            raise ValueError(
                f"sequence {i} of the tree ({_short(s)}) is in no subtree: subtrees must be a "
                "partition of the tree's sequences (every sequence in exactly one subtree; "
                "treefx.partition gives one)"
            )
        used[key] -= 1


def _short(seq: list[int]) -> str:
    """A sequence for an error message: its length and first tokens."""
    head = ", ".join(map(str, seq[:6])) + (", ..." if len(seq) > 6 else "")
    return f"{len(seq)} tokens [{head}]"


# ---------------------------------------------------------------------------- checks


def _num_sequences(tree) -> int:
    if not isinstance(tree, Tree):
        raise TypeError(f"tree must be a treefx.Tree, got {type(tree).__name__}")
    return tree.num_sequences


def _plan(tree: Tree, max_tokens, method: str, report) -> list[list[int]]:
    """Check the arguments, then the groups of sequence indices; reports one step a sequence."""
    _check_budget(max_tokens)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    _check_lengths(tree, max_tokens)
    if tree.num_tokens <= max_tokens:
        groups = [list(range(tree.num_sequences))]
        report(tree.num_sequences)
    elif method == "exact":
        if tree.num_sequences > EXACT_MAX_SEQUENCES:
            raise ValueError(
                f'method="exact" handles at most {EXACT_MAX_SEQUENCES} sequences (its cost grows '
                f'as 3^P), this tree has {tree.num_sequences} and does not fit in one subtree; use '
                'method="greedy"'
            )
        groups = _exact(_sequence_paths(_trie(tree)), max_tokens)
        report(tree.num_sequences)
    else:
        groups = _greedy(_sequence_paths(_trie(tree)), max_tokens, report)
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def _check_budget(max_tokens) -> None:
    if not isinstance(max_tokens, numbers.Integral) or isinstance(max_tokens, bool):
        raise TypeError(
            f"max_tokens must be an integer number of tokens, got {max_tokens!r} "
            f"({type(max_tokens).__name__})"
        )
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")


def _check_lengths(tree: Tree, max_tokens: int) -> None:
    lengths = tree.sequence_lengths
    over = np.flatnonzero(lengths > max_tokens)
    if over.size:
        i = int(over[0])
        more = f" ({over.size - 1} more sequences are too)" if over.size > 1 else ""
        raise ValueError(
            f"sequence {i} has {int(lengths[i])} tokens, more than max_tokens={max_tokens}{more}; "
            "a subtree holds whole sequences, so each must fit on its own (splitting a long "
            "sequence across subtrees is not supported yet; a later version may lift this)"
        )


# ---------------------------------------------------------------------------- tree as paths


def _trie(tree: Tree) -> Tree:
    """``tree``, or its re-merged trie when two siblings start with the same token.

    ``Tree.from_nodes`` accepts such siblings, but a subtree re-merges them, so counting tokens
    by nodes would overestimate subtrees (still safe, but no longer exact).
    """
    first = np.fromiter((s[0] for s in tree.segments), dtype=np.int64, count=tree.num_nodes)
    keys = np.stack([tree.parents, first], axis=1)
    if len(np.unique(keys, axis=0)) == tree.num_nodes:
        return tree
    return Tree.from_sequences(tree.sequences)


def _sequence_paths(tree: Tree) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray, int]:
    """Per sequence: its node path (root first) and the tokens up to the end of each path node
    (a leading 0 added); the node lengths; the node count.

    The tokens a subtree shares with a sequence's path are a prefix of that path (subtrees are unions
    of root paths), so ``depth[k]`` with ``k`` = shared nodes is the shared token count.
    """
    lens = tree.segment_lengths
    end_depth = tree.node_depths + lens
    node_path: list[np.ndarray] = []
    for n, p in enumerate(tree.parents.tolist()):  # parents come first
        node_path.append(np.array([n]) if p < 0 else np.append(node_path[p], n))
    paths = [node_path[e] for e in tree.sequence_ends.tolist()]
    depths = [np.concatenate([[0], end_depth[path]]) for path in paths]
    return paths, depths, lens, tree.num_nodes


# ---------------------------------------------------------------------------- exact


def _exact(plan, max_tokens: int) -> list[list[int]]:
    """Set-partition DP: ``best[mask]`` = min over subtrees ``sub`` of ``mask`` holding its lowest
    sequence of ``cost[sub] + best[mask ^ sub]``, all masks of one popcount at once."""
    paths, _, lens, num_nodes = plan
    p = len(paths)
    full = (1 << p) - 1
    key = _subset_keys(paths, lens, num_nodes, max_tokens)
    best = np.zeros(full + 1, dtype=np.int64)
    choice = np.zeros(full + 1, dtype=np.int64)
    masks = np.arange(full + 1, dtype=np.int64)
    bits = (masks[:, None] >> np.arange(p)) & 1
    popcount = bits.sum(axis=1)
    for c in range(1, p + 1):
        layer = np.flatnonzero(popcount == c)
        pos = np.nonzero(bits[layer])[1].reshape(len(layer), c)
        # Chunks keep a layer's (masks x submasks) table near 2^21 entries.
        step = max(1, (1 << 21) >> (c - 1))
        for a in range(0, len(layer), step):
            ms, ps = layer[a : a + step], pos[a : a + step]
            subs = _submasks_with_lowest(ps)
            total = key[subs] + best[ms[:, None] ^ subs]
            j = np.argmin(total, axis=1)
            rows = np.arange(len(ms))
            best[ms] = total[rows, j]
            choice[ms] = subs[rows, j]
    groups, mask = [], full
    while mask:
        sub = int(choice[mask])
        groups.append([i for i in range(p) if sub >> i & 1])
        mask ^= sub
    return groups


def _subset_keys(paths, lens, num_nodes: int, max_tokens: int) -> np.ndarray:
    """Per subset of sequences: ``tokens * (P + 1) + 1`` (ranks by tokens, then subtrees), or a
    huge value when over budget.

    A node is in a subset's union iff the subset meets the sequences through it; nodes with the
    same such set are summed first, so the loop runs over at most ~2P groups.
    """
    p = len(paths)
    through = np.zeros(num_nodes, dtype=np.int64)
    for s, path in enumerate(paths):
        through[path] |= 1 << s
    groups, inverse = np.unique(through, return_inverse=True)
    group_len = np.bincount(inverse.ravel(), weights=lens, minlength=len(groups)).astype(np.int64)
    masks = np.arange(1 << p, dtype=np.int64)
    tokens = np.zeros(1 << p, dtype=np.int64)
    for g, n in zip(groups.tolist(), group_len.tolist()):
        tokens += n * ((masks & g) != 0)
    # Finite sums stay far from overflow: at most P + 1 terms of this size each.
    too_big = np.iinfo(np.int64).max // (4 * (p + 1))
    return np.where(tokens <= max_tokens, tokens * (p + 1) + 1, too_big)


def _submasks_with_lowest(pos: np.ndarray) -> np.ndarray:
    """Row r: every submask of the mask with set bits ``pos[r]`` (sorted) that holds its lowest
    bit; shape (rows, 2^(c-1))."""
    subs = (np.int64(1) << pos[:, :1]).astype(np.int64)
    for j in range(1, pos.shape[1]):
        subs = np.concatenate([subs, subs | (np.int64(1) << pos[:, j : j + 1])], axis=1)
    return subs


# ---------------------------------------------------------------------------- greedy


def _greedy(plan, max_tokens: int, report) -> list[list[int]]:
    """Best of a few greedy packings, each tidied by merging subtrees whose union fits.

    Depth-first order keeps siblings and deep shared prefixes next to each other (next fit is
    the plain "cut the DFS order where the budget runs out"); longest first places the big
    sequences while subtrees are still empty (as first-fit decreasing does in bin packing). Best fit
    lets a sequence join an earlier subtree it shares a long prefix with.
    """
    paths, depths, lens, num_nodes = plan
    p = len(paths)
    seq_len = np.array([d[-1] for d in depths], dtype=np.int64)
    dfs = np.lexsort((np.arange(p), _dfs_rank(paths, num_nodes)))
    longest = dfs[np.argsort(-seq_len[dfs], kind="stable")]
    best = None
    for order, fit in ((dfs, "next"), (dfs, "best"), (longest, "best")):
        member, cost, groups = _pack(order, fit, plan, max_tokens, report)
        _merge(member, cost, groups, lens, max_tokens)
        if best is None or (sum(cost), len(groups)) < best[0]:
            best = ((sum(cost), len(groups)), groups)
    return best[1]


def _dfs_rank(paths, num_nodes: int) -> np.ndarray:
    """Preorder rank of each sequence's end node.

    Nodes are not always numbered in preorder (``Tree.from_nodes``); comparing paths as tuples
    of node ids orders them depth-first with children in node order.
    """
    ends = sorted(range(len(paths)), key=lambda s: paths[s].tolist())
    rank = np.empty(len(paths), dtype=np.int64)
    rank[ends] = np.arange(len(paths))
    return rank


def _pack(order, fit: str, plan, max_tokens: int, report):
    """Place sequences in ``order``: into the last subtree only (``fit="next"``) or into the subtree
    where they add the fewest new tokens, the fullest on ties (``"best"``); open a new subtree when
    none has room.

    Returns the subtree x node membership table, the token count and sequence list of each subtree.
    """
    paths, depths, _, num_nodes = plan
    member = np.zeros((8, num_nodes), dtype=bool)
    cost = np.zeros(8, dtype=np.int64)
    groups: list[list[int]] = []
    for s in order.tolist():
        path, depth = paths[s], depths[s]
        lo = max(len(groups) - 1, 0) if fit == "next" else 0
        added = depth[-1] - depth[member[lo : len(groups), path].sum(axis=1)]
        after = cost[lo : len(groups)] + added
        room = np.flatnonzero(after <= max_tokens)
        if room.size:
            # Fewest new tokens first, then the fullest subtree.
            q = lo + int(room[np.lexsort((-after[room], added[room]))[0]])
            cost[q] = after[q - lo]
            groups[q].append(s)
        else:
            q = len(groups)
            if q == len(member):
                member = np.concatenate([member, np.zeros_like(member)])
                cost = np.concatenate([cost, np.zeros_like(cost)])
            cost[q] = depth[-1]
            groups.append([s])
        member[q, path] = True
        report(1 / 3)
    return member[: len(groups)], cost[: len(groups)].tolist(), groups


def _merge(member, cost: list[int], groups: list[list[int]], lens, max_tokens: int) -> None:
    """Merge, while any pair of subtrees fits together, the pair sharing the most tokens.

    Updates ``cost`` and ``groups`` in place (merged subtrees are dropped).
    """
    # Only nodes in two or more subtrees are shared; in agent trees that is a few prompts and
    # branch points, so the subtree x subtree product stays small. Float64 sums of token counts are
    # exact far beyond any budget.
    multi = member.sum(axis=0) > 1
    member, lens = member[:, multi], lens[multi].astype(np.float64)
    weighted = member * lens
    costs = np.asarray(cost, dtype=np.float64)
    alive = np.ones(len(cost), dtype=bool)
    # gain[a, b]: tokens saved by merging a and b, 0 where they do not fit together (or share
    # nothing, or one is merged away), so every merge taken saves tokens.
    shared = weighted @ member.T.astype(np.float64)
    gain = np.where(costs[:, None] + costs[None, :] - shared <= max_tokens, shared, 0.0)
    np.fill_diagonal(gain, 0.0)
    # A merge changes one row and column of the table; the rest stays valid.
    while True:
        a, b = np.unravel_index(np.argmax(gain), gain.shape)
        if gain[a, b] <= 0:
            break
        costs[a] += costs[b] - gain[a, b]
        member[a] |= member[b]
        weighted[a] = member[a] * lens
        groups[a].extend(groups[b])
        alive[b] = False
        shared_a = weighted @ member[a].astype(np.float64)
        row = np.where((costs + costs[a] - shared_a <= max_tokens) & alive, shared_a, 0.0)
        row[a] = 0.0
        gain[a], gain[:, a] = row, row
        gain[b], gain[:, b] = 0.0, 0.0
    keep = np.flatnonzero(alive).tolist()
    groups[:] = [groups[i] for i in keep]
    cost[:] = [int(costs[i]) for i in keep]


# ---------------------------------------------------------------------------- progress


def _reporter(progress: ProgressArg, total: int, desc: str):
    """``report(k)`` advances by ``k`` sequences, ``report(None)`` ends; a no-op when off."""
    if callable(progress):
        done = [0.0]

        def call(k):
            if k is not None:
                done[0] += k
                progress(min(round(done[0]), total), total)

        return call
    if not progress:
        return lambda k: None
    bar = Progress(total, desc, enabled=True)

    def draw(k):
        if k is None:
            bar.__exit__(None, None, None)
        else:
            bar.update(k)

    return draw
