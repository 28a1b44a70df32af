"""The planner (``treefx.parts.plan`` / ``plan_even``) made faster gives exactly the plans it
gave before: every part's range, context, entries, exits, labels, release and flags, and the
plan's budget and ``part_of_token``, against a frozen copy of the old planner
(``tests/parts_frozen.py``), on many trees and budgets: comb-shaped agent trees (a trunk with
every completion a leaf off it, as real SWE trajectories make), bushy random trees, forests,
single-token nodes, padded rows; ``plan_even`` for several part counts, with and without
recompute parts."""

from __future__ import annotations

import numpy as np
import parts_frozen as frozen
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import sequence_sets

import treefx
from treefx import parts
from treefx.tools.synth import odd_forest, odd_tree, random_sequences

FIELDS = ("index", "start", "end", "context", "context_pad", "entries", "entry_of_token",
          "exits", "label_rows", "label_tokens", "release", "open", "recompute")


def assert_same_plan(got, want):
    """Field by field, arrays with their dtypes (what a later step reads of a plan)."""
    assert got.max_tokens == want.max_tokens
    assert got.batch is want.batch
    assert np.array_equal(got.part_of_token, want.part_of_token)
    assert got.part_of_token.dtype == want.part_of_token.dtype
    assert got.num_parts == want.num_parts
    for a, b in zip(got.parts, want.parts):
        for name in FIELDS:
            x, y = getattr(a, name), getattr(b, name)
            if isinstance(y, np.ndarray):
                assert isinstance(x, np.ndarray) and x.dtype == y.dtype, (b.index, name)
                assert np.array_equal(x, y), (b.index, name)
            else:
                assert type(x) is type(y) and x == y, (b.index, name, x, y)


def comb(seed: int, calls: int, trunk=(2, 40), leaf=(1, 60), vocab: int = 512):
    """An agent's calls as one tree: a trunk (the conversation) that grows call by call, each
    call's completion a leaf off it; some trunk and leaf nodes of one token, and a call that
    is a prefix of the next ones."""
    rng = np.random.default_rng(seed)
    convo, seqs = [], []
    for i in range(calls):
        step = 1 if i % 5 == 3 else int(rng.integers(*trunk))
        convo = convo + rng.integers(1, vocab, step).tolist()
        tail = 1 if i % 4 == 2 else int(rng.integers(*leaf))
        seqs.append(convo + rng.integers(1, vocab, tail).tolist())
        if i == calls // 2:
            seqs.append(list(convo))
    return treefx.Tree.from_sequences(seqs)


def bushy(seed: int, n: int = 40, max_len: int = 60):
    """Random sequences branching off each other anywhere: many short nodes, deep and wide."""
    return treefx.Tree.from_sequences(random_sequences(seed, vocab=8, n=n, max_len=max_len))


def agent(seed: int):
    return treefx.synth.agent_tree(seed, vocab_size=512, rollouts=2, system_len=(20, 60),
                                   prompt_len=(5, 30), think_len=(5, 40), answer_len=(2, 12),
                                   tool_len=(5, 40))


def batches():
    """(name, batch) of every shape, from a few tokens to a few thousand."""
    out = [("odd_forest", treefx.pack(odd_forest(0, 64))),
           ("odd_tree", treefx.pack([odd_tree(3, 64)])),
           ("padded", treefx.pack(odd_forest(1, 64) + [comb(1, 6, (1, 4), (1, 4))],
                                  pad_to_multiple=16)),
           ("one_token_nodes", treefx.pack([comb(2, 30, (1, 2), (1, 2))])),
           ("single_token", treefx.pack([treefx.Tree.from_sequences([[3]])])),
           ("chain", treefx.Tree.from_sequences([list(range(1, 300))])),
           ("forest_of_chains", treefx.pack([treefx.Tree.from_sequences([[1] * k])
                                             for k in (1, 2, 7, 30, 3)]))]
    out = [(n, b if isinstance(b, treefx.TreeBatch) else treefx.pack(b)) for n, b in out]
    for seed in range(4):
        out.append((f"comb{seed}", treefx.pack([comb(seed, 10 + 12 * seed)])))
        out.append((f"bushy{seed}", treefx.pack([bushy(seed)])))
        out.append((f"forest{seed}", treefx.pack([comb(seed + 10, 8), bushy(seed + 10, 15),
                                                  agent(seed), *odd_forest(seed, 64)])))
    out.append(("agent_pair", treefx.pack([agent(7), agent(8)])))
    return out


BATCHES = batches()
# The larger random combs, bushes and forests (seeds 2-3) in the slow run; seeds 0-1 of each
# shape and every odd shape in CI.
PARAMS = [pytest.param(n, b, id=n, marks=pytest.mark.slow if n[-1] in "23" and
                       n[:-1] in ("comb", "bushy", "forest") else ())
          for n, b in BATCHES]


def budgets(batch, rng, count: int):
    """Small budgets (parts of one or two tokens), random ones, and about the row's size."""
    n = batch.num_tokens
    fixed = {1, 2, 3, 5, 8, max(1, n // 2), n + 1}
    return sorted(fixed | {int(x) for x in rng.integers(1, n + 2, size=count)})


@pytest.mark.parametrize("name,batch", PARAMS)
def test_plan_equals_the_frozen_planner(name, batch):
    rng = np.random.default_rng(len(name))
    for i, budget in enumerate(budgets(batch, rng, 4)):
        block = (1, 8, 128)[i % 3]
        for recompute in (True, False):
            assert_same_plan(
                parts.plan(batch, budget, block_size=block, recompute=recompute, min_part=0),
                frozen.plan(batch, budget, block_size=block, recompute=recompute))


@pytest.mark.parametrize("name,batch", PARAMS)
def test_plan_even_equals_the_frozen_planner(name, batch):
    """Counts below, at and above the plan's at the budget (below: the plan itself)."""
    rng = np.random.default_rng(len(name) + 100)
    n = batch.num_tokens
    for i, budget in enumerate(sorted({3, max(1, n // 3), int(rng.integers(1, n + 2))})):
        recompute = bool(i % 2)
        first = frozen.plan(batch, budget, recompute=recompute).num_parts
        for k in sorted({max(1, first - 1), first + 1, 2 * first + 1}):
            assert_same_plan(parts.plan_even(batch, budget, k, recompute=recompute, min_part=0),
                             frozen.plan_even(batch, budget, k, recompute=recompute))


def test_large_comb_trees_equal_the_frozen_planner():
    """Comb trees of the size of real agent trees' calls (tens of thousands of tokens), at
    budgets from a fraction of the longest call to the whole row, and plan_even at the
    counts FSDP2's rounds ask for."""
    rng = np.random.default_rng(0)
    batch = treefx.pack([comb(40, 60, (20, 400), (50, 600)), comb(41, 25, (20, 400), (50, 600))])
    n = batch.num_tokens
    for budget in (997, 4096, 8192, n // 3, int(rng.integers(2000, n))):
        for recompute in (True, False):
            assert_same_plan(parts.plan(batch, budget, recompute=recompute, min_part=0),
                             frozen.plan(batch, budget, recompute=recompute))
    for budget, k in ((8192, 4), (8192, 7), (n // 3, 5), (4096, 12)):
        assert_same_plan(parts.plan_even(batch, budget, k, recompute=False, min_part=0),
                         frozen.plan_even(batch, budget, k, recompute=False))


@settings(max_examples=150, deadline=None)
@given(st.lists(sequence_sets(max_seqs=12, max_len=14, alphabet=3), min_size=1, max_size=3),
       st.integers(1, 60), st.integers(1, 8), st.booleans(), st.booleans())
def test_random_forests_equal_the_frozen_planner(forest, budget, num_parts, recompute, pad):
    trees = [treefx.Tree.from_sequences(s) for s in forest]
    batch = treefx.pack(trees, pad_to_multiple=8 if pad else None)
    assert_same_plan(parts.plan(batch, budget, block_size=4, recompute=recompute, min_part=0),
                     frozen.plan(batch, budget, block_size=4, recompute=recompute))
    assert_same_plan(parts.plan_even(batch, budget, num_parts, recompute=recompute, min_part=0),
                     frozen.plan_even(batch, budget, num_parts, recompute=recompute))
