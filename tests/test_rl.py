"""treefx.rl against the per-branch baseline: every objective written straightforwardly per
sequence and per token on the log-probabilities of the unmodified model run on each sequence
alone (treefx.reference.sequence_logprobs). Values and gradients of all parameters, float64 on
the CPU, on trees with every odd shape (prefix and duplicate sequences, single-token nodes and
sequences, random weights and loss masks, forests)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trees import odd_forest, odd_tree, random_sequences

import treefx
from treefx import rl
from treefx.models import tiny_decoder

VOCAB = 64
GRAD_RTOL = 1e-8


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Ops here are tiny: a thread pool only adds overhead, and on a busy 2-core machine
    intra-op threads stall for seconds (this module ran 4x slower with them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tree_model() -> treefx.TreeModel:
    torch.manual_seed(0)
    # A larger init than the default 0.02 so log-probabilities (and ratios) vary by token.
    model = tiny_decoder(vocab_size=VOCAB).double()
    model.reset_parameters(std=0.2)
    return treefx.compile(model, backend="eager")


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def trees_of(kind: str, seed: int) -> list[treefx.Tree]:
    return [odd_tree(seed, VOCAB)] if kind == "tree" else odd_forest(seed, VOCAB)


def sequences_and_masks(trees):
    """Per sequence over the forest: tokens, weight and loss mask."""
    return [(t.sequence(i).tolist(), float(t.weights[i]), t.loss_mask(i))
            for t in trees for i in range(t.num_sequences)]


def context_noise(prefix: list[int], salt: int, scale: float = 0.5) -> float:
    """A number in [−scale, scale] that depends only on the token and its prefix, so sequences
    sharing a token agree on it (the same context gives the same old log-probability)."""
    h = zlib.crc32(np.asarray([salt, *prefix], dtype=np.int64).tobytes())
    return scale * (2.0 * np.random.default_rng(h).random() - 1.0)


def noisy_logprobs(trees, base: list[torch.Tensor], salt: int) -> list[torch.Tensor]:
    """Per sequence, entry k = base log-prob of token k+1 plus context noise; at tokens the
    sequence does not train on, a garbage value of its own (a rollout engine's placeholder),
    which the objectives must never read."""
    out = []
    for p, ((seq, _, mask), lp) in enumerate(zip(sequences_and_masks(trees), base)):
        noise = [context_noise(seq[: j + 1], salt) for j in range(1, len(seq))]
        values = lp.detach() + torch.tensor(noise, dtype=lp.dtype)
        values[torch.as_tensor(mask[1:]) == 0] = 100.0 + p
        out.append(values)
    return out


def random_advantages(trees, kind: str, seed: int):
    """Both signs; every sequence its own, so sequences sharing a prefix disagree."""
    gen = torch.Generator().manual_seed(seed)
    seqs = sequences_and_masks(trees)
    if kind == "sequence":
        return torch.randn(len(seqs), generator=gen, dtype=torch.float64)
    return [torch.randn(len(s) - 1, generator=gen, dtype=torch.float64) for s, _, _ in seqs]


def advantage_of(advantages, p: int, length: int) -> torch.Tensor:
    """Sequence p's advantages per predicted token (a per-sequence scalar broadcast)."""
    if isinstance(advantages, torch.Tensor):
        return advantages[p].expand(length - 1)
    return advantages[p]


def per_branch(trees, logprobs: list[torch.Tensor], reduction: str, term) -> torch.Tensor:
    """The baseline  (1/P) Σ_p ω_p r_p Σ_{j≥1} m_p(j) f_p(j), one sequence at a time, P the
    number of sequences of all trees.

    ``term(p, lp)`` gives f_p for sequence p from its own log-probs lp [L_p − 1]."""
    total = torch.zeros((), dtype=torch.float64)
    seqs = sequences_and_masks(trees)
    for p, ((seq, weight, mask), lp) in enumerate(zip(seqs, logprobs)):
        m = torch.as_tensor(mask[1:], dtype=lp.dtype)
        r = 1.0
        if reduction == "mean":
            r = 1.0 / float(m.sum()) if float(m.sum()) > 0 else 0.0
        total = total + weight * r * (m * term(p, lp)).sum()
    return total / len(seqs)


def check_against_baseline(tm, trees, reduction, tree_objective, branch_term):
    """The tree objective and the gradients of all parameters equal the per-branch baseline."""
    model = tm.model
    model.zero_grad(set_to_none=True)
    batch = treefx.pack(trees, reduction=reduction)
    value = tree_objective(tm(batch).token_logprobs, batch)
    value.backward()
    g_tree = grads(model)
    baseline = per_branch(trees, treefx.reference.sequence_logprobs(model, trees), reduction,
                          branch_term)
    baseline.backward()
    g_ref = grads(model)
    torch.testing.assert_close(value, baseline, rtol=1e-10, atol=1e-12)
    assert g_tree.keys() == g_ref.keys() and g_ref
    for name, g in g_ref.items():
        err = (g_tree[name] - g).norm() / g.norm().clamp_min(1e-30)
        assert err <= GRAD_RTOL, f"gradient of {name} off by {err:.2e} (relative)"
    return batch


_BASELINE_CACHE: dict = {}


def baseline_logprobs(model, trees) -> list[torch.Tensor]:
    """No-grad per-sequence log-probs (the base of old/reference log-probs), cached: the
    tests never change the parameters."""
    key = (id(model), tuple(tuple(s) for t in trees for s in t.sequences))
    if key not in _BASELINE_CACHE:
        with torch.no_grad():
            _BASELINE_CACHE[key] = treefx.reference.sequence_logprobs(model, trees)
    return _BASELINE_CACHE[key]


CASES = [(kind, reduction, adv) for kind in ("tree", "forest") for reduction in ("sum", "mean")
         for adv in ("sequence", "token")]
IDS = [f"{k}-{r}-adv_per_{a}" for k, r, a in CASES]
CLIPS = {"sym": (0.2, None), "clip_higher": (0.1, 0.28)}
PPO_CASES = [(*case, clip) for case in CASES for clip in CLIPS]
PPO_IDS = [f"{i}-{clip}" for i in IDS for clip in CLIPS]


@pytest.mark.parametrize("kind,reduction,adv_kind", CASES, ids=IDS)
def test_policy_gradient_matches_baseline(tree_model, kind, reduction, adv_kind):
    trees = trees_of(kind, 1)
    adv = random_advantages(trees, adv_kind, seed=2)

    def branch_term(p, lp):
        return -advantage_of(adv, p, lp.numel() + 1) * lp

    check_against_baseline(tree_model, trees, reduction,
                           lambda lp, b: rl.policy_gradient_loss(lp, b, adv), branch_term)


@pytest.mark.parametrize("kind,reduction,adv_kind,clip", PPO_CASES, ids=PPO_IDS)
def test_ppo_clip_matches_baseline(tree_model, kind, reduction, adv_kind, clip):
    eps, eps_high = CLIPS[clip]
    trees = trees_of(kind, 3)
    adv = random_advantages(trees, adv_kind, seed=4)
    old = noisy_logprobs(trees, baseline_logprobs(tree_model.model, trees), salt=1)
    upper = eps if eps_high is None else eps_high

    def branch_term(p, lp):
        a = advantage_of(adv, p, lp.numel() + 1)
        ratio = torch.exp(lp - old[p])
        return -torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + upper) * a)

    stats = {}

    def tree_objective(lp, batch):
        loss, stats_ = rl.ppo_clip_loss(lp, batch, adv, old, clip_eps=eps, clip_eps_high=eps_high,
                                        return_stats=True)
        stats.update(stats_)
        return loss

    batch = check_against_baseline(tree_model, trees, reduction, tree_objective, branch_term)

    # The case is a real test of the split: ratios clip on both sides, some not at all, and
    # some shared trained token carries advantages of both signs.
    inc = rl.path_incidence(batch)
    flat_adv = torch.cat([advantage_of(adv, p, int(n)) for p, n in
                          enumerate(inc.sequence_lengths)])
    ratio = torch.exp(torch.cat(baseline_logprobs(tree_model.model, trees)) - torch.cat(old))
    trained = inc.coef > 0
    assert bool((trained & (ratio > 1 + upper)).any()) and bool((trained & (ratio < 1 - eps)).any())
    assert bool((trained & (ratio > 1 - eps) & (ratio < 1 + upper)).any())
    pos = rl.token_sums(batch, [(a > 0).double() for a in flat_adv.split(
        (inc.sequence_lengths - 1).tolist())])
    neg = rl.token_sums(batch, [(a < 0).double() for a in flat_adv.split(
        (inc.sequence_lengths - 1).tolist())])
    assert bool(((pos > 0) & (neg > 0)).any())

    # Stats against the same quantities per baseline token.
    cut = ((flat_adv > 0) & (ratio > 1 + upper)) | ((flat_adv < 0) & (ratio < 1 - eps))
    c = inc.coef
    torch.testing.assert_close(stats["clip_fraction"], (c * cut).sum() / c.sum())
    assert 0 < float(stats["clip_fraction"]) < 1
    log_ratio = torch.log(ratio).where(trained, torch.zeros_like(ratio))
    torch.testing.assert_close(stats["approx_kl"],
                               (c * (ratio.where(trained, torch.ones_like(ratio)) - 1
                                     - log_ratio)).sum() / c.sum())


@pytest.mark.parametrize("kind", ["tree", "forest"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_matches_baseline(tree_model, kind, reduction, estimator):
    trees = trees_of(kind, 5)
    ref = noisy_logprobs(trees, baseline_logprobs(tree_model.model, trees), salt=2)

    def branch_term(p, lp):
        d = ref[p] - lp
        return 0.7 * {"k1": -d, "k2": d**2 / 2, "k3": torch.exp(d) - d - 1}[estimator]

    check_against_baseline(
        tree_model, trees, reduction,
        lambda lp, b: rl.kl_penalty(lp, b, ref, estimator=estimator, coef=0.7), branch_term,
    )


def test_on_policy_ppo_is_policy_gradient(tree_model):
    """With old = current log-probs, ρ = 1 and ∇ρ = ∇log π: PPO's value is −Σ w A and its
    gradient the policy gradient's (old is detached, or the ratio's gradient would vanish)."""
    trees = odd_forest(6, VOCAB)
    batch = treefx.pack(trees, reduction="mean")
    adv = random_advantages(trees, "token", seed=7)
    model = tree_model.model
    out = tree_model(batch)
    rl.policy_gradient_loss(out.token_logprobs, batch, adv).backward()
    g_pg = grads(model)
    out = tree_model(batch)
    loss = rl.ppo_clip_loss(out.token_logprobs, batch, adv, out.token_logprobs)
    loss.backward()
    g_ppo = grads(model)
    torch.testing.assert_close(loss, -rl.token_sums(batch, adv).sum())
    for name, g in g_pg.items():
        torch.testing.assert_close(g_ppo[name], g, rtol=1e-10, atol=1e-14)


def test_old_logprobs_on_the_tree_or_per_sequence_agree(tree_model):
    trees = odd_forest(8, VOCAB)
    batch = treefx.pack(trees, reduction="mean")
    base = baseline_logprobs(tree_model.model, trees)
    old = noisy_logprobs(trees, base, salt=3)
    adv = random_advantages(trees, "sequence", seed=9)
    with torch.no_grad():
        lp = tree_model(batch).token_logprobs
    old_tree = rl.to_tree(batch, old)
    assert old_tree.shape == lp.shape
    for fn in (lambda o: rl.ppo_clip_loss(lp, batch, adv, o),
               lambda o: rl.kl_penalty(lp, batch, o, estimator="k3")):
        torch.testing.assert_close(fn(old), fn(old_tree), rtol=1e-12, atol=0)


def test_to_tree_and_token_sums(tree_model):
    trees = odd_forest(10, VOCAB)
    for reduction in ("sum", "mean"):
        batch = treefx.pack(trees, reduction=reduction, weight_dtype=torch.float64,
                            pad_to_multiple=16)
        torch.testing.assert_close(rl.token_sums(batch), batch.loss_weights, rtol=1e-12, atol=0)
    base = baseline_logprobs(tree_model.model, trees)
    with torch.no_grad():
        lp = tree_model(batch).token_logprobs
    # Context-determined values land on their tokens; tokens nothing predicts get the fill.
    mapped = rl.to_tree(batch, base, fill=-7.0, trained_only=False)
    predicted = torch.zeros(batch.num_tokens, dtype=torch.bool)
    for p in range(batch.num_sequences):
        predicted[batch.sequence_index(p)[1:]] = True
    torch.testing.assert_close(mapped[predicted], lp[predicted], rtol=0, atol=1e-10)
    assert torch.all(mapped[~predicted] == -7.0)
    # Unweighted sums of ones count the sequences through each predicted token.
    counts = rl.token_sums(batch, [torch.ones(len(b)) for b in base], weighted=False)
    expected = torch.zeros(batch.num_tokens, dtype=counts.dtype)
    for p in range(batch.num_sequences):
        expected[batch.sequence_index(p)[1:]] += 1
    assert torch.equal(counts, expected)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000), reduction=st.sampled_from(["sum", "mean"]),
       pad=st.sampled_from([None, 8]), per_token=st.booleans())
def test_ppo_algebra_on_random_trees(seed, reduction, pad, per_token):
    """The tree formula against the per-branch one with log-probs taken straight from the tree
    (no model): values and gradients on many shapes, padding included."""
    rng = np.random.default_rng(seed)
    seqs = random_sequences(seed, vocab=5, n=int(rng.integers(1, 9)), max_len=8)
    masks = [(rng.random(len(s)) < 0.7).astype(int).tolist() for s in seqs]
    tree = treefx.Tree.from_sequences(seqs, weights=rng.uniform(0, 1, len(seqs)),
                                      loss_masks=masks)
    batch = treefx.pack(tree, reduction=reduction, pad_to_multiple=pad)
    n = batch.num_tokens
    lp = torch.tensor(-rng.uniform(0.1, 3.0, n), requires_grad=True)
    old_tree = lp.detach() + torch.tensor(rng.uniform(-0.5, 0.5, n))
    index = [batch.sequence_index(p)[1:] for p in range(batch.num_sequences)]
    old = [old_tree[i] for i in index]
    adv = ([torch.tensor(rng.normal(size=len(i))) for i in index] if per_token
           else torch.tensor(rng.normal(size=len(index))))

    loss = rl.ppo_clip_loss(lp, batch, adv, old, clip_eps=0.2)
    (g_tree,) = torch.autograd.grad(loss, lp)
    if all(len(s) == 1 for s in seqs):  # nothing is predicted: both are 0 and constant
        assert float(loss) == 0.0 and not bool(g_tree.any())
        return

    def term(p, lp_p):
        a = advantage_of(adv, p, lp_p.numel() + 1)
        ratio = torch.exp(lp_p - old[p])
        return -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)

    baseline = per_branch([tree], [lp[i] for i in index], reduction, term)
    (g_ref,) = torch.autograd.grad(baseline, lp)
    torch.testing.assert_close(loss, baseline, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_tree, g_ref, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def small():
    """A tree without masks (every shared token is trained by every sequence through it)."""
    tree = odd_tree(11, VOCAB, masks=False)
    batch = treefx.pack(tree, reduction="mean")
    lengths = [len(s) for s in tree.sequences]
    lp = torch.zeros(batch.num_tokens, dtype=torch.float64)
    old = [torch.zeros(n - 1, dtype=torch.float64) for n in lengths]
    return tree, batch, lp, old


def test_bad_advantages_raise(small):
    tree, batch, lp, _ = small
    p = batch.num_sequences
    with pytest.raises(ValueError, match=rf"advantages has shape \[{p}, 1\] .* {p} sequences"):
        rl.policy_gradient_loss(lp, batch, torch.zeros(p, 1))
    with pytest.raises(ValueError, match=rf"advantages has shape \[{p + 1}\]"):
        rl.policy_gradient_loss(lp, batch, torch.zeros(p + 1))
    with pytest.raises(ValueError, match=rf"advantages has {p - 1} entries but the batch holds"):
        rl.policy_gradient_loss(lp, batch, [0.0] * (p - 1))
    adv = [torch.zeros(len(s) - 1) for s in tree.sequences]
    adv[3] = torch.zeros(len(tree.sequences[3]))  # one per token instead of per predicted token
    n = len(tree.sequences[3])
    with pytest.raises(ValueError, match=rf"advantages\[3\] has shape \[{n}\] but sequence 3 has "
                                         rf"{n} tokens, so {n - 1} predicted"):
        rl.ppo_clip_loss(lp, batch, adv, lp)
    with pytest.raises(ValueError, match=r"advantages\[0\] is a single number"):
        rl.policy_gradient_loss(lp, batch, [0.0] + adv[1:])
    with pytest.raises(TypeError, match="advantages must be"):
        rl.policy_gradient_loss(lp, batch, "high")


def test_bad_logprobs_raise(small):
    tree, batch, lp, old = small
    adv = torch.zeros(batch.num_sequences)
    with pytest.raises(ValueError, match=rf"old_logprobs has shape \[{batch.num_tokens + 1}\]; "
                                         rf"give it on the tree, shape \[{batch.num_tokens}\]"):
        rl.ppo_clip_loss(lp, batch, adv, torch.zeros(batch.num_tokens + 1))
    bad = list(old)
    bad[2] = torch.zeros(len(old[2]) + 1)
    with pytest.raises(ValueError, match=r"ref_logprobs\[2\] has shape .* but sequence 2 has"):
        rl.kl_penalty(lp, batch, bad)
    with pytest.raises(ValueError, match=r"ref_logprobs has 1 entries but the batch holds"):
        rl.kl_penalty(lp, batch, old[:1])
    with pytest.raises(ValueError, match=r"old_logprobs\[0\] is a single number"):
        rl.ppo_clip_loss(lp, batch, adv, [0.0] * batch.num_sequences)
    with pytest.raises(ValueError, match=r"token_logprobs has shape \[3\] but the batch has"):
        rl.policy_gradient_loss(lp[:3], batch, adv)


def test_bad_options_raise(small):
    _, batch, lp, old = small
    adv = torch.zeros(batch.num_sequences)
    with pytest.raises(ValueError, match=r"estimator must be one of \('k1', 'k2', 'k3'\), got"):
        rl.kl_penalty(lp, batch, old, estimator="k4")
    with pytest.raises(ValueError, match="clip_eps must be a finite non-negative number, got -0.1"):
        rl.ppo_clip_loss(lp, batch, adv, old, clip_eps=-0.1)
    with pytest.raises(ValueError, match="clip_eps_high must be a finite non-negative number"):
        rl.ppo_clip_loss(lp, batch, adv, old, clip_eps_high=float("nan"))


def test_inconsistent_old_logprobs_for_a_shared_context_raise(small):
    tree, batch, lp, old = small
    adv = torch.ones(batch.num_sequences)
    # Sequence 9 duplicates sequence 7 (see tests/trees.py): every token of it is shared.
    assert tree.sequences[9] == tree.sequences[7]
    bad = [o.clone() for o in old]
    bad[9][1] = 0.1
    with pytest.raises(ValueError, match=r"old_logprobs disagree on a shared token: sequence 7 "
                                         r"has 0 and sequence 9 has 0\.1 at token 2"):
        rl.ppo_clip_loss(lp, batch, adv, bad)
    with pytest.raises(ValueError, match="ref_logprobs disagree on a shared token"):
        rl.kl_penalty(lp, batch, bad)
    bad[9][1] = float("nan")
    with pytest.raises(ValueError, match=r"sequence 9, token 2: value nan is not finite"):
        rl.ppo_clip_loss(lp, batch, adv, bad)
    # Within the tolerance (rollout engines are not bit-exact), it goes through.
    bad[9][1] = 1e-4
    rl.ppo_clip_loss(lp, batch, adv, bad)


def test_placeholders_where_nothing_trains_are_ignored():
    """Old log-probs of context tokens a sequence does not train on are often placeholders
    (0 or missing) in rollout data: they neither raise nor change the loss."""
    tree = odd_tree(12, VOCAB)
    batch = treefx.pack(tree)
    lp = torch.zeros(batch.num_tokens, dtype=torch.float64)
    adv = torch.ones(batch.num_sequences)
    clean = [torch.zeros(len(s) - 1, dtype=torch.float64) for s in tree.sequences]
    garbage = [c.clone() for c in clean]
    for p, g in enumerate(garbage):
        g[torch.as_tensor(tree.loss_mask(p)[1:]) == 0] = 1e4 + p
    assert any(bool((g != 0).any()) for g in garbage)
    torch.testing.assert_close(rl.ppo_clip_loss(lp, batch, adv, garbage),
                               rl.ppo_clip_loss(lp, batch, adv, clean))
    with pytest.raises(ValueError, match="disagree on a shared token"):
        rl.to_tree(batch, garbage, trained_only=False)


def test_forest_errors_name_the_tree(tree_model):
    trees = odd_forest(13, VOCAB)
    batch = treefx.pack(trees)
    lengths = [len(s) for t in trees for s in t.sequences]
    adv = [torch.zeros(n - 1) for n in lengths]
    p = trees[0].num_sequences + 1  # the second sequence of the second tree
    adv[p] = torch.zeros(0 if lengths[p] > 1 else 3)
    with pytest.raises(ValueError, match=rf"sequence {p} \(tree 1, its sequence 1\) has"):
        rl.policy_gradient_loss(torch.zeros(batch.num_tokens), batch, adv)


# ---------------------------------------------------------------------- non-finite inputs


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_advantages_per_sequence_raise(small, bad):
    """A NaN advantage would make the loss NaN through a 0 · NaN weight, with no error; GRPO's
    group normalization gives one whenever a group's rewards are all equal."""
    tree, batch, lp, old = small
    adv = torch.zeros(batch.num_sequences, dtype=torch.float64)
    adv[3] = bad
    message = rf"advantages\[3\] \(sequence 3\) is {bad}, not finite; GRPO's"
    for objective in (lambda a: rl.policy_gradient_loss(lp, batch, a),
                      lambda a: rl.ppo_clip_loss(lp, batch, a, old),
                      lambda a: rl.ppo_clip_loss(lp, batch, a, lp)):
        with pytest.raises(ValueError, match=message):
            objective(adv)
        with pytest.raises(ValueError, match=message):
            objective(adv.tolist())  # a list of numbers
        with pytest.raises(ValueError, match=message):
            objective(adv.numpy())
    # A one-token sequence has nothing to predict, but its advantage is still checked.
    one = [i for i, s in enumerate(tree.sequences) if len(s) == 1]
    assert one
    adv = torch.zeros(batch.num_sequences)
    adv[one[0]] = float("nan")
    with pytest.raises(ValueError, match=rf"advantages\[{one[0]}\]"):
        rl.policy_gradient_loss(lp, batch, adv)


def test_grpo_group_of_equal_rewards_raises(small):
    tree, batch, lp, old = small
    rewards = torch.ones(batch.num_sequences)
    adv = (rewards - rewards.mean()) / rewards.std()  # 0 / 0
    assert bool(adv.isnan().all())
    with pytest.raises(ValueError, match=r"advantages\[0\] \(sequence 0\) is nan.*std 0"):
        rl.ppo_clip_loss(lp, batch, adv, old)


def test_non_finite_advantages_per_token_raise_naming_the_token(small):
    tree, batch, lp, old = small
    adv = [torch.zeros(len(s) - 1, dtype=torch.float64) for s in tree.sequences]
    p = next(i for i, s in enumerate(tree.sequences) if len(s) >= 4)
    adv[p][2] = float("inf")
    token = int(batch.sequence_index(p)[3])
    with pytest.raises(ValueError, match=rf"advantages\[{p}\] \(sequence {p}\), entry 2 \(token 3, "
                                         rf"tree token {token}\): value inf is not finite"):
        rl.policy_gradient_loss(lp, batch, adv)
    with pytest.raises(ValueError, match=rf"values\[{p}\] \(sequence {p}\), entry 2"):
        rl.token_sums(batch, adv)
    with pytest.raises(ValueError, match=rf"values\[{p}\] \(sequence {p}\), entry 2"):
        rl.token_sums(batch, adv, weighted=False)
    with pytest.raises(ValueError, match=r"values\[1\] \(sequence 1\) is nan, not finite"):
        rl.token_sums(batch, [0.0, float("nan")] + [0.0] * (batch.num_sequences - 2))


@pytest.mark.parametrize("which", ["old", "ref"])
def test_non_finite_logprobs_on_the_tree_raise_naming_the_token(small, which):
    """Old/reference log-probs given as one [N] tensor: checked on every token the loss reads,
    as the per-sequence form always was."""
    tree, batch, lp, _ = small
    adv = torch.ones(batch.num_sequences, dtype=torch.float64)
    inc = rl.path_incidence(batch)
    trained = inc.trained.nonzero()[:, 0]
    t = int(trained[len(trained) // 2])
    values = torch.zeros(batch.num_tokens, dtype=torch.float64)
    values[t] = float("nan")
    # The sequence the error names runs through the token, at the position it names.
    e = int(inc.first_trained[t])
    p, j = int(inc.sequence[e]), int(inc.position[e])
    assert int(batch.sequence_index(p)[j]) == t
    name = "old_logprobs" if which == "old" else "ref_logprobs"
    message = (rf"{name}: tree token {t} \(token {j} of sequence {p}, among others through it\) "
               r"is nan, not finite")
    with pytest.raises(ValueError, match=message):
        if which == "old":
            rl.ppo_clip_loss(lp, batch, adv, values)
        else:
            rl.kl_penalty(lp, batch, values, estimator="k3")


def test_non_finite_logprobs_where_nothing_trains_are_ignored():
    """Padding and tokens no sequence trains on are never read: a NaN there neither raises nor
    changes the loss (rollout engines leave placeholders on context tokens)."""
    tree = odd_tree(14, VOCAB)
    batch = treefx.pack(tree, reduction="mean", pad_to_multiple=16)
    inc = rl.path_incidence(batch)
    assert batch.num_padding > 0 and bool((~inc.trained[: batch.num_real_tokens]).any())
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(batch.num_tokens, generator=gen, dtype=torch.float64)
    old = lp + 0.1 * torch.randn(batch.num_tokens, generator=gen, dtype=torch.float64)
    adv = torch.randn(batch.num_sequences, generator=gen, dtype=torch.float64)
    garbage = torch.where(inc.trained, old, torch.full_like(old, float("nan")))
    torch.testing.assert_close(rl.ppo_clip_loss(lp, batch, adv, garbage),
                               rl.ppo_clip_loss(lp, batch, adv, old), rtol=0, atol=0)
    torch.testing.assert_close(rl.kl_penalty(lp, batch, garbage, estimator="k2"),
                               rl.kl_penalty(lp, batch, old, estimator="k2"), rtol=0, atol=0)
    assert torch.isfinite(rl.ppo_clip_loss(lp, batch, adv, garbage))
