"""Tree: trie merge, explicit nodes, JSONL, counts, and input validation."""

from __future__ import annotations

import json
import math
from collections import defaultdict

import copy
import pickle

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from strategies import sequence_sets
from hypothesis import strategies as st

import treefx
from treefx import Tree, read_jsonl, write_jsonl

# ---------------------------------------------------------------------------- strategies




PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _children(tree: Tree) -> list[list[int]]:
    ch: list[list[int]] = [[] for _ in range(tree.num_nodes)]
    for i, p in enumerate(tree.parents.tolist()):
        if p >= 0:
            ch[p].append(i)
    return ch


def _distinct_prefixes(seqs) -> set[tuple[int, ...]]:
    return {tuple(s[: j + 1]) for s in seqs for j in range(len(s))}


# ---------------------------------------------------------------------------- from_sequences


@PROPS
@given(sequence_sets())
def test_from_sequences_recovers_sequences_in_order(seqs):
    tree = Tree.from_sequences(seqs)
    assert tree.sequences == seqs
    for i, s in enumerate(seqs):
        assert tree.sequence(i).tolist() == s
        assert tree.sequence(i - len(seqs)).tolist() == s  # negative indices
    assert tree.num_sequences == len(seqs)
    assert tree.num_baseline_tokens == sum(len(s) for s in seqs)
    assert tree.sequence_lengths.tolist() == [len(s) for s in seqs]
    np.testing.assert_array_equal(tree.weights, np.ones(len(seqs)))  # the mean is pack's job
    assert tree.loss_masks is None
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(tree.loss_mask(i), np.ones(len(s)))


@PROPS
@given(sequence_sets())
def test_from_sequences_counts_unique_tokens(seqs):
    tree = Tree.from_sequences(seqs)
    prefixes = _distinct_prefixes(seqs)
    assert tree.num_tokens == len(prefixes)
    assert tree.num_tokens == int(tree.segment_lengths.sum())
    assert math.isclose(tree.por, 1 - len(prefixes) / sum(map(len, seqs)), rel_tol=0, abs_tol=1e-15)
    assert math.isclose(tree.bound, sum(map(len, seqs)) / len(prefixes), rel_tol=1e-15)
    assert math.isclose(treefx.por(tree), tree.por)
    assert math.isclose(treefx.bound(tree), tree.bound, rel_tol=1e-12)


@PROPS
@given(sequence_sets())
def test_from_sequences_nodes_are_maximal_shared_segments(seqs):
    tree = Tree.from_sequences(seqs)
    parents = tree.parents.tolist()
    children = _children(tree)
    ends = set(tree.sequence_ends.tolist())
    # Parents first, non-empty segments, depths consistent.
    for i, p in enumerate(parents):
        assert -1 <= p < i
        assert len(tree.segments[i]) >= 1
        expected_depth = 0 if p < 0 else tree.node_depths[p] + len(tree.segments[p])
        assert tree.node_depths[i] == expected_depth
    # Every split is justified: one child only where a sequence ends; leaves end sequences.
    for i in range(tree.num_nodes):
        if len(children[i]) == 1:
            assert i in ends, f"node {i} has one child and ends no sequence: not maximal"
        if not children[i]:
            assert i in ends, f"leaf {i} ends no sequence"
    # Trie: siblings (and roots) start with distinct tokens, so nothing shared is duplicated.
    roots = [i for i, p in enumerate(parents) if p < 0]
    for group in [roots, *children]:
        firsts = [int(tree.segments[c][0]) for c in group]
        assert len(firsts) == len(set(firsts))
    # The node count of the compressed trie, computed from the prefixes alone: a prefix starts
    # a node iff it is one token long, or its parent prefix ends a sequence or branches.
    prefixes = _distinct_prefixes(seqs)
    ext = defaultdict(set)
    for p in prefixes:
        ext[p[:-1]].add(p[-1])
    seq_ends = {tuple(s) for s in seqs}
    starts = [
        p for p in prefixes if len(p) == 1 or p[:-1] in seq_ends or len(ext[p[:-1]]) >= 2
    ]
    assert tree.num_nodes == len(starts)
    # Roots: one per distinct first token (a forest when they differ).
    assert len(roots) == len({s[0] for s in seqs})


@PROPS
@given(sequence_sets(), st.randoms(use_true_random=False))
def test_from_sequences_input_order_does_not_change_the_tree(seqs, rnd):
    perm = list(range(len(seqs)))
    rnd.shuffle(perm)
    a = Tree.from_sequences(seqs)
    b = Tree.from_sequences([seqs[i] for i in perm])
    assert b.sequences == [seqs[i] for i in perm]
    assert (a.num_nodes, a.num_tokens, a.num_baseline_tokens) == (
        b.num_nodes,
        b.num_tokens,
        b.num_baseline_tokens,
    )


@PROPS
@given(sequence_sets(), st.data())
def test_from_sequences_keeps_weights_and_masks_per_sequence(seqs, data):
    weights = data.draw(
        st.lists(st.floats(0, 10, allow_nan=False), min_size=len(seqs), max_size=len(seqs))
    )
    masks = [data.draw(st.lists(st.integers(0, 1), min_size=len(s), max_size=len(s))) for s in seqs]
    tree = Tree.from_sequences(seqs, weights=weights, loss_masks=masks)
    assert tree.sequences == seqs
    np.testing.assert_array_equal(tree.weights, np.asarray(weights, dtype=np.float64))
    assert tree.weights.dtype == np.float64
    for i, m in enumerate(masks):
        np.testing.assert_array_equal(tree.loss_mask(i), np.asarray(m, dtype=np.float64))
        assert tree.loss_masks[i].dtype == np.float64


def test_prefix_and_duplicate_sequences_are_their_own_paths():
    seqs = [[1, 2, 3], [1, 2], [1, 2, 3], [1, 2, 3, 4], [1]]
    tree = Tree.from_sequences(seqs)
    assert tree.sequences == seqs
    assert tree.num_sequences == 5
    assert tree.num_baseline_tokens == 3 + 2 + 3 + 4 + 1
    assert tree.num_tokens == 4
    # [1] | [2] | [3] | [4]: every boundary is a sequence end.
    assert [s.tolist() for s in tree.segments] == [[1], [2], [3], [4]]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.sequence_ends.tolist() == [2, 1, 2, 3, 0]
    assert tree.weights.tolist() == [1.0] * 5


def test_forest_of_several_roots():
    seqs = [[5, 1], [6, 1], [5, 2], [7]]
    tree = Tree.from_sequences(seqs)
    assert tree.sequences == seqs
    roots = [i for i, p in enumerate(tree.parents.tolist()) if p < 0]
    assert sorted(int(tree.segments[r][0]) for r in roots) == [5, 6, 7]
    assert tree.num_tokens == 6  # 5, 5-1, 5-2, 6, 6-1, 7


def test_single_sequence_is_one_node():
    tree = Tree.from_sequences([[3, 1, 4, 1, 5]])
    assert tree.num_nodes == 1
    assert tree.segments[0].tolist() == [3, 1, 4, 1, 5]
    assert tree.por == 0.0 and tree.bound == 1.0


def test_numpy_and_tuple_inputs():
    tree = Tree.from_sequences((np.array([1, 2, 3], dtype=np.int32), (1, 2, 4)))
    assert tree.sequences == [[1, 2, 3], [1, 2, 4]]
    assert tree.segments[0].dtype == np.int64


def test_hand_made_counts():
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2], [7, 8]]
    tree = Tree.from_sequences(seqs)
    # Prefixes: 1, 12, 123, 1234, 1235, 12356, 7, 78.
    assert tree.num_tokens == 8
    assert tree.num_baseline_tokens == 13
    assert tree.num_nodes == 5  # [1 2] [3] [4] [5 6] [7 8]
    assert sorted(s.tolist() for s in tree.segments) == [[1, 2], [3], [4], [5, 6], [7, 8]]
    assert tree.por == pytest.approx(5 / 13, abs=1e-15)
    assert tree.bound == pytest.approx(13 / 8, abs=1e-15)
    assert treefx.bound(tree) == pytest.approx(13 / 8, abs=1e-12)
    other = Tree.from_sequences([[9, 9], [9, 9, 9]])  # 3 unique, 5 baseline
    assert treefx.por([tree, other]) == pytest.approx(1 - 11 / 18, abs=1e-15)
    assert treefx.bound([tree, other]) == pytest.approx(18 / 11, abs=1e-12)
    assert "por=0.385" in repr(tree)


def test_subtree_keeps_weights_and_masks():
    seqs = [[1, 2, 3], [1, 2, 4], [5, 6]]
    tree = Tree.from_sequences(seqs, weights=[0.5, 1.5, 2.0], loss_masks=[[0, 1, 1], [0, 0, 1], [1, 1]])
    sub = tree.subtree([2, 0])
    assert sub.sequences == [[5, 6], [1, 2, 3]]
    assert sub.weights.tolist() == [2.0, 0.5]
    assert [m.tolist() for m in sub.loss_masks] == [[1, 1], [0, 1, 1]]
    with pytest.raises(ValueError, match="at least one sequence"):
        tree.subtree([])


def _arrays(tree: Tree) -> dict[str, np.ndarray]:
    out = {"parents": tree.parents, "sequence_ends": tree.sequence_ends,
           "weights": tree.weights, "node_depths": tree.node_depths}
    out.update({f"segments[{i}]": s for i, s in enumerate(tree.segments)})
    out.update({f"loss_masks[{i}]": m for i, m in enumerate(tree.loss_masks or ())})
    return out


@pytest.mark.parametrize("build", ["sequences", "nodes"])
def test_tree_arrays_are_read_only_copies(build):
    """A tree does not change once built: its arrays refuse writes, and the caller's arrays
    it was built from (which the trie would otherwise slice into) can change freely."""
    seq = np.array([1, 2, 3], dtype=np.int64)
    other = np.array([1, 2, 4], dtype=np.int64)
    weights = np.array([0.5, 2.0])
    mask = np.array([0.0, 1.0, 1.0])
    if build == "sequences":
        tree = Tree.from_sequences([seq, other], weights=weights, loss_masks=[mask, mask])
    else:
        tree = Tree.from_nodes([seq[:2], seq[2:], other[2:]], np.array([-1, 0, 0]),
                               sequence_ends=np.array([1, 2]), weights=weights,
                               loss_masks=[mask, mask])
    before = treefx.pack(tree, reduction="mean")
    arrays = _arrays(tree)
    assert len(arrays) == 4 + tree.num_nodes + 2
    for name, arr in arrays.items():
        assert not arr.flags.writeable, name
        with pytest.raises(ValueError, match="read-only"):
            arr[0] = 7
    for arr in (seq, other, weights, mask):  # the inputs: not shared with the tree
        arr[:] = 9
    assert tree.sequences == [[1, 2, 3], [1, 2, 4]]
    assert tree.weights.tolist() == [0.5, 2.0]
    assert tree.loss_masks[0].tolist() == [0.0, 1.0, 1.0]
    after = treefx.pack(tree, reduction="mean")
    for name in ("input_ids", "loss_weights", "parent_token", "subtree_end"):
        assert torch.equal(getattr(after, name), getattr(before, name)), name
    # loss_mask(i) is the caller's copy: writing it leaves the tree alone.
    m = tree.loss_mask(0)
    m[:] = 0
    assert tree.loss_masks[0].tolist() == [0.0, 1.0, 1.0]


def test_tree_attributes_cannot_be_reassigned_but_pickle_and_copy():
    tree = Tree.from_sequences([[1, 2, 3], [1, 2]], weights=[1.0, 3.0], loss_masks=[[1, 1, 0], [0, 1]])
    for name, value in (("weights", np.ones(2)), ("segments", ()), ("loss_masks", None),
                        ("_sequences", [[0]])):
        with pytest.raises(AttributeError, match=f"does not change once built \\(setting '{name}'"):
            setattr(tree, name, value)
    with pytest.raises(AttributeError, match="does not change once built"):
        del tree.weights
    for twin in (pickle.loads(pickle.dumps(tree)), copy.deepcopy(tree), copy.copy(tree)):
        assert twin == tree and twin is not tree
        assert all(not a.flags.writeable for a in _arrays(twin).values())
        assert torch.equal(treefx.pack(twin).loss_weights, treefx.pack(tree).loss_weights)


def test_sequence_index_out_of_range():
    tree = Tree.from_sequences([[1], [2]])
    with pytest.raises(IndexError, match="sequence 2 out of range"):
        tree.sequence(2)
    with pytest.raises(IndexError):
        tree.sequence(-3)


# ---------------------------------------------------------------------------- from_nodes


def test_from_nodes_not_in_dfs_preorder():
    # Node 3 is a child of node 1 but comes after node 2 (a child of node 0).
    tree = Tree.from_nodes([[1, 2], [3], [4, 5], [6]], [-1, 0, 0, 1])
    assert tree.sequence_ends.tolist() == [2, 3]  # default: the leaves, in node order
    assert tree.sequences == [[1, 2, 4, 5], [1, 2, 3, 6]]
    assert tree.num_tokens == 6
    assert tree.num_baseline_tokens == 8
    assert tree.node_depths.tolist() == [0, 2, 2, 3]
    assert tree.weights.tolist() == [1.0, 1.0]
    assert tree.por == pytest.approx(0.25)


def test_from_nodes_default_sequence_ends_are_leaves():
    parents = [-1, 0, 1, 1, 0, -1, 5, 5]
    tree = Tree.from_nodes([[i] for i in range(8)], parents)
    assert tree.sequence_ends.tolist() == [2, 3, 4, 6, 7]
    assert tree.sequences == [[0, 1, 2], [0, 1, 3], [0, 4], [5, 6], [5, 7]]


def test_from_nodes_sequence_ending_at_internal_node():
    tree = Tree.from_nodes(
        [[1, 2], [3], [4, 5], [6]],
        [-1, 0, 0, 1],
        sequence_ends=[0, 3, 2, 1, 3],
        weights=[1, 2, 3, 4, 5],
        loss_masks=[[0, 1], [0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 0], [1, 0, 1, 0]],
    )
    assert tree.sequences == [[1, 2], [1, 2, 3, 6], [1, 2, 4, 5], [1, 2, 3], [1, 2, 3, 6]]
    assert tree.num_sequences == 5
    assert tree.num_tokens == 6
    assert tree.num_baseline_tokens == 2 + 4 + 4 + 3 + 4
    assert tree.weights.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert tree.loss_mask(3).tolist() == [0.0, 1.0, 0.0]
    # Equal to the trie merge of the same data.
    again = Tree.from_sequences(
        tree.sequences, weights=tree.weights, loss_masks=tree.loss_masks
    )
    assert again == tree


# ---------------------------------------------------------------------------- JSONL and equality


def test_to_dict_writes_weights_only_when_not_all_one():
    t = Tree.from_sequences([[1, 2], [1, 3]])
    assert "weights" not in t.to_dict() and Tree.from_dict(t.to_dict()) == t
    w = Tree.from_sequences([[1, 2], [1, 3]], weights=[1.0, 2.0])
    assert w.to_dict()["weights"] == [1.0, 2.0] and Tree.from_dict(w.to_dict()) == w


def test_records_are_by_nodes_and_round_trip_exactly():
    from trees import odd_forest as forest

    # odd shapes: single-token nodes, a sequence that is a prefix of another, duplicates,
    # forests; masks, weights and per-sequence metadata
    trees = forest(6, 40) + [
        Tree.from_sequences([[1, 2, 3], [1, 2], [1, 2, 3], [7]], weights=[1, 2, 3, 4],
                            loss_masks=[[0, 1, 1], [1, 0], [0, 0, 0], [1]],
                            metadata={"rewards": [1.0, 0.0, 0.5, 2.0], "task": "t"}),
    ]
    for t in trees:
        d = json.loads(json.dumps(t.to_dict()))
        assert "sequences" not in d and d["segments"] == [s.tolist() for s in t.segments]
        back = Tree.from_dict(d)
        assert back == t and back.sequences == t.sequences
        assert [m.tolist() for m in back.loss_masks or ()] == \
            [m.tolist() for m in t.loss_masks or ()]
    d = trees[-1].to_dict()
    assert d["sequence_ends"] == trees[-1].sequence_ends.tolist()  # not one per leaf
    assert d["loss_mask_runs"] == [[1, 3], [0, 1], [], [0, 1]]


def test_records_by_sequences_are_still_read():
    t = Tree.from_sequences([[1, 2, 3], [1, 2, 4]], loss_masks=[[0, 1, 1], [0, 0, 1]],
                            metadata={"task": "x"})
    old = {"sequences": t.sequences, "loss_masks": [[0, 1, 1], [0, 0, 1]], "task": "x"}
    assert Tree.from_dict(old) == t


def test_a_record_grows_with_the_tree_not_with_its_sequences():
    # a comb: every call extends the trunk by one turn (an agent's calls laid out separately)
    trunk, seqs = [], []
    for i in range(40):
        trunk = trunk + list(range(i * 50, i * 50 + 50))
        seqs.append(trunk)
    t = Tree.from_sequences(seqs, loss_masks=[[0] * (len(s) - 50) + [1] * 50 for s in seqs])
    by_nodes = len(json.dumps(t.to_dict()))
    by_sequences = len(json.dumps({"sequences": t.sequences,
                                   "loss_masks": [m.astype(int).tolist() for m in t.loss_masks]}))
    assert t.num_baseline_tokens > 15 * t.num_tokens
    assert by_sequences > 15 * by_nodes


@pytest.mark.parametrize("record,match", [
    ({"segments": [[1, 2]]}, "needs \"parents\""),
    ({"sequences": [[1]], "segments": [[1]], "parents": [-1]}, "not both"),
    ({"segments": [[1, 2]], "parents": [-1], "loss_masks": [[1, 1]]}, "loss_mask_runs"),
    ({"segments": [[1, 2]], "parents": [-1], "loss_mask_runs": [[0, 3]]}, "within"),
    ({"segments": [[1, 2]], "parents": [-1], "loss_mask_runs": [[1]]}, "pairs"),
    ({"segments": [[1, 2]], "parents": [-1], "loss_mask_runs": []}, "one list per sequence"),
    ({"segment": [[1, 2]], "parents": [-1], "sequences": [[1]]}, "did you mean 'segments'"),
])
def test_a_bad_record_by_nodes_says_what_is_wrong(record, match):
    with pytest.raises(ValueError, match=match):
        Tree.from_dict(record)


def test_jsonl_round_trip_with_weights_and_masks(tmp_path):
    trees = [
        Tree.from_sequences(
            [[1, 2, 3], [1, 2, 4, 5], [1, 2]],
            weights=[0.1, 1 / 3, 2.5],
            loss_masks=[[0, 1, 1], [0, 0, 1, 1], [1, 0]],
        ),
        Tree.from_sequences([[7, 8], [9]]),
        Tree.from_nodes([[1, 2], [3], [4]], [-1, 0, 0], weights=[0.25, 0.75]),
        Tree.from_sequences([[0]], weights=[0.0], loss_masks=[[0]]),
    ]
    path = tmp_path / "trees.jsonl"
    assert write_jsonl(path, trees) == 4
    lines = path.read_text().splitlines()
    assert len(lines) == 4
    # by nodes (issue 34: a record grows with the tree); sequence 2 ends inside node 0
    assert json.loads(lines[0]) == {
        "segments": [[1, 2], [3], [4, 5]],
        "parents": [-1, 0, 0],
        "sequence_ends": [1, 2, 0],
        "weights": [0.1, 1 / 3, 2.5],
        "loss_mask_runs": [[1, 3], [2, 4], [0, 1]],
    }
    assert "loss_mask_runs" not in json.loads(lines[1])
    back = list(read_jsonl(str(path)))
    assert back == trees
    for a, b in zip(back, trees):
        np.testing.assert_array_equal(a.weights, b.weights)  # bit-exact floats
        assert a.num_tokens == b.num_tokens


def test_jsonl_skips_blank_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('\n{"sequences": [[1, 2]]}\n   \n{"sequences": [[3]], "weights": [2]}\n')
    trees = list(read_jsonl(path))
    assert [t.sequences for t in trees] == [[[1, 2]], [[3]]]
    assert trees[1].weights.tolist() == [2.0]


def test_tree_equality():
    base = Tree.from_sequences([[1, 2], [1, 3]])
    assert base == Tree.from_sequences([[1, 2], [1, 3]])
    assert base != Tree.from_sequences([[1, 3], [1, 2]])  # order of sequences matters
    assert base != Tree.from_sequences([[1, 2], [1, 3]], weights=[0.5, 0.6])
    assert base != Tree.from_sequences([[1, 2], [1, 3]], loss_masks=[[1, 1], [1, 1]])
    masked = Tree.from_sequences([[1, 2], [1, 3]], loss_masks=[[0, 1], [1, 1]])
    assert masked != Tree.from_sequences([[1, 2], [1, 3]], loss_masks=[[1, 1], [1, 1]])
    assert masked == Tree.from_sequences([[1, 2], [1, 3]], loss_masks=[[0, 1], [1, 1]])
    assert base != "tree"
    with pytest.raises(TypeError):
        hash(base)


def test_tree_constructor_is_private():
    with pytest.raises(TypeError, match="from_sequences"):
        Tree([], np.zeros(0), np.zeros(0), np.zeros(0), None)


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(sequences=[]), ValueError, "sequences is empty"),
        (dict(sequences=[[1, 2], []]), ValueError, "sequence 1 is empty"),
        (dict(sequences=[[1, 2], [1.5]]), TypeError, r"sequence 1, position 0: token id 1\.5"),
        (dict(sequences=[["a", 1]]), TypeError, "sequence 0, position 0: token id 'a'"),
        (dict(sequences=[[0], [True]]), TypeError, "sequence 1, position 0: token id True"),
        (dict(sequences=[[1, None]]), TypeError, "sequence 0, position 1: token id None"),
        (dict(sequences=[[1, 2], [3, 4, -1]]), ValueError, "sequence 1, position 2: token id -1 is negative"),
        (dict(sequences=[[1, 2], [[3, 4]]]), ValueError, "sequence 1 must be a flat list"),
        (dict(sequences="abc"), TypeError, "list of token id lists"),
        (dict(sequences=[[1], "ab"]), TypeError, "sequence 1 must be a list"),
        (dict(sequences=[[1, 2], [3]], loss_masks=[[1, 1], [1, 1]]), ValueError,
         "loss mask of sequence 1 has 2 entries but its sequence has 1 tokens"),
        (dict(sequences=[[1, 2], [3]], loss_masks=[[1, 1]]), ValueError, "loss_masks has 1 entries"),
        (dict(sequences=[[1, 2, 3]], loss_masks=[[0, 1, 2]]), ValueError,
         "loss mask of sequence 0, position 2: mask value 2 is not 0 or 1"),
        (dict(sequences=[[1], [1, 2]], loss_masks=[[1], [0.5, 1]]), ValueError,
         "loss mask of sequence 1, position 0: mask value 0.5"),
        (dict(sequences=[[1, 2]], loss_masks=[[1, float("nan")]]), ValueError,
         "loss mask of sequence 0, position 1"),
        (dict(sequences=[[1, 2]], loss_masks=[[-1, 1]]), ValueError, "loss mask of sequence 0, position 0"),
        (dict(sequences=[[1, 2]], loss_masks=[["a", "b"]]), TypeError, "loss mask of sequence 0"),
        (dict(sequences=[[1], [2]], weights=[1.0, 2.0, 3.0]), ValueError,
         "weights has 3 entries but there are 2 sequences"),
        (dict(sequences=[[1], [2]], weights=[1.0]), ValueError, "weights has 1 entries"),
        (dict(sequences=[[1], [2]], weights=[1.0, -0.5]), ValueError, "sequence 1: weight .* non-negative"),
        (dict(sequences=[[1], [2]], weights=[float("nan"), 1.0]), ValueError, "sequence 0: weight .*finite"),
        (dict(sequences=[[1], [2]], weights=[1.0, float("inf")]), ValueError, "sequence 1: weight"),
        (dict(sequences=[[1], [2]], weights=["a", "b"]), TypeError, "weights must be numbers"),
    ],
)
def test_from_sequences_rejects_bad_input(kwargs, exc, match):
    seqs = kwargs.pop("sequences")
    with pytest.raises(exc, match=match):
        Tree.from_sequences(seqs, **kwargs)


# A mixed list must not be coerced to one dtype before the check: the error names the bad
# entry itself, and a bool among ints is not taken as token 1.
@pytest.mark.parametrize(
    "seqs, exc, match",
    [
        pytest.param(
            [[1, 2], [3, 1.5]], TypeError, r"sequence 1, position 1: token id 1\.5",
        ),
        pytest.param(
            [[0, "a"]], TypeError, "sequence 0, position 1: token id 'a'",
        ),
        pytest.param(
            [[1, 2], [1, True]], TypeError, "sequence 1, position 1",
        ),
        pytest.param(
            [[1], [2**70]], ValueError, "sequence 1, position 0",
        ),
    ],
)
def test_bad_token_is_named_at_its_own_position(seqs, exc, match):
    with pytest.raises(exc, match=match):
        Tree.from_sequences(seqs)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(segments=[], parents=[]), ValueError, "segments is empty"),
        (dict(segments=[[1], []], parents=[-1, 0]), ValueError, "segment 1 is empty"),
        (dict(segments=[[1], [2, -3]], parents=[-1, 0]), ValueError, "segment 1, position 1: token id -3"),
        (dict(segments=[[1], [2]], parents=[-1]), ValueError, "parents has 1 entries but there are 2"),
        (dict(segments=[[1], [2]], parents=[-1, 1]), ValueError, r"parents\[1\] = 1: node 1 is its own parent"),
        (dict(segments=[[1], [2]], parents=[0, -1]), ValueError, r"parents\[0\] = 0: node 0 is its own parent"),
        (dict(segments=[[1], [2], [3]], parents=[-1, 2, 0]), ValueError,
         r"parents\[1\] = 2: parent comes after its child"),
        (dict(segments=[[1], [2]], parents=[1, 0]), ValueError, r"parents\[0\] = 1: parent comes after"),
        (dict(segments=[[1], [2]], parents=[-1, 2]), ValueError, r"parents\[1\] = 2 is out of range"),
        (dict(segments=[[1], [2]], parents=[-1, -2]), ValueError, r"parents\[1\] = -2 is out of range"),
        (dict(segments=[[1], [2]], parents=[-1, 0.0]), TypeError, r"parents\[1\] = 0\.0 is not an integer"),
        (dict(segments=[[1], [2]], parents=[-1, True]), TypeError, r"parents\[1\] = True"),
        (dict(segments=[[1], [2], [3]], parents=[-1, 0, 0], sequence_ends=[1]), ValueError,
         "node 2 lies on no sequence"),
        (dict(segments=[[1], [2], [3]], parents=[-1, 0, -1], sequence_ends=[1]), ValueError,
         "node 2 lies on no sequence"),
        (dict(segments=[[1], [2]], parents=[-1, 0], sequence_ends=[]), ValueError, "sequence_ends is empty"),
        (dict(segments=[[1], [2]], parents=[-1, 0], sequence_ends=[1, 2]), ValueError,
         r"sequence_ends\[1\] = 2 is out of range"),
        (dict(segments=[[1], [2]], parents=[-1, 0], sequence_ends=[1.0]), TypeError, r"sequence_ends\[0\]"),
        (dict(segments=[[1], [2]], parents=[-1, 0], weights=[1, 2]), ValueError, "weights has 2 entries"),
        (dict(segments=[[1, 2], [3]], parents=[-1, 0], sequence_ends=[0, 1], loss_masks=[[1, 1], [1, 1]]),
         ValueError, "loss mask of sequence 1 has 2 entries but its sequence has 3 tokens"),
        (dict(segments=[[1, 2], [3]], parents=[-1, 0], loss_masks=[[1, 1, 3]]), ValueError,
         "loss mask of sequence 0, position 2: mask value 3"),
        (dict(segments=[[1, 2], [3]], parents=[-1, 0], loss_masks=[[1, 1, 1], [1]]), ValueError,
         "loss_masks has 2 entries but there are 1 sequences"),
    ],
)
def test_from_nodes_rejects_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Tree.from_nodes(kwargs.pop("segments"), kwargs.pop("parents"), **kwargs)


def _write(tmp_path, text):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "second_line, exc, match",
    [
        ('{"sequences": [[1, 2], [3, -4]]}', ValueError, "line 2: sequence 1, position 1: token id -4"),
        ('{"sequences": [[1, 2]], "weight": [1]}', ValueError,
         r"line 2: tree record key 'weight' is not 'weights'; did you mean 'weights'"),
        ('{"sequences": [[1]], "weights": [1], "loss_mask": [[1]], "x": 0}', ValueError,
         r"line 2: tree record key 'loss_mask' is not 'loss_masks'"),
        ('{"sequences": [[1, 2]], "rewards": [1, 2]}', ValueError,
         r"line 2: metadata 'rewards' has 2 entries but the tree has 1 sequences"),
        ('{"sequences": [[1, 2]], "logprobs": [[-0.1, -0.2]]}', ValueError,
         r"line 2: metadata 'logprobs', sequence 0 has 2 entries but its sequence has 2 tokens"),
        ('[[1, 2]]', ValueError, 'line 2: a tree record must be an object with a "sequences" list'),
        ('{"weights": [1]}', ValueError, 'line 2: a tree record must be an object'),
        ('{"sequences": []}', ValueError, "line 2: sequences is empty"),
        ('{"sequences": [[1, 2]], "loss_masks": [[1]]}', ValueError, "line 2: loss mask of sequence 0 has 1 entries"),
        ('{"sequences": [[1, 2]], "weights": [-1]}', ValueError, "line 2: sequence 0: weight"),
        ('{"sequences": [["x"]]}', TypeError, "line 2: sequence 0, position 0"),
    ],
)
def test_read_jsonl_names_the_bad_line(tmp_path, second_line, exc, match):
    path = _write(tmp_path, '{"sequences": [[1, 2]]}\n' + second_line + "\n")
    it = read_jsonl(path)
    assert next(it).sequences == [[1, 2]]  # lazy: the good line comes first
    with pytest.raises(exc, match=match) as info:
        next(it)
    assert str(path) in str(info.value)


def test_read_jsonl_invalid_json_names_the_line(tmp_path):
    path = _write(tmp_path, '{"sequences": [[1, 2]]}\n\n{"sequences": [[1, 2]\n')
    with pytest.raises(ValueError, match="line 3"):
        list(read_jsonl(path))


def test_from_nodes_rejects_siblings_that_start_alike():
    with pytest.raises(ValueError, match="nodes 0 and 1 have the same parent .* token 5"):
        Tree.from_nodes([[5, 6], [5, 7]], [-1, -1])
    with pytest.raises(ValueError, match="nodes 1 and 2 have the same parent \\(0\\)"):
        Tree.from_nodes([[1], [2, 3], [2]], [-1, 0, 0])
