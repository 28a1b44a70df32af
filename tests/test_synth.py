"""Synthetic agent trees: determinism, target POR, output masks."""

from __future__ import annotations

import numpy as np
import pytest

from treefx import Tree, synth


def _lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_same_seed_same_tree(seed):
    a = synth.agent_tree(seed, rollouts=3)
    b = synth.agent_tree(seed, rollouts=3)
    assert isinstance(a, Tree)
    assert a == b
    assert a.sequences == b.sequences
    assert synth.agent_tree(seed, rollouts=3, mask_outputs=True) == synth.agent_tree(
        seed, rollouts=3, mask_outputs=True
    )


def test_different_seed_different_tree():
    trees = [synth.agent_tree(s) for s in range(5)]
    for i in range(5):
        for j in range(i + 1, 5):
            assert trees[i] != trees[j]
            assert trees[i].sequences != trees[j].sequences


def test_dataset_is_consecutive_seeds():
    ds = synth.dataset(3, seed=5, rollouts=2)
    assert ds == [synth.agent_tree(s, rollouts=2) for s in (5, 6, 7)]
    assert synth.dataset(3, seed=5, rollouts=2) == ds
    with pytest.raises(ValueError, match="n must be at least 1"):
        synth.dataset(0)


def test_shape_of_a_tree():
    tree = synth.agent_tree(3, vocab_size=50, rollouts=4)
    toks = np.concatenate(tree.segments)
    assert toks.min() >= 1 and toks.max() < 50
    seqs = tree.sequences
    assert tree.num_sequences >= 4 * 2  # at least 2 turns per rollout
    # The group shares system + user prompt (at least 150 + 30 tokens by default).
    shared = min(_lcp(seqs[0], s) for s in seqs[1:])
    assert shared >= 180
    assert 0 < tree.por < 1
    np.testing.assert_array_equal(tree.weights, np.ones(tree.num_sequences))  # the default
    assert tree.loss_masks is None


# In CI each target and each seed once (the same bisection on other trees); the other six
# pairs with -m slow.
@pytest.mark.parametrize("target,seed", [
    (t, s) if (t, s) in ((0.5, 0), (0.7, 1), (0.9, 2)) else
    pytest.param(t, s, marks=pytest.mark.slow)
    for t in (0.5, 0.7, 0.9) for s in (0, 1, 2)])
def test_target_por_reached(seed, target):
    tree = synth.agent_tree(seed, rollouts=4, target_por=target)
    assert abs(tree.por - target) <= 0.01, tree.por
    assert tree == synth.agent_tree(seed, rollouts=4, target_por=target)  # deterministic


def test_target_por_keeps_the_shape():
    # Only the shared prompt is scaled: same number of calls, same generated lengths.
    plain = synth.agent_tree(4, rollouts=2, mask_outputs=True)
    scaled = synth.agent_tree(4, rollouts=2, mask_outputs=True, target_por=0.8)
    assert abs(scaled.por - 0.8) <= 0.01
    assert scaled.num_sequences == plain.num_sequences
    assert [int(m.sum()) for m in scaled.loss_masks] == [int(m.sum()) for m in plain.loss_masks]


def test_unreachable_target_por():
    with pytest.raises(ValueError, match="out of reach"):
        synth.agent_tree(0, rollouts=1, target_por=0.99)
    with pytest.raises(ValueError, match="out of reach"):
        # One turn, no branching, many rollouts: the prompt is always shared; POR can't be ~0.
        synth.agent_tree(0, rollouts=8, turns=(1, 1), branch_prob=0.0, target_por=0.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(target_por=1.0), r"target_por must be in \[0, 1\)"),
        (dict(target_por=-0.1), r"target_por must be in \[0, 1\)"),
        (dict(vocab_size=1), "vocab_size must be at least 2"),
        (dict(vocab_size=10**20), r"vocab_size must be at most 2\*\*63 \(token ids are int64\)"),
        (dict(rollouts=0), "rollouts must be at least 1"),
        (dict(branch_prob=1.5), r"branch_prob must be in \[0, 1\]"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        synth.agent_tree(0, **kwargs)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_mask_outputs_marks_only_generated_tokens(seed):
    tree = synth.agent_tree(seed, rollouts=3, mask_outputs=True)
    plain = synth.agent_tree(seed, rollouts=3)
    assert tree.sequences == plain.sequences  # masks do not change the trajectories
    seqs = tree.sequences
    shared = min(_lcp(seqs[0], s) for s in seqs[1:])
    for i, s in enumerate(seqs):
        m = tree.loss_mask(i)
        assert m.shape == (len(s),)
        assert set(np.unique(m).tolist()) <= {0.0, 1.0}
        assert m[0] == 0 and m[-1] == 1
        # Context (zeros) then this call's own output (ones): one switch.
        ones = int(m.sum())
        assert np.all(m[: len(s) - ones] == 0) and np.all(m[len(s) - ones :] == 1)
        # Default think (40..300) + answer (10..80) lengths.
        assert 50 <= ones <= 380
        # The shared prompt is never generated.
        assert len(s) - ones >= shared


@pytest.mark.parametrize("seed", [0, 5])
def test_mask_outputs_earlier_outputs_are_context_later(seed):
    # Without think mode a call's whole sequence is the start of its next call, where the
    # tokens it generated are context (mask 0).
    tree = synth.agent_tree(seed, rollouts=2, think_mode=False, mask_outputs=True,
                            turns=(3, 4))
    seqs = tree.sequences
    pairs = 0
    for i, a in enumerate(seqs):
        for j, b in enumerate(seqs):
            if len(a) < len(b) and b[: len(a)] == a:
                pairs += 1
                assert np.all(tree.loss_mask(j)[: len(a)] == 0)
    assert pairs >= 2 * 2  # at least 3 turns in each of 2 rollouts
    for i, s in enumerate(seqs):
        ones = int(tree.loss_mask(i).sum())
        assert 10 <= ones <= 80  # answer only, no think


def test_think_mode_drops_reasoning_from_next_context():
    tree = synth.agent_tree(2, rollouts=1, turns=(3, 3), branch_prob=0.0, mask_outputs=True)
    seqs = tree.sequences
    assert len(seqs) == 3
    for a, b, ma in zip(seqs, seqs[1:], tree.loss_masks):
        context = len(a) - int(ma.sum())
        # The next call shares this call's context and then branches off (the think part is
        # dropped), so the two sequences share exactly the context.
        assert _lcp(a, b) == context


def test_iter_dataset_makes_the_trees_one_at_a_time():
    trees = synth.iter_dataset(10**9, 3, rollouts=1)  # lazily: none made yet
    assert next(trees) == synth.agent_tree(3, rollouts=1)
    assert next(trees) == synth.agent_tree(4, rollouts=1)
    assert list(synth.iter_dataset(3, 3, rollouts=1)) == synth.dataset(3, 3, rollouts=1)
    with pytest.raises(ValueError, match="n must be at least 1"):
        synth.iter_dataset(0)  # at the call, not at the first tree
