"""Loss normalization over several trees: a batch's loss is the mean over all its sequences,

    L = (1/P) Σ_p ω_p r_p Σ_{j≥1} m_p(j) ℓ_p(j),

P the batch's sequence count or a global count given to ``pack(..., num_sequences=)``. The same
in ``treefx.tree_loss``, ``treefx.reference.sequence_loss``, every ``treefx.rl`` objective and
``@treefx.step``, values and gradients (float64, tiny decoder, eager backend, CPU):

- k copies of a tree give the loss of one tree, not k times it;
- a forest's loss is the mean of the per-sequence oracle losses over all its sequences;
- micro-batches packed with the global count sum to the global batch, and so do the parts of
  a partitioned tree packed with the whole tree's count.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from trees import odd_forest, odd_tree

import treefx
from treefx import rl
from treefx.models import tiny_decoder

VOCAB = 64
GRAD_RTOL = 1e-9


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tree_model() -> treefx.TreeModel:
    torch.manual_seed(0)
    model = tiny_decoder(vocab_size=VOCAB).double()
    model.reset_parameters(std=0.2)
    return treefx.compile(model, backend="eager")


def value_and_grads(model, fn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``fn()`` and the gradients of all parameters it leaves (then zeroed)."""
    model.zero_grad(set_to_none=True)
    value = fn()
    value.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return value.detach(), grads


def assert_same(a, b, *, rtol=1e-10):
    (va, ga), (vb, gb) = a, b
    torch.testing.assert_close(va, vb, rtol=rtol, atol=1e-13)
    assert ga and ga.keys() == gb.keys()
    for name, g in gb.items():
        err = float((ga[name] - g).norm() / g.norm().clamp_min(1e-30))
        assert err <= GRAD_RTOL, f"gradient of {name} off by {err:.2e} (relative)"


def micro_batches(trees: list[treefx.Tree], k: int) -> list[list[treefx.Tree]]:
    """``trees`` cut into ``k`` consecutive, non-empty groups (of different sizes)."""
    bounds = [round(i * len(trees) / k) for i in range(k + 1)]
    groups = [trees[a:b] for a, b in zip(bounds, bounds[1:])]
    assert all(groups) and sum(map(len, groups)) == len(trees)
    return groups


def global_batch() -> list[treefx.Tree]:
    """Five trees of different sequence counts, odd shapes, weights and masks."""
    return [*odd_forest(40, VOCAB), odd_tree(41, VOCAB),
            treefx.Tree.from_sequences([[1, 2, 3, 4], [1, 2, 5]]), odd_tree(42, VOCAB, masks=False)]


# ---------------------------------------------------------------------------- SFT loss


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_copies_of_a_tree_give_the_loss_of_one_tree(tree_model, reduction):
    model = tree_model.model
    tree = odd_tree(30, VOCAB)
    one = None
    for k in (1, 8):
        batch = treefx.pack([tree] * k, reduction=reduction)
        pack_loss = value_and_grads(model, lambda: treefx.tree_loss(tree_model(batch), batch))
        oracle = value_and_grads(model, lambda: treefx.reference.sequence_loss(
            model, [tree] * k, reduction=reduction))
        assert_same(pack_loss, oracle)
        if one is None:
            one = pack_loss
    assert_same(pack_loss, one)  # 8 copies: the same loss and gradients, not 8 times them


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_forest_loss_is_the_mean_over_all_its_sequences(tree_model, reduction):
    model = tree_model.model
    trees = global_batch()
    batch = treefx.pack(trees, reduction=reduction)
    with torch.no_grad():
        loss = treefx.tree_loss(tree_model(batch), batch)
        logprobs = treefx.reference.sequence_logprobs(model, trees)
    # By hand: each sequence's own loss from the oracle, then their plain mean.
    per_sequence = []
    p = 0
    for tree in trees:
        for i in range(tree.num_sequences):
            m = torch.as_tensor(tree.loss_mask(i)[1:])
            own = (m * -logprobs[p]).sum()
            if reduction == "mean":
                own = own / m.sum() if m.sum() > 0 else own * 0
            per_sequence.append(float(tree.weights[i]) * own)
            p += 1
    assert p == batch.num_sequences == batch.num_sequences_normalizer
    want = torch.stack(per_sequence).mean()
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    # Not the sum over trees of each tree's mean (what the default was before).
    per_tree, start = [], 0
    for tree in trees:
        per_tree.append(torch.stack(per_sequence[start:start + tree.num_sequences]).mean())
        start += tree.num_sequences
    assert abs(float(torch.stack(per_tree).sum() - want)) > 0.1 * abs(float(want))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_micro_batches_with_the_global_count_sum_to_the_global_batch(tree_model, reduction):
    model = tree_model.model
    trees = global_batch()
    total = sum(t.num_sequences for t in trees)
    whole = treefx.pack(trees, reduction=reduction)
    want = value_and_grads(model, lambda: treefx.tree_loss(tree_model(whole), whole))
    oracle = value_and_grads(model, lambda: treefx.reference.sequence_loss(
        model, trees, reduction=reduction))
    assert_same(want, oracle)
    for k in (2, 3):
        def accumulated():
            out = 0
            for group in micro_batches(trees, k):
                b = treefx.pack(group, reduction=reduction, num_sequences=total,
                                pad_to_multiple=8)
                assert b.num_sequences < total == b.num_sequences_normalizer
                out = out + treefx.tree_loss(tree_model(b), b)
            return out

        def accumulated_oracle():
            return sum(treefx.reference.sequence_loss(model, group, reduction=reduction,
                                                      num_sequences=total)
                       for group in micro_batches(trees, k))

        assert_same(value_and_grads(model, accumulated), want)
        assert_same(value_and_grads(model, accumulated_oracle), want)


def test_partition_parts_packed_with_the_trees_count_sum_to_the_tree(tree_model):
    model = tree_model.model
    tree = odd_tree(31, VOCAB)
    parts = treefx.partition(tree, max(int(tree.sequence_lengths.max()), tree.num_tokens // 2))
    assert len(parts) >= 2
    for reduction in ("sum", "mean"):
        whole = treefx.pack(tree, reduction=reduction)
        want = value_and_grads(model, lambda: treefx.tree_loss(tree_model(whole), whole))

        def split(num_sequences):
            out = 0
            for part in parts:
                b = treefx.pack(part, reduction=reduction, num_sequences=num_sequences)
                out = out + treefx.tree_loss(tree_model(b), b)
            return out

        assert_same(value_and_grads(model, lambda: split(tree.num_sequences)), want)
        # Each part averaged over its own sequences only: not the tree's loss.
        alone = value_and_grads(model, lambda: split(None))[0]
        assert abs(float(alone - want[0])) > 0.1 * abs(float(want[0]))


# ---------------------------------------------------------------------------- RL objectives


def context_noise(prefix: list[int], salt: int) -> float:
    """A number in [−0.3, 0.3] fixed by the prefix: sequences sharing a token agree on it."""
    h = zlib.crc32(np.asarray([salt, *prefix], dtype=np.int64).tobytes())
    return 0.6 * np.random.default_rng(h).random() - 0.3


def rl_data(model, tree: treefx.Tree, seed: int) -> dict:
    """Per-sequence RL data of one tree: advantages per sequence and per token (random), and
    old / reference log-probs (the oracle's plus context noise, so ratios clip on both sides)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        base = treefx.reference.sequence_logprobs(model, tree)
    seqs = tree.sequences

    def noisy(salt):
        return [lp + torch.tensor([context_noise(s[: j + 1], salt) for j in range(1, len(s))],
                                  dtype=lp.dtype) for lp, s in zip(base, seqs)]

    return {"adv_seq": torch.randn(len(seqs), generator=gen, dtype=torch.float64).tolist(),
            "adv_tok": [torch.randn(len(s) - 1, generator=gen, dtype=torch.float64)
                        for s in seqs],
            "old": noisy(1), "ref": noisy(2)}


def joined(parts: list[dict]) -> dict:
    """The data of several trees' batches, in pack order."""
    return {key: [x for d in parts for x in d[key]] for key in parts[0]}


def rl_objective(name: str, lp: torch.Tensor, batch, data: dict) -> torch.Tensor:
    if name == "pg_sequence":
        return rl.policy_gradient_loss(lp, batch, data["adv_seq"])
    if name == "pg_token":
        return rl.policy_gradient_loss(lp, batch, data["adv_tok"])
    if name == "ppo":
        return rl.ppo_clip_loss(lp, batch, data["adv_tok"], data["old"], clip_eps=0.1)
    if name == "ppo_on_tree":  # old log-probs as one [N] tensor
        return rl.ppo_clip_loss(lp, batch, data["adv_seq"], rl.to_tree(batch, data["old"]),
                                clip_eps=0.1, clip_eps_high=0.2)
    return rl.kl_penalty(lp, batch, data["ref"], estimator=name.split("_")[1], coef=0.5)


RL_NAMES = ["pg_sequence", "pg_token", "ppo", "ppo_on_tree", "kl_k1", "kl_k2", "kl_k3"]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("name", RL_NAMES)
def test_rl_copies_and_micro_batches(tree_model, name, reduction):
    model = tree_model.model

    def value(trees, data, **pack_options):
        batch = treefx.pack(trees, reduction=reduction, **pack_options)
        return rl_objective(name, tree_model(batch).token_logprobs, batch, data)

    # 8 copies of a tree, its data repeated per copy: the objective of one copy.
    tree = odd_tree(32, VOCAB)
    data = rl_data(model, tree, seed=1)
    one = value_and_grads(model, lambda: value(tree, data))
    assert float(one[0]) != 0.0
    assert_same(value_and_grads(model, lambda: value([tree] * 8, joined([data] * 8))), one)

    # Micro-batches packed with the global count sum to the global batch.
    trees = global_batch()
    per_tree = [rl_data(model, t, seed=10 + i) for i, t in enumerate(trees)]
    total = sum(t.num_sequences for t in trees)
    want = value_and_grads(model, lambda: value(trees, joined(per_tree)))
    bounds = [0, 2, 3, len(trees)]

    def accumulated():
        return sum(value(trees[a:b], joined(per_tree[a:b]), num_sequences=total)
                   for a, b in zip(bounds, bounds[1:]))

    assert_same(value_and_grads(model, accumulated), want)


# ---------------------------------------------------------------------------- @treefx.step


def _hand_step(reduction):
    def hand_step(model, batch):
        logits = model(batch["input_ids"])
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                               reduction=reduction)

    return hand_step


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_step_copies_and_micro_batches(tree_model, reduction):
    model = tree_model.model
    step = treefx.step(_hand_step(reduction), backend="eager")
    tree = odd_tree(34, VOCAB)
    one = value_and_grads(model, lambda: step(model, treefx.pack(tree)))
    eight = value_and_grads(model, lambda: step(model, treefx.pack([tree] * 8)))
    assert_same(one, value_and_grads(model, lambda: treefx.reference.sequence_loss(
        model, tree, reduction=reduction)))
    assert_same(eight, one)

    trees = global_batch()
    total = sum(t.num_sequences for t in trees)
    want = value_and_grads(model, lambda: treefx.reference.sequence_loss(
        model, trees, reduction=reduction))
    assert_same(value_and_grads(model, lambda: step(model, treefx.pack(trees))), want)
    assert_same(value_and_grads(model, lambda: sum(
        step(model, treefx.pack(group, num_sequences=total))
        for group in micro_batches(trees, 3))), want)
