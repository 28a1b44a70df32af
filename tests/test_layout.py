"""DFS layout (pack / TreeBatch): sequences, positions, predecessors, tree mask, loss weights,
block masks and FlexAttention against the dense mask."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import sequence_sets
from torch.nn.attention.flex_attention import create_mask, flex_attention

from treefx import Tree, TreeBatch, pack, synth
from treefx.mask import tree_block_mask

PROPS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------------------- strategies




@st.composite
def node_trees(draw):
    """Explicit nodes, parents first but usually not in DFS preorder; sequences end at every
    leaf and at some internal nodes (shuffled, possibly repeated). Each node starts with its
    own token (from_nodes rejects siblings that start alike)."""
    n = draw(st.integers(1, 7))
    parents = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, n)]
    segments = [[4 + i] + draw(st.lists(st.integers(0, 3), max_size=2)) for i in range(n)]
    leaves = [i for i in range(n) if i not in parents]
    extra = draw(st.lists(st.integers(0, n - 1), max_size=3))
    ends = list(draw(st.permutations(leaves + extra)))
    seqs = []
    for e in ends:
        path = []
        while e >= 0:
            path.append(e)
            e = parents[e]
        seqs.append([t for node in reversed(path) for t in segments[node]])
    return segments, parents, ends, seqs


@st.composite
def trees(draw, masks=st.booleans(), weights=st.booleans()):
    """(tree, sequences, weights, masks) with the expected per-sequence data."""
    if draw(st.booleans()):
        seqs = draw(sequence_sets())
        make = lambda **kw: Tree.from_sequences(seqs, **kw)  # noqa: E731
    else:
        segments, parents, ends, seqs = draw(node_trees())
        make = lambda **kw: Tree.from_nodes(segments, parents, sequence_ends=ends, **kw)  # noqa: E731
    p = len(seqs)
    w = m = None
    if draw(weights):
        w = draw(st.lists(st.floats(0, 4, allow_nan=False), min_size=p, max_size=p))
    if draw(masks):
        m = [draw(st.lists(st.integers(0, 1), min_size=len(s), max_size=len(s))) for s in seqs]
    tree = make(weights=w, loss_masks=m)
    assert tree.sequences == seqs
    w = [1.0] * p if w is None else w
    m = [[1] * len(s) for s in seqs] if m is None else m
    return tree, seqs, w, m


forests = st.lists(trees(), min_size=1, max_size=3)
paddings = st.sampled_from([None, 1, 3, 8, 16])


def _flat(forest):
    """Per sequence over the forest in pack order: (tree index, tokens, weight, mask)."""
    return [
        (ti, s, w, m)
        for ti, (_, seqs, ws, ms) in enumerate(forest)
        for s, w, m in zip(seqs, ws, ms)
    ]


def _ancestor_mask(parent_token: torch.Tensor) -> torch.Tensor:
    """mask[q, k] = k is q or an ancestor of q, by walking parent_token."""
    par = parent_token.tolist()
    n = len(par)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        k = q
        seen = 0
        while k >= 0:
            mask[q, k] = True
            k = par[k]
            seen += 1
            assert seen <= n, "parent_token has a cycle"
    return mask


def _prefix_keys(batch: TreeBatch) -> list[tuple]:
    """(tree index, tokens from the root to t) for every real token t, via parent_token."""
    par = batch.parent_token.tolist()
    ids = batch.input_ids[0].tolist()
    tix = batch.tree_index.tolist()
    keys = []
    for t in range(batch.num_real_tokens):
        toks = []
        k = t
        while k >= 0:
            toks.append(ids[k])
            k = par[k]
        keys.append((tix[t], tuple(reversed(toks))))
    return keys


# ---------------------------------------------------------------------------- structure


@PROPS
@given(forests, paddings)
def test_pack_sequences_positions_and_predecessors(forest, pad):
    batch = pack([f[0] for f in forest], pad_to_multiple=pad)
    flat = _flat(forest)
    n_real = sum(f[0].num_tokens for f in forest)
    assert batch.num_real_tokens == n_real
    assert batch.num_sequences == len(flat)
    assert batch.num_baseline_tokens == sum(len(s) for _, s, _, _ in flat)
    if pad is None:
        assert batch.num_tokens == n_real
    else:
        assert batch.num_tokens % pad == 0 and 0 <= batch.num_tokens - n_real < pad
    assert batch.num_padding == batch.num_tokens - n_real
    n = batch.num_tokens
    assert batch.input_ids.shape == (1, n) and batch.position_ids.shape == (1, n)
    for name in ("parent_token", "subtree_end", "loss_weights", "tree_index"):
        assert getattr(batch, name).shape == (n,), name

    covered = torch.zeros(n, dtype=torch.bool)
    for g, (ti, seq, _, _) in enumerate(flat):
        idx = batch.sequence_index(g)
        assert batch.input_ids[0, idx].tolist() == seq
        assert batch.position_ids[0, idx].tolist() == list(range(len(seq)))
        # The tree predecessor of every token is the previous token of this sequence.
        assert batch.parent_token[idx].tolist() == [-1, *idx[:-1].tolist()]
        assert (batch.tree_index[idx] == ti).all()
        assert int(batch.sequence_tree[g]) == ti
        covered[idx] = True
    assert covered[:n_real].all(), "a real token lies on no sequence"
    assert not covered[n_real:].any()
    # Each tree is one contiguous range, trees in pack order.
    assert batch.tree_index[:n_real].tolist() == sorted(batch.tree_index[:n_real].tolist())

    # Node tensors: contiguous DFS ranges, node parents match the token predecessors.
    off, ln, npar = batch.node_offset.tolist(), batch.node_length.tolist(), batch.node_parent.tolist()
    assert off == list(np.concatenate([[0], np.cumsum(ln)[:-1]]).astype(int))
    assert sum(ln) == n_real
    for i, p in enumerate(npar):
        expected = -1 if p < 0 else off[p] + ln[p] - 1
        assert int(batch.parent_token[off[i]]) == expected
        assert p < i  # preorder


@PROPS
@given(forests, paddings)
def test_pack_tree_mask_is_ancestor_relation(forest, pad):
    batch = pack([f[0] for f in forest], pad_to_multiple=pad)
    n, n_real = batch.num_tokens, batch.num_real_tokens
    se = batch.subtree_end
    idx = torch.arange(n)
    interval = (idx[None, :] <= idx[:, None]) & (idx[:, None] < se[None, :])
    dense = batch.dense_mask()
    assert dense.dtype == torch.bool and dense.shape == (n, n)
    assert torch.equal(dense, interval)
    assert torch.equal(dense, _ancestor_mask(batch.parent_token))
    # subtree_end[k] is one past the last descendant of k.
    for k in range(n):
        below = torch.nonzero(dense[:, k])[:, 0]
        assert int(below.max()) + 1 == int(se[k])
        assert int(below.min()) == k
    # Padding: inert.
    pads = torch.arange(n_real, n)
    assert (batch.loss_weights[pads] == 0).all()
    assert (batch.tree_index[pads] == -1).all()
    assert (batch.parent_token[pads] == -1).all()
    assert (batch.position_ids[0, pads] == 0).all()
    assert torch.equal(dense[n_real:], torch.eye(n, dtype=torch.bool)[n_real:])
    assert torch.equal(dense[:, n_real:], torch.eye(n, dtype=torch.bool)[:, n_real:])


def test_pack_non_preorder_nodes_hand_checked():
    tree = Tree.from_nodes([[1, 2], [3], [4, 5], [6]], [-1, 0, 0, 1])
    batch = pack([tree, Tree.from_sequences([[7, 8, 9], [7, 8]])], pad_to_multiple=4,
                 reduction="sum")
    # DFS: [1 2] [3] [6] [4 5] | [7 8] [9] | pad pad pad
    assert batch.input_ids[0].tolist() == [1, 2, 3, 6, 4, 5, 7, 8, 9, 0, 0, 0]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 2, 3, 0, 1, 2, 0, 0, 0]
    assert batch.parent_token.tolist() == [-1, 0, 1, 2, 1, 4, -1, 6, 7, -1, -1, -1]
    assert batch.subtree_end.tolist() == [6, 6, 4, 4, 6, 6, 9, 9, 9, 10, 11, 12]
    assert batch.tree_index.tolist() == [0] * 6 + [1] * 3 + [-1] * 3
    assert batch.input_ids[0, batch.sequence_index(0)].tolist() == [1, 2, 4, 5]
    assert batch.input_ids[0, batch.sequence_index(1)].tolist() == [1, 2, 3, 6]
    assert batch.input_ids[0, batch.sequence_index(3)].tolist() == [7, 8]
    # Weight 1 per sequence over the batch's 4 sequences, "sum": 1/4 per path through a token;
    # token 2 is on both paths of tree 0, 8 on both of tree 1.
    assert batch.num_sequences_normalizer == 4
    assert batch.loss_weights.tolist() == [0, 0.5, 0.25, 0.25, 0.25, 0.25, 0, 0.5, 0.25, 0, 0, 0]
    with pytest.raises(IndexError, match="sequence 4 out of range"):
        batch.sequence_index(4)
    with pytest.raises(IndexError):
        batch.sequence_index(-1)


def test_pack_pads_in_nodes_of_the_asked_length():
    """``pad_node_tokens``: the padding comes as root chains of up to that many tokens (seen by
    no real token, weight 0), the real tokens laid out as with one root a pad token."""
    from treefx.ops.recurrence.reference import tree_nodes

    trees = [Tree.from_sequences([[1, 2, 3], [1, 2, 4, 5]]), Tree.from_sequences([[7, 8]])]
    one = pack(trees, pad_to_multiple=16)  # 7 real tokens, 9 pad tokens
    chains = pack(trees, pad_to_multiple=16, pad_node_tokens=4)
    n_real, n = one.num_real_tokens, one.num_tokens
    assert (chains.num_real_tokens, chains.num_tokens) == (n_real, n) == (7, 16)
    for name in ("parent_token", "subtree_end", "loss_weights", "tree_index"):
        assert torch.equal(getattr(chains, name)[:n_real], getattr(one, name)[:n_real]), name
    assert torch.equal(chains.input_ids, one.input_ids)
    assert chains.position_ids[0, n_real:].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert chains.parent_token[n_real:].tolist() == [-1, 7, 8, 9, -1, 11, 12, 13, -1]
    assert chains.subtree_end[n_real:].tolist() == [11] * 4 + [15] * 4 + [16]
    assert (chains.loss_weights[n_real:] == 0).all() and (chains.tree_index[n_real:] == -1).all()
    dense = chains.dense_mask()
    assert not dense[:n_real, n_real:].any() and not dense[n_real:, :n_real].any()
    assert len(tree_nodes(chains.parent_token)[0]) == len(tree_nodes(one.parent_token)[0]) - 6
    with pytest.raises(ValueError, match="pad_node_tokens"):
        pack(trees, pad_to_multiple=16, pad_node_tokens=0)


def test_pack_single_tree_and_generator():
    tree = Tree.from_sequences([[1, 2], [1, 3]])
    a = pack(tree)
    b = pack(t for t in [tree])
    assert torch.equal(a.input_ids, b.input_ids)
    assert a.trees == [tree] and a.reduction == "mean"  # the documented loss by default
    assert a.loss_weights.dtype == torch.float64  # exact sums by default
    assert pack(tree, pad_token_id=9, pad_to_multiple=4).input_ids[0].tolist() == [1, 2, 3, 9]


# ---------------------------------------------------------------------------- loss weights


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(forests, paddings, st.sampled_from(["sum", "mean"]), st.integers(0, 2**32 - 1),
       st.sampled_from([None, 0, 5]))
def test_loss_weights_reproduce_per_sequence_loss(forest, pad, reduction, seed, extra):
    """The tree loss Σ_t w_t ℓ_t is (1/P) Σ_p ω_p r_p Σ_j m_p(j) ℓ_p(j), P the batch's sequence
    count (``extra`` None) or a larger global count given to pack."""
    own = sum(len(f[1]) for f in forest)
    num_sequences = None if extra is None else own + extra
    batch = pack([f[0] for f in forest], reduction=reduction, pad_to_multiple=pad,
                 weight_dtype=torch.float64, num_sequences=num_sequences)
    normalizer = own if extra is None else own + extra
    assert batch.num_sequences_normalizer == normalizer
    assert batch.loss_weights.dtype == torch.float64
    assert batch.reduction == reduction
    rng = np.random.default_rng(seed)
    ell: dict[tuple, float] = {}

    def loss(key):  # one value per unique context, the same in every sequence through it
        if key not in ell:
            ell[key] = float(rng.uniform(0.1, 5.0))
        return ell[key]

    baseline = 0.0
    expected_w: dict[tuple, float] = {}
    for ti, seq, w, m in _flat(forest):
        predicted = sum(m[1:])
        r = 1.0 if reduction == "sum" else (1.0 / predicted if predicted else 0.0)
        for j in range(len(seq)):
            key = (ti, tuple(seq[: j + 1]))
            coef = w * r * m[j] / normalizer if j >= 1 else 0.0
            expected_w[key] = expected_w.get(key, 0.0) + coef
            if j >= 1:
                baseline += coef * loss(key)
    keys = _prefix_keys(batch)
    lw = batch.loss_weights.tolist()
    assert all(math.isfinite(x) for x in lw)
    tree_loss = sum(lw[t] * loss(keys[t]) for t in range(batch.num_real_tokens))
    assert math.isclose(tree_loss, baseline, rel_tol=1e-12, abs_tol=0.0)
    # Per unique context (and so per token of a trie): the weights themselves.
    got_w: dict[tuple, float] = {}
    for t, key in enumerate(keys):
        got_w[key] = got_w.get(key, 0.0) + lw[t]
    assert got_w.keys() == expected_w.keys()
    for key, v in expected_w.items():
        assert math.isclose(got_w[key], v, rel_tol=1e-12, abs_tol=1e-300), key
    # First tokens are never predicted; padding weighs nothing.
    assert (batch.loss_weights[batch.position_ids[0] == 0] == 0).all()
    assert (batch.loss_weights[batch.num_real_tokens:] == 0).all()
    # float32 weights are the float64 ones rounded.
    b32 = pack([f[0] for f in forest], reduction=reduction, pad_to_multiple=pad,
               weight_dtype=torch.float32, num_sequences=num_sequences)
    assert b32.loss_weights.dtype == torch.float32
    assert torch.equal(b32.loss_weights, batch.loss_weights.float())


def test_loss_weights_hand_checked_with_length_one_sequence():
    seqs = [[1, 2, 3], [1, 2, 4], [1], [5]]
    weights = [0.5, 0.25, 1.0, 2.0]
    masks = [[1, 1, 1], [0, 0, 1], [1], [1]]
    tree = Tree.from_sequences(seqs, weights=weights, loss_masks=masks)
    # DFS: 1 2 3 4 5; every weight divided by the 4 sequences.
    b = pack(tree, weight_dtype=torch.float64, reduction="sum")
    assert b.input_ids[0].tolist() == [1, 2, 3, 4, 5]
    assert b.loss_weights.tolist() == [0.0, 0.125, 0.125, 0.0625, 0.0]
    b = pack(tree, reduction="mean", weight_dtype=torch.float64)
    # r = 1/2, 1/1, 1/0 -> 0, 1/0 -> 0
    assert b.loss_weights.tolist() == [0.0, 0.0625, 0.0625, 0.0625, 0.0]
    # Same without masks: r = 1/2, 1/2 and length-one sequences add nothing (no NaN).
    tree = Tree.from_sequences(seqs, weights=weights)
    b = pack(tree, reduction="mean", weight_dtype=torch.float64)
    assert b.loss_weights.tolist() == [0.0, 0.09375, 0.0625, 0.03125, 0.0]
    # A global count of 8 sequences halves them again.
    b = pack(tree, reduction="mean", weight_dtype=torch.float64, num_sequences=8)
    assert b.loss_weights.tolist() == [0.0, 0.046875, 0.03125, 0.015625, 0.0]
    b = pack(Tree.from_sequences([[7]]), reduction="mean", weight_dtype=torch.float64)
    assert b.loss_weights.tolist() == [0.0]


def test_loss_weights_first_token_of_root_is_zero_even_if_masked_in():
    tree = Tree.from_sequences([[3, 4], [3, 5]], loss_masks=[[1, 1], [1, 0]], weights=[1, 1])
    b = pack(tree, weight_dtype=torch.float64)
    assert b.loss_weights.tolist() == [0.0, 0.5, 0.0]
    b = pack(tree, reduction="mean", weight_dtype=torch.float64)
    assert b.loss_weights.tolist() == [0.0, 0.5, 0.0]


def test_copies_of_a_tree_weigh_as_one_tree():
    """The batch loss is the mean over all its sequences: k copies of a tree give each token k
    times the paths and k times the count, so the same weights per copy (not k times the loss,
    as a sum of per-tree means would)."""
    tree = Tree.from_sequences([[1, 2, 3], [1, 2, 4, 5], [6]], weights=[0.5, 2.0, 1.0],
                               loss_masks=[[1, 1, 1], [0, 1, 0, 1], [1]])
    for reduction in ("sum", "mean"):
        one = pack(tree, reduction=reduction).loss_weights
        eight = pack([tree] * 8, reduction=reduction)
        assert eight.num_sequences_normalizer == 24
        torch.testing.assert_close(eight.loss_weights, one.repeat(8) / 8, rtol=1e-15, atol=0)
        assert float(eight.loss_weights.sum()) == pytest.approx(float(one.sum()), rel=1e-14)


def test_forest_weights_are_the_mean_over_all_its_sequences():
    # Trees of 1 and 3 sequences: every sequence weighs 1/4, whichever tree it is in.
    small = Tree.from_sequences([[1, 2]])
    big = Tree.from_sequences([[3, 4], [3, 5], [3, 5, 6]])
    b = pack([small, big], weight_dtype=torch.float64, reduction="sum")
    # DFS, a node's larger child first: 1 2 | 3 5 6 4
    assert b.input_ids[0].tolist() == [1, 2, 3, 5, 6, 4]
    assert b.loss_weights.tolist() == [0.0, 0.25, 0.0, 0.5, 0.25, 0.25]


def test_num_sequences_is_checked():
    tree = Tree.from_sequences([[1, 2], [1, 3], [4, 5]])
    assert pack(tree).num_sequences_normalizer == 3
    assert pack(tree, num_sequences=np.int64(7)).num_sequences_normalizer == 7
    with pytest.raises(ValueError, match=r"num_sequences=2 is smaller than the 3 sequences of "
                                         r"this batch.*global batch"):
        pack(tree, num_sequences=2)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="smaller than the 3 sequences"):
            pack(tree, num_sequences=bad)
    for bad in (3.0, "3", True):
        with pytest.raises(TypeError, match="num_sequences must be an integer count"):
            pack(tree, num_sequences=bad)


# ---------------------------------------------------------------------------- block masks


def _check_block_mask(batch: TreeBatch, block: int):
    """Expand batch.block_mask(block) to tokens and compare with the dense mask exactly."""
    n = batch.num_tokens
    nb = -(-n // block)
    bm = batch.block_mask(block)
    assert batch.block_mask(block) is bm  # cached
    dense = batch.dense_mask()
    mod = create_mask(bm.mask_mod, 1, 1, n, n, device=dense.device)[0, 0]
    assert torch.equal(mod, dense)  # the mask_mod is the tree mask everywhere
    kv_num, kv_idx = bm.kv_num_blocks[0, 0], bm.kv_indices[0, 0]
    full_num, full_idx = bm.full_kv_num_blocks[0, 0], bm.full_kv_indices[0, 0]
    # One spare, empty block after the row's (treefx.mask.num_blocks): it lists no
    # block, and no block lists it (checked below: every listed block is < nb).
    assert kv_num.shape == (nb + 1,) and full_num.shape == (nb + 1,)
    assert kv_num[nb] == 0 and full_num[nb] == 0
    out = torch.zeros(n, n, dtype=torch.bool)
    for qb in range(nb):
        qs = slice(qb * block, min(n, (qb + 1) * block))
        partial = kv_idx[qb, : int(kv_num[qb])].tolist()
        full = full_idx[qb, : int(full_num[qb])].tolist()
        assert len(set(partial)) == len(partial) and len(set(full)) == len(full)
        assert not set(partial) & set(full), f"q block {qb}: a kv block is both full and partial"
        assert all(0 <= kb < nb for kb in partial + full)
        for kb in range(nb):
            ks = slice(kb * block, min(n, (kb + 1) * block))
            tile = dense[qs, ks]
            if kb in full:
                assert tile.all(), f"block ({qb}, {kb}) listed full but is not"
                out[qs, ks] = True
            elif kb in partial:
                out[qs, ks] = mod[qs, ks]
                if kb != qb:  # off-diagonal partial blocks are exact: mixed, not all or none
                    assert tile.any() and not tile.all(), f"block ({qb}, {kb}) needlessly partial"
            else:
                assert not tile.any(), f"block ({qb}, {kb}) left out but has visible pairs"
    assert torch.equal(out, dense)
    return bm


def _tree_of_232() -> Tree:
    rng = random.Random(232)
    lengths = [40, 13, 25, 7, 30, 11, 19, 5, 22, 17, 9, 34]
    assert sum(lengths) == 232
    parents = [-1] + [rng.randrange(-1 if i > 6 else 0, i) for i in range(1, len(lengths))]
    segments = [[1000 + i] + [rng.randrange(1, 1000) for _ in range(k - 1)]
                for i, k in enumerate(lengths)]
    return Tree.from_nodes(segments, parents)


def _small_agent_tree(seed: int, **kw) -> Tree:
    return synth.agent_tree(
        seed, system_len=(20, 60), prompt_len=(5, 30), think_len=(5, 40),
        answer_len=(3, 20), tool_len=(5, 40), rollouts=3, branch_prob=0.5, **kw,
    )


@pytest.mark.parametrize("block", [16, 32, 128])
def test_block_mask_232_tokens(block):
    batch = pack(_tree_of_232())
    assert batch.num_tokens == 232
    _check_block_mask(batch, block)


@pytest.mark.parametrize("block", [16, 32, 128])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_mask_synthetic_trees(block, seed):
    single = pack(_small_agent_tree(seed))
    _check_block_mask(single, block)
    forest = pack([_small_agent_tree(seed + 10), _small_agent_tree(seed + 20)], pad_to_multiple=8)
    _check_block_mask(forest, block)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(forests, paddings, st.sampled_from([2, 3, 4, 16]))
def test_block_mask_random_forests(forest, pad, block):
    batch = pack([f[0] for f in forest], pad_to_multiple=pad)
    _check_block_mask(batch, block)


def test_block_mask_bad_block_size():
    batch = pack(Tree.from_sequences([[1, 2]]))
    for bad in (0, -4, 2.0, None):
        with pytest.raises(ValueError, match="block_size"):
            batch.block_mask(bad)


def test_block_mask_of_128k_tokens():
    rng = np.random.default_rng(0)
    n_nodes = 3000
    lengths = rng.integers(1, 80, size=n_nodes)
    lengths[-1] += 131072 - lengths.sum()
    assert lengths[-1] >= 1
    # Mostly deep chains with some branching, parents first (not preorder).
    parents = [-1] + [int(rng.integers(max(0, i - 50), i)) for i in range(1, n_nodes)]
    segments = [rng.integers(0, 32000, size=int(k)) for k in lengths]
    for i, seg in enumerate(segments):
        seg[0] = i  # siblings must start with different tokens
    batch = pack(Tree.from_nodes(segments, parents))
    assert batch.num_tokens == 131072
    se = batch.subtree_end
    bm = tree_block_mask(se, 128)
    nb = 131072 // 128
    assert bm.kv_num_blocks.shape == (1, 1, nb + 1)  # and the spare block
    # Spot-check blocks against the interval test on the tile.
    kv_num, kv_idx = bm.kv_num_blocks[0, 0], bm.kv_indices[0, 0]
    full_num, full_idx = bm.full_kv_num_blocks[0, 0], bm.full_kv_indices[0, 0]
    pick = np.random.default_rng(1)
    for _ in range(200):
        qb = int(pick.integers(0, nb))
        kb = int(pick.integers(0, qb + 1)) if pick.random() < 0.8 else int(pick.integers(0, nb))
        q = torch.arange(qb * 128, (qb + 1) * 128)[:, None]
        k = torch.arange(kb * 128, (kb + 1) * 128)[None, :]
        tile = (k <= q) & (q < se[k])
        is_full = kb in full_idx[qb, : int(full_num[qb])].tolist()
        is_partial = kb in kv_idx[qb, : int(kv_num[qb])].tolist()
        assert not (is_full and is_partial)
        if is_full:
            assert tile.all()
        elif not is_partial:
            assert not tile.any()
    assert int(kv_num.sum() + full_num.sum()) < nb * nb  # sparse, not all blocks


def test_block_counts_exact_under_bf16_autocast():
    """Block counts come from a float32 product; under bf16 autocast a row of more than 256
    visible blocks would round if autocast reached it."""
    from treefx.mask import block_indices

    g = torch.Generator().manual_seed(0)
    m = torch.rand(4, 601, generator=g) < 0.9  # rows of ~540 visible blocks
    m[0] = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        num, idx = block_indices(m)
    assert num.dtype == torch.int32 and num.shape == (1, 1, 4)
    assert num[0, 0].tolist() == m.sum(dim=1).tolist()
    assert int(num[0, 0, 0]) == 601  # odd above 256: not a bfloat16
    for r in range(4):
        assert idx[0, 0, r, : int(num[0, 0, r])].tolist() == m[r].nonzero()[:, 0].tolist()


# ---------------------------------------------------------------------------- FlexAttention


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_eager_matches_sdpa_with_dense_mask():
    tree = Tree.from_sequences(
        [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 3, 7, 9, 10, 11], [1, 2], [12, 13, 14]]
        + [[20 + i for i in range(k)] for k in (9, 14)]
        + [[20, 21, 22, 99, 98, 97, 96]]
    )
    batch = pack(tree, pad_to_multiple=5)
    n = batch.num_tokens
    assert n % 16  # partial last block
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.dense_mask())
    for block in (16, 128):
        got = flex_attention(q, k, v, block_mask=batch.block_mask(block))
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # And the result really is per-sequence attention: sequence 1 alone, causal.
    idx = batch.sequence_index(1)
    alone = F.scaled_dot_product_attention(q[:, :, idx], k[:, :, idx], v[:, :, idx], is_causal=True)
    torch.testing.assert_close(want[:, :, idx], alone, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------- errors, moving


def test_pack_errors():
    tree = Tree.from_sequences([[1, 2]])
    with pytest.raises(ValueError, match="reduction must be one of"):
        pack(tree, reduction="avg")
    with pytest.raises(ValueError, match="at least one tree"):
        pack([])
    with pytest.raises(TypeError, match=r"trees\[1\] is a list"):
        pack([tree, [[1, 2]]])
    with pytest.raises(TypeError, match=r"trees\[0\] is a str"):
        pack(["x"])
    for bad in (0, -8, 2.5, "8"):
        with pytest.raises(ValueError, match="pad_to_multiple must be a positive integer"):
            pack(tree, pad_to_multiple=bad)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64, "float"])
def test_pack_refuses_non_floating_weight_dtypes(dtype):
    # An integer dtype would truncate every fractional weight to 0: a loss of 0, silently.
    with pytest.raises(ValueError, match=r"weight_dtype must be a floating torch dtype .*got"):
        pack(Tree.from_sequences([[1, 2, 3]]), weight_dtype=dtype)


def test_pack_floating_weight_dtypes():
    tree = Tree.from_sequences([[1, 2, 3], [1, 4]])
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        b = pack(tree, weight_dtype=dtype, reduction="sum")
        assert b.loss_weights.dtype == dtype
        assert b.loss_weights.tolist() == [0.0, 0.5, 0.5, 0.5]


def test_pad_token_id_is_checked():
    tree = Tree.from_sequences([[1, 2, 3]])
    assert pack(tree, pad_token_id=np.int32(5), pad_to_multiple=4).input_ids[0].tolist() == \
        [1, 2, 3, 5]
    for bad in (1.5, 1.0, True, "0", None):
        with pytest.raises(TypeError, match=r"pad_token_id must be an integer token id, got"):
            pack(tree, pad_token_id=bad, pad_to_multiple=4)
    with pytest.raises(ValueError, match="pad_token_id must be a non-negative token id, got -1"):
        pack(tree, pad_token_id=-1, pad_to_multiple=4)
    with pytest.raises(ValueError, match="pad_token_id"):  # checked even when nothing is padded
        pack(tree, pad_token_id=-1)


def test_to_cpu_keeps_values():
    tree = Tree.from_sequences([[1, 2, 3], [1, 4]], weights=[0.3, 0.7], loss_masks=[[1, 0, 1], [1, 1]])
    batch = pack([tree, Tree.from_sequences([[5]])], reduction="mean", pad_to_multiple=8)
    bm = batch.block_mask(4)
    moved = batch.to("cpu")
    assert isinstance(moved, TreeBatch)
    for name in ("input_ids", "position_ids", "parent_token", "subtree_end", "loss_weights",
                 "tree_index", "node_offset", "node_length", "node_parent",
                 "sequence_node_ends", "sequence_tree"):
        a, b = getattr(batch, name), getattr(moved, name)
        assert torch.equal(a, b) and a.dtype == b.dtype, name
    assert moved.device == torch.device("cpu")
    assert (moved.reduction, moved.num_real_tokens, moved.trees) == ("mean", 5, batch.trees)
    assert moved.num_sequences_normalizer == batch.num_sequences_normalizer == 3
    assert moved.sequence_index(1).tolist() == batch.sequence_index(1).tolist()
    bm2 = moved.block_mask(4)
    assert torch.equal(bm2.kv_num_blocks, bm.kv_num_blocks)
    assert torch.equal(bm2.full_kv_indices, bm.full_kv_indices)


def test_grouped_copy_keeps_values_shapes_and_alignment():
    """The CPU -> GPU path of TreeBatch.to: one buffer per dtype, split back into views."""
    from treefx.layout import grouped_copy

    ts = [torch.arange(5), torch.rand(3, dtype=torch.float64), torch.arange(6).view(2, 3),
          torch.tensor([True, False, True]), torch.empty(0, dtype=torch.int64),
          torch.rand(1, 7), torch.arange(3, dtype=torch.int32)]
    out = grouped_copy(ts, torch.device("cpu"), pin=False)
    for a, b in zip(ts, out):
        assert b.shape == a.shape and b.dtype == a.dtype and torch.equal(a, b)
        assert b.is_contiguous() and b.data_ptr() % 64 == 0
    # tensors of one dtype share one buffer, and writing one leaves the others alone
    assert out[0].untyped_storage().data_ptr() == out[2].untyped_storage().data_ptr()
    out[0].fill_(-1)
    assert torch.equal(out[2], ts[2]) and torch.equal(out[4], ts[4])


def test_to_keeps_every_reductions_weights():
    tree = Tree.from_sequences([[1, 2, 3], [1, 4]], weights=[0.3, 0.7])
    batch = pack(tree, reduction="mean")
    moved = batch.to("cpu")
    for r in ("sum", "mean"):
        assert torch.equal(moved.loss_weights_for(r), batch.loss_weights_for(r))


def test_weights_that_a_narrow_dtype_cannot_hold_raise():
    """float16 flushes weights below ~3e-8 to 0 (a silent 0 loss for those tokens) and turns
    weights above 65504 into inf."""
    tree = Tree.from_sequences([[1, 2, 3], [1, 2, 4], [1, 5, 6], [1, 5, 7]])
    assert pack(tree, reduction="mean", weight_dtype=torch.float16).loss_weights.tolist() == \
        [0, 0.25, 0.125, 0.125, 0.25, 0.125, 0.125]
    # With a global count of 10^8: 1e-8 and 5e-9.
    with pytest.raises(ValueError, match=r'loss weight of token 1 \(1e-08, reduction="mean"\) '
                                         r"underflows to 0 in torch.float16 \(6 tokens do\); "
                                         r"pack with weight_dtype=torch.float32"):
        pack(tree, reduction="mean", weight_dtype=torch.float16, num_sequences=10**8)
    assert pack(tree, reduction="mean", weight_dtype=torch.float32,
                num_sequences=10**8).loss_weights.tolist()[1] == pytest.approx(1e-8)
    # The batch's other reduction is refused when a step asks for it, not at pack: here the
    # "sum" weights are 1e-5 and the "mean" ones of the long sequence 1e-8.
    long = Tree.from_sequences([list(range(1, 1002)), [1, 5000]])
    batch = pack(long, reduction="sum", weight_dtype=torch.float16, num_sequences=10**5)
    assert bool((batch.loss_weights[1:] > 0).all())
    assert torch.equal(batch.loss_weights_for("sum"), batch.loss_weights)
    for b in (batch, batch.to("cpu")):
        with pytest.raises(ValueError, match=r'reduction="mean"\) underflows to 0 in '
                                             r"torch.float16 \(1000 tokens do\)"):
            b.loss_weights_for("mean")
    # Large weights overflow.
    big = Tree.from_sequences([[1, 2], [1, 3]], weights=[1e6, 1.0])
    with pytest.raises(ValueError, match=r"loss weight of token 1 \(5e\+05, reduction=\"sum\"\) "
                                         r"overflows in torch.float16"):
        pack(big, weight_dtype=torch.float16, reduction="sum")
    wide = pack(big, weight_dtype=torch.bfloat16, reduction="sum")
    assert bool(wide.loss_weights.isfinite().all())
    # A weight below float32's range (losses are computed in float32 at least) means nothing
    # in any dtype: flushing it is no error.
    tiny = Tree.from_sequences([[4, 5], [4, 6]], weights=[1.0, 1e-300])
    flushed = pack(tiny, weight_dtype=torch.float32, reduction="sum")
    assert flushed.loss_weights.tolist() == [0, 0.5, 0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
def test_to_cuda_without_cuda_says_so():
    batch = pack(Tree.from_sequences([[1, 2, 3], [1, 4]]))
    with pytest.raises(RuntimeError, match=r"^batch.to\('cuda'\): CUDA is not available here "
                                           r"\(torch.cuda.is_available\(\) is False\)"):
        batch.to("cuda")
    with pytest.raises(RuntimeError, match=r"^batch.to\('cuda:0'\): CUDA is not available"):
        batch.to(torch.device("cuda", 0))


def test_children_are_laid_out_largest_subtree_first():
    """A comb (each call's completion a leaf off the growing conversation) whose leaves sort
    before the trunk by token id: the trunk still comes first at every branch, so it stays one
    contiguous run and the tree mask's blocks stay close to its pairs."""
    from treefx.distributed import attended_pairs
    from treefx.mask import tree_block_tensors

    trunk, seqs = [], []
    for call in range(12):
        trunk = trunk + [100 + call] * 40  # the conversation grows with large ids
        seqs.append(trunk + [1 + call] * 30)  # the completion starts with a small id
    tree = Tree.from_sequences(seqs)
    b = pack(tree)
    offs, lens, par = (b.node_offset.tolist(), b.node_length.tolist(), b.node_parent.tolist())
    size = list(lens)
    for i in range(len(par) - 1, -1, -1):
        if par[i] >= 0:
            size[par[i]] += size[i]
    for p in range(len(par)):
        kids = [i for i in range(len(par)) if par[i] == p]
        assert [size[k] for k in kids] == sorted((size[k] for k in kids), reverse=True)
        assert not kids or offs[kids[0]] == offs[p] + lens[p]  # the largest right after it
    kv, _, full, _, _ = tree_block_tensors(b.subtree_end, 16)
    computed = (int(kv.sum()) + int(full.sum())) * 16 * 16
    assert computed <= 1.1 * attended_pairs(tree)
