"""Trees assigned to ranks so that the ranks' step times are close (:func:`assign`): largest
cost first onto the least-loaded rank, trees cut into pieces of whole sequences where that
lowers the slowest rank."""

from __future__ import annotations

import heapq
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

from ..tree import Tree
from .cost import DEFAULT_COST, CostModel
from .sizes import tree_list

__all__ = ["assign"]


_ORDERS = ("input", "largest_first")


def assign(trees, world_size: int, *, cost: CostModel | Callable[[Tree], float] | None = None,
           split: bool = False, order: str = "input") -> list[list[Tree]]:
    """Split trees over ranks so that the ranks' step times are close.

    Split ``trees`` over ``world_size`` ranks so that their step times are close: LPT
    (longest processing time first) — trees by decreasing cost, each onto the rank with the
    least cost so far (ties: the rank with fewer trees, then the lower rank; equal costs keep
    input order), so the slowest rank is within 4/3 of the best possible split. Returns one
    list per rank, each in input order; every tree lands on exactly one rank and every rank
    gets at least one (a rank without trees would still have to join every collective of the
    step, so fewer trees than ranks is an error). Deterministic: every rank can call it on the
    same list and take its own part.

    ``cost``: a :class:`CostModel` (default :data:`DEFAULT_COST`, FLOP ratios of a Qwen3-8B
    shape), or any callable ``cost(tree) -> float`` (finite, non-negative).

    ``split=True``: a tree may also be cut across ranks, into sub-trees of whole sequences
    (:meth:`Tree.subtree`, planned by :func:`treefx.partition.partition_ids`), when that
    lowers the slowest rank's cost. Each sequence still lands on exactly one rank with its
    weight, loss mask and per-sequence metadata, so :func:`pack`'s global normalization keeps
    the loss and gradients exact; what a cut costs is the prefix its pieces share, which every
    rank holding a piece computes, and the cost model counts it (each piece is costed as the
    tree it is). So wide trees (many rollouts or trials off a short prompt) are cut when one
    of them would hold up a step, and comb-shaped agent trees (each call extending the last)
    hardly ever are: every piece of a comb repeats most of its trunk. Repeated until no cut
    of a tree on the slowest rank helps; the returned lists then hold the pieces (new trees)
    in place of a tree that was cut, in input order. Fewer trees than ranks is accepted when
    the cuts give every rank something.

    ``order``: ``"input"`` (default) keeps each rank's trees in input order;
    ``"largest_first"`` puts them in decreasing order of cost (ties: input order). Under FSDP2
    :func:`treefx.backward` runs the ranks' parts in common rounds, each as long as its
    slowest part, so ranks whose parts come in the same order of size wait less (measured on
    real agent trees in docs/distributed.md, "Rounds"). Pack the trees (and give
    per-sequence values such as advantages) in the order returned.
    """
    if order not in _ORDERS:
        raise ValueError(f"order must be one of {_ORDERS}, got {order!r}")
    if not isinstance(world_size, numbers.Integral) or isinstance(world_size, bool):
        raise TypeError(f"world_size must be a positive integer, got {world_size!r} "
                        f"({type(world_size).__name__})")
    if world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size}")
    world_size = int(world_size)
    trees = tree_list(trees, "trees")
    if cost is None:
        cost = DEFAULT_COST
    if not callable(cost):
        raise TypeError(f"cost must be a treefx.distributed.CostModel or a callable "
                        f"cost(tree) -> float, got {type(cost).__name__}")

    def costed(i: int, key: tuple, tree: Tree) -> _Unit:
        c = cost(tree)
        if not isinstance(c, numbers.Real) or isinstance(c, bool) or not math.isfinite(c) \
                or c < 0:
            raise ValueError(f"cost of trees[{i}] is {c!r}; a cost must be a finite "
                             "non-negative number")
        return _Unit(key, tree, float(c))

    units = [costed(i, (i,), t) for i, t in enumerate(trees)]
    ranks = _lpt(units, world_size)
    if split:
        ranks = _cut_until_balanced(units, ranks, world_size, costed)
    if any(not r for r in ranks):
        raise ValueError(
            f"{len(trees)} trees cannot be assigned to {world_size} ranks: every rank needs at "
            "least one tree (a rank with nothing to do still joins every collective of the "
            "step). Give more trees per step, "
            + ("" if split else "let assign cut trees (split=True), ")
            + "split large trees with treefx.partition, or use fewer ranks"
        )
    if order == "largest_first":
        return [[u.tree for u in sorted(r, key=lambda u: (-u.cost, u.key))] for r in ranks]
    return [[u.tree for u in sorted(r, key=lambda u: u.key)] for r in ranks]


@dataclass(frozen=True)
class _Unit:
    """What :func:`assign` places: a tree or a piece of one. ``key``: the tree's index, then
    (for a piece) the first sequence index of each cut it came from, for the output order."""

    key: tuple
    tree: Tree
    cost: float


def _lpt(units: list[_Unit], world_size: int) -> list[list[_Unit]]:
    """Largest cost first onto the least-loaded rank (ties: fewer units, then lower rank)."""
    order = sorted(units, key=lambda u: (-u.cost, u.key))
    # (load, units so far, rank): a rank without trees (load 0) always comes first.
    heap = [(0.0, 0, r) for r in range(world_size)]
    ranks: list[list[_Unit]] = [[] for _ in range(world_size)]
    for u in order:
        load, count, r = heapq.heappop(heap)
        ranks[r].append(u)
        heapq.heappush(heap, (load + u.cost, count + 1, r))
    return ranks


def _loads(ranks: list[list[_Unit]]) -> list[float]:
    """The ranks' costs, largest first."""
    return sorted((sum(u.cost for u in r) for r in ranks), reverse=True)


def _lower(a: list[float], b: list[float]) -> bool:
    """Whether loads ``a`` beat ``b``: the slowest rank faster, or as fast with fewer ranks
    that slow (the next cut may then lower it), compared largest first (relative 1e-9)."""
    for x, y in zip(a, b):
        if abs(x - y) > 1e-9 * max(abs(x), abs(y)):
            return x < y
    return False


def _cut_until_balanced(units, ranks, world_size: int, costed) -> list[list[_Unit]]:
    """Cut units of the slowest rank into pieces of whole sequences while that lowers the
    ranks' loads (:func:`_lower`); each unit is tried once, into 2..world_size pieces. Kept
    only if the slowest rank ends up faster than with whole trees."""
    from ..partition import partition_ids

    start, tried = ranks, set()
    while True:
        slowest = max(ranks, key=lambda r: sum(u.cost for u in r))
        best = None
        for u in sorted(slowest, key=lambda u: (-u.cost, u.key)):
            if u.key in tried or u.tree.num_sequences < 2:
                continue
            tried.add(u.key)
            n, longest = u.tree.num_tokens, int(u.tree.sequence_lengths.max())
            seen = set()
            for k in range(2, world_size + 1):
                groups = partition_ids(u.tree, max(-(-n // k), longest))
                if len(groups) < 2 or str(groups) in seen:
                    continue
                seen.add(str(groups))
                pieces = [costed(u.key[0], u.key + (g[0],), u.tree.subtree(g)) for g in groups]
                rest = [v for v in units if v is not u]
                trial = _lpt(rest + pieces, world_size)
                if _lower(_loads(trial), best[0] if best else _loads(ranks)):
                    best = (_loads(trial), rest + pieces, trial)
            if best:
                break
        if best is None:
            return ranks if _loads(ranks)[0] < _loads(start)[0] * (1 - 1e-9) else start
        _, units, ranks = best
