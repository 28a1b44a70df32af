"""Partitioning a tree under a token budget: every part fits, every sequence lands in exactly one
part with its weight and mask, and the parts' losses add up to the whole tree's loss."""

from __future__ import annotations

import math
import re
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treefx.layout import pack
from treefx.partition import EXACT_MAX_SEQUENCES, err, partition, partition_ids
from treefx.tree import Tree

# ---------------------------------------------------------------------------- random trees


@st.composite
def token_lists(draw, max_sequences: int = 8, max_len: int = 10):
    """Token lists that share prefixes: a new list is fresh or extends a prefix of an earlier one
    (an empty extension of a whole one is a duplicate, of a part of one a prefix of it). A tiny
    vocabulary makes accidental sharing and forests of several roots common."""
    vocab = draw(st.integers(1, 4))
    tok = st.integers(0, vocab - 1)
    seqs: list[list[int]] = []
    for _ in range(draw(st.integers(1, max_sequences))):
        if seqs and draw(st.booleans()):
            base = draw(st.sampled_from(seqs))
            k = draw(st.integers(0, len(base)))
            tail = draw(st.lists(tok, min_size=0 if k else 1, max_size=max_len))
            seqs.append(base[:k] + tail)
        else:
            seqs.append(draw(st.lists(tok, min_size=1, max_size=max_len)))
    return seqs


@st.composite
def trees_and_budgets(draw, max_sequences: int = 10):
    """A tree with default or custom weights and loss masks, and a budget from its longest
    sequence (the least allowed) to a little over its whole size."""
    seqs = draw(token_lists(max_sequences))
    weight = st.floats(0.0, 3.0, allow_nan=False, allow_infinity=False)
    weights = draw(st.none() | st.lists(weight, min_size=len(seqs), max_size=len(seqs)))
    masks = draw(
        st.none()
        | st.tuples(*[st.lists(st.integers(0, 1), min_size=len(s), max_size=len(s)) for s in seqs])
    )
    tree = Tree.from_sequences(seqs, weights=weights, loss_masks=masks)
    budget = draw(st.integers(int(tree.sequence_lengths.max()), tree.num_tokens + 2))
    return tree, budget


def random_token_lists(rng: np.random.Generator, n: int, vocab: int, max_len: int = 30):
    """numpy twin of :func:`token_lists`, for loops over many trees."""
    seqs: list[list[int]] = []
    for _ in range(n):
        if seqs and rng.random() < 0.75:
            base = seqs[rng.integers(len(seqs))]
            k = int(rng.integers(0, len(base) + 1))
            tail = rng.integers(0, vocab, size=int(rng.integers(0 if k else 1, max_len)))
            seqs.append(base[:k] + tail.tolist())
        else:
            seqs.append(rng.integers(0, vocab, size=int(rng.integers(1, max_len))).tolist())
    return seqs


def agent_forest(rng: np.random.Generator, num_sequences: int, num_tokens: int) -> Tree:
    """A forest shaped like agent rollouts, about ``num_tokens`` unique tokens: tasks with a
    prompt, a few rollouts each, one model call (sequence) per turn ending in its own output
    node; the next turn continues from the output (or, in think mode, branches off before it),
    and a call sometimes forks into parallel branches. Built with ``Tree.from_nodes`` so that
    making it costs nothing next to what it tests."""
    lens: list[int] = []
    parents: list[int] = []
    ends: list[int] = []

    def node(length, parent):
        lens.append(int(length))
        parents.append(parent)
        return len(lens) - 1

    while len(ends) < num_sequences:
        prompt = node(rng.integers(300, 3000), -1)
        for _ in range(int(rng.integers(1, 9))):
            think = rng.random() < 0.5
            work = [(prompt, int(rng.integers(2, 10)))]
            while work:
                context, turns = work.pop()
                out = node(rng.integers(20, 600), context)
                ends.append(out)
                if turns > 1:
                    for _ in range(int(rng.integers(2, 4)) if rng.random() < 0.15 else 1):
                        work.append((node(rng.integers(20, 800), context if think else out),
                                     turns - 1))
    sizes = np.maximum(1, np.round(np.array(lens) * num_tokens / sum(lens))).astype(np.int64)
    tokens = rng.integers(1, 50_000, size=int(sizes.sum()))
    segments = np.split(tokens, np.cumsum(sizes)[:-1])
    for i, s in enumerate(segments):
        s[0] = 50_000 + i  # siblings never start alike, so the nodes are the trie's
    return Tree.from_nodes(segments, parents, sequence_ends=ends)


# ---------------------------------------------------------------------------- loss oracle


def token_losses(tree: Tree, batch, ell) -> np.ndarray:
    """Per DFS token of ``batch``, ``ell`` of its prefix: one value per context, whatever the
    part it is computed in."""
    values = np.zeros(batch.num_tokens)
    for i, seq in enumerate(tree.sequences):
        idx = batch.sequence_index(i).numpy()
        values[idx] = [ell[tuple(seq[: j + 1])] for j in range(len(seq))]
    return values


def tree_loss(tree: Tree, reduction: str, ell, num_sequences: int | None = None) -> float:
    """``sum_t w_t l_t`` over the packed tree (normalized by ``num_sequences``, see pack)."""
    batch = pack(tree, reduction=reduction, weight_dtype=torch.float64,
                 num_sequences=num_sequences)
    return float(batch.loss_weights.numpy() @ token_losses(tree, batch, ell))


def per_sequence_loss(tree: Tree, reduction: str, ell) -> float:
    """The per-branch baseline, ``(1/P) sum_p w_p r_p sum_{j>=1} m_p(j) l(s_p[:j+1])``."""
    total = 0.0
    for i, seq in enumerate(tree.sequences):
        m = tree.loss_mask(i).copy()
        m[0] = 0.0
        r = 1.0 if reduction == "sum" else (1.0 / m.sum() if m.sum() else 0.0)
        total += tree.weights[i] * r * sum(m[j] * ell[tuple(seq[: j + 1])] for j in range(len(seq)))
    return total / tree.num_sequences


def records(tree: Tree) -> list:
    """The multiset of (sequence, weight, mask) of a tree, as a sorted list."""
    return sorted(
        (tuple(s), float(w), tuple(tree.loss_mask(i).tolist()))
        for i, (s, w) in enumerate(zip(tree.sequences, tree.weights))
    )


def check_partition(tree: Tree, budget: int, method: str, ell) -> int:
    """Assert every property of a partition; return its total tokens."""
    ids = partition_ids(tree, budget, method=method)
    parts = partition(tree, budget, method=method)
    assert sorted(i for g in ids for i in g) == list(range(tree.num_sequences))
    assert len(parts) == len(ids)
    seqs = tree.sequences
    for part, g in zip(parts, ids):
        assert part.num_tokens <= budget
        assert part.sequences == [seqs[i] for i in g]
    assert sorted(r for p in parts for r in records(p)) == records(tree)
    for reduction in ("sum", "mean"):
        whole = tree_loss(tree, reduction, ell)
        assert math.isclose(whole, per_sequence_loss(tree, reduction, ell), rel_tol=1e-12,
                            abs_tol=1e-12)
        # Each part normalized by the whole tree's sequence count (see partition's docstring).
        split = sum(tree_loss(p, reduction, ell, num_sequences=tree.num_sequences) for p in parts)
        assert math.isclose(split, whole, rel_tol=1e-12, abs_tol=1e-12)
    total = sum(p.num_tokens for p in parts)
    trie = Tree.from_sequences(tree.sequences)
    assert total >= trie.num_tokens
    assert err(tree, parts) == pytest.approx(1 - total / tree.num_baseline_tokens)
    assert err(tree, parts) <= trie.por + 1e-12
    return total


# ---------------------------------------------------------------------------- properties


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees_and_budgets(), st.randoms(use_true_random=False))
def test_parts_fit_cover_and_keep_the_loss(case, random):
    tree, budget = case
    ell = defaultdict(random.random)
    exact = check_partition(tree, budget, "exact", ell)
    greedy = check_partition(tree, budget, "greedy", ell)
    assert greedy >= exact


def test_nodes_out_of_preorder():
    # Tree.from_nodes takes any parents-first numbering; the plan must count tokens as the
    # parts (re-merged tries) will.
    tree = Tree.from_nodes(
        [[1, 2], [7], [3, 4], [8, 9], [5], [9, 2, 6]],
        [-1, -1, 0, 1, 0, -1],
        sequence_ends=[2, 3, 4, 5, 1],
        weights=[0.1, 0.2, 0.3, 0.4, 0.5],
        loss_masks=[[1, 0, 1, 1], [0, 1, 1], [1, 1, 0], [1, 1, 1], [1]],
    )
    ell = defaultdict(np.random.default_rng(0).random)
    for budget in range(4, 12):
        assert check_partition(tree, budget, "greedy", ell) >= check_partition(
            tree, budget, "exact", ell
        )


def test_tree_that_fits_is_one_part():
    tree = Tree.from_sequences([[1, 2, 3], [1, 2, 4], [5]], weights=[0.5, 0.25, 0.25])
    for method in ("greedy", "exact"):
        parts = partition(tree, tree.num_tokens, method=method)
        assert parts == [tree]
        assert err(tree, parts) == pytest.approx(tree.por)


def test_greedy_close_to_exact_on_small_trees():
    rng = np.random.default_rng(2026)
    gaps = []
    for _ in range(200):
        n = int(rng.integers(2, 11))
        tree = Tree.from_sequences(random_token_lists(rng, n, vocab=int(rng.integers(2, 40))))
        longest = int(tree.sequence_lengths.max())
        budget = int(rng.integers(longest, max(longest, tree.num_tokens - 1) + 1))
        exact = sum(tree.subtree(g).num_tokens for g in partition_ids(tree, budget, method="exact"))
        greedy = sum(tree.subtree(g).num_tokens for g in partition_ids(tree, budget))
        assert greedy >= exact  # exact is the optimum
        gaps.append(greedy / exact - 1)
    assert np.mean(gaps) <= 0.05


def test_paper_example():
    # 4 sequences, 83k unique and 164k baseline tokens, budget 60k -> 102k tokens in 2 parts.
    # Shape: a 19k prompt, two 12k branches, two 10k leaves under each. Unique 19+24+40 = 83k,
    # baseline 4 x 41k = 164k; the cheapest split keeps each branch whole and repeats only the
    # prompt: 83k + 19k = 102k, each part 51k.
    rng = np.random.default_rng(0)

    def seg(n, first):
        return [first] + rng.integers(10, 30_000, size=n - 1).tolist()

    prompt, left, right = seg(19_000, 1), seg(12_000, 2), seg(12_000, 3)
    leaves = [seg(10_000, 4 + i) for i in range(4)]
    tree = Tree.from_sequences([prompt + (left if i < 2 else right) + leaves[i] for i in range(4)])
    assert (tree.num_tokens, tree.num_baseline_tokens) == (83_000, 164_000)
    for method in ("exact", "greedy"):
        parts = partition(tree, 60_000, method=method)
        assert len(parts) == 2
        assert sum(p.num_tokens for p in parts) == 102_000
        assert err(tree, parts) == pytest.approx(1 - 102 / 164)
    assert partition_ids(tree, 60_000, method="exact") == [[0, 1], [2, 3]]


def test_large_agent_forest():
    # ~1M unique tokens, ~2,000 sequences: the whole-dataset use. Timing is measured by hand.
    tree = agent_forest(np.random.default_rng(7), 2_000, 1_000_000)
    assert tree.num_sequences >= 2_000
    budget = 32_768
    calls = []
    parts = partition(tree, budget, progress=lambda done, total: calls.append((done, total)))
    assert all(p.num_tokens <= budget for p in parts)
    assert sum(p.num_sequences for p in parts) == tree.num_sequences
    assert tree.num_tokens <= sum(p.num_tokens for p in parts) <= 1.2 * tree.num_tokens
    done = [d for d, _ in calls]
    assert done == sorted(done) and calls[-1] == (2 * tree.num_sequences,) * 2


def test_progress_bar_on_stderr(capsys):
    tree = Tree.from_sequences([[1, 2, 3], [1, 2, 4], [1, 5, 6]])
    partition(tree, 4, progress=True)
    err_out = capsys.readouterr().err
    assert re.fullmatch(r"(\rpartitioning \[[# ]{30}\] +[\d.]+% +[\d.]+s)+\n", err_out)
    assert "100.0%" in err_out


def test_exact_scales_to_its_limit():
    rng = np.random.default_rng(3)
    tree = Tree.from_sequences(random_token_lists(rng, EXACT_MAX_SEQUENCES, vocab=6))
    budget = max(int(tree.sequence_lengths.max()), tree.num_tokens // 3)
    exact = partition_ids(tree, budget, method="exact")
    greedy = partition_ids(tree, budget)
    tokens = [sum(tree.subtree(g).num_tokens for g in x) for x in (exact, greedy)]
    assert all(tree.subtree(g).num_tokens <= budget for g in exact)
    assert tokens[0] <= tokens[1]


# ---------------------------------------------------------------------------- errors


TREE = Tree.from_sequences([[1, 2, 3], [1, 2], [4, 5, 6, 7, 8, 9, 10]])


@pytest.mark.parametrize("budget", [0, -3])
def test_budget_must_be_positive(budget):
    with pytest.raises(ValueError, match=f"max_tokens must be positive, got {budget}"):
        partition(TREE, budget)


@pytest.mark.parametrize("budget", [2.5, 10.0, "10", True, None])
def test_budget_must_be_an_integer(budget):
    with pytest.raises(TypeError, match="max_tokens must be an integer"):
        partition_ids(TREE, budget)


def test_numpy_integer_budget_is_fine():
    assert partition_ids(TREE, np.int64(7)) == [[0, 1], [2]]


@pytest.mark.parametrize("method", ["greedy", "exact"])
def test_sequence_longer_than_budget(method):
    with pytest.raises(ValueError, match=r"sequence 2 has 7 tokens, more than max_tokens=5.*later"):
        partition(TREE, 5, method=method)


def test_unknown_method():
    with pytest.raises(ValueError, match=r"method must be one of \('greedy', 'exact'\), got 'dp'"):
        partition(TREE, 8, method="dp")


def test_exact_refuses_large_trees_unless_they_fit():
    tree = Tree.from_sequences([[i, i + 1] for i in range(EXACT_MAX_SEQUENCES + 1)])
    with pytest.raises(ValueError, match=rf"at most {EXACT_MAX_SEQUENCES} sequences.*has 17"):
        partition(tree, 4, method="exact")
    assert partition(tree, tree.num_tokens, method="exact") == [tree]


def test_err_refuses_parts_that_are_not_a_partition_of_the_tree():
    tree = Tree.from_sequences([[1, 2, 3], [1, 2, 4], [1, 2, 3], [5, 6]])
    parts = partition(tree, 4)
    assert len(parts) >= 2
    assert err(tree, parts) == pytest.approx(1 - sum(p.num_tokens for p in parts) / 11)
    assert err(tree, (p for p in parts)) == err(tree, parts)  # any iterable
    other = Tree.from_sequences([[7, 8, 9, 10, 11, 12, 13, 14], [7, 8]])
    with pytest.raises(ValueError, match=r"subtrees\[0\], its sequence 0 \(8 tokens \[7, 8, 9, 10, "
                                         r"11, 12, \.\.\.\]\) is not in the tree"):
        err(tree, [other])  # was a negative number
    with pytest.raises(ValueError, match=r"sequence 3 of the tree \(2 tokens \[5, 6\]\) is in no "
                                         r"subtree"):
        err(tree, [tree.subtree([0, 1, 2])])
    with pytest.raises(ValueError, match=r"subtrees\[1\], its sequence 0 .* more often than the tree"):
        err(tree, [tree, tree.subtree([0])])
    with pytest.raises(ValueError, match=r"sequence 2 of the tree .* is in no subtree"):
        err(tree, [tree.subtree([0, 1, 3])])  # one of the two duplicates is missing
    with pytest.raises(ValueError, match="subtrees is empty"):
        err(tree, [])
    with pytest.raises(TypeError, match=r"subtrees\[0\] is a list"):
        err(tree, [[1, 2, 3]])
    with pytest.raises(TypeError, match="tree must be a treefx.Tree"):
        err([[1, 2, 3]], parts)


def test_not_a_tree():
    with pytest.raises(TypeError, match="tree must be a treefx.Tree, got list"):
        partition([[1, 2]], 4)
