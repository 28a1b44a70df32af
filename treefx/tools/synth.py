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
"""

from __future__ import annotations

import numpy as np

from ..tree import Tree

__all__ = ["agent_tree", "dataset", "iter_dataset", "odd_forest", "odd_tree",
           "random_sequences"]

_Range = tuple[int, int]


def _length(rng: np.random.Generator, r: _Range, scale: float = 1.0) -> int:
    lo, hi = r
    return max(1, int(round(rng.integers(lo, hi + 1) * scale)))


def agent_tree(
    seed: int = 0,
    *,
    vocab_size: int = 32000,
    system_len: _Range = (150, 400),
    prompt_len: _Range = (30, 200),
    rollouts: int = 1,
    turns: _Range = (2, 5),
    think_len: _Range = (40, 300),
    answer_len: _Range = (10, 80),
    tool_len: _Range = (20, 250),
    think_mode: bool = True,
    branch_prob: float = 0.3,
    branches: _Range = (2, 3),
    max_depth: int = 2,
    mask_outputs: bool = False,
    target_por: float | None = None,
) -> Tree:
    """One synthetic agent task as a prefix tree.

    Lengths are inclusive ``(low, high)`` ranges in tokens. ``rollouts``: sampled rollouts of the
    same prompt (a GRPO group). ``branch_prob``: chance that a call forks into ``branches``
    parallel tool calls / sub-agents (at most ``max_depth`` nested forks). ``mask_outputs``: each
    sequence's loss mask covers only the tokens that call generated (as in RL on agent calls);
    otherwise masks are all ones. ``target_por``: scale the shared prompt lengths until the
    tree's POR is within 0.01 of this (a ``ValueError`` if the shape cannot reach it).
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    if vocab_size > 1 << 63:
        raise ValueError(f"vocab_size must be at most 2**63 (token ids are int64), got "
                         f"{vocab_size}")
    if rollouts < 1:
        raise ValueError(f"rollouts must be at least 1, got {rollouts}")
    if not 0.0 <= branch_prob <= 1.0:
        raise ValueError(f"branch_prob must be in [0, 1], got {branch_prob}")
    kw = dict(
        vocab_size=vocab_size,
        system_len=system_len,
        prompt_len=prompt_len,
        rollouts=rollouts,
        turns=turns,
        think_len=think_len,
        answer_len=answer_len,
        tool_len=tool_len,
        think_mode=think_mode,
        branch_prob=branch_prob,
        branches=branches,
        max_depth=max_depth,
        mask_outputs=mask_outputs,
    )
    if target_por is None:
        return _rollout_tree(seed, prefix_scale=1.0, **kw)
    if not 0.0 <= target_por < 1.0:
        raise ValueError(f"target_por must be in [0, 1), got {target_por}")
    # POR grows with the shared prompt's length; bisect its scale in log space.
    lo, hi = -6.0, 6.0
    por_lo = _rollout_tree(seed, prefix_scale=2.0**lo, **kw).por
    por_hi = _rollout_tree(seed, prefix_scale=2.0**hi, **kw).por
    if not por_lo - 0.01 <= target_por <= por_hi + 0.01:
        raise ValueError(
            f"target_por={target_por} is out of reach for this shape (POR from {por_lo:.3f} to "
            f"{por_hi:.3f} when scaling the prompt); change rollouts, turns or branching"
        )
    best = None
    for _ in range(40):
        mid = (lo + hi) / 2
        tree = _rollout_tree(seed, prefix_scale=2.0**mid, **kw)
        if best is None or abs(tree.por - target_por) < abs(best.por - target_por):
            best = tree
        if abs(tree.por - target_por) <= 0.01:
            break
        lo, hi = (mid, hi) if tree.por < target_por else (lo, mid)
    return best


def _rollout_tree(seed, *, prefix_scale, vocab_size, system_len, prompt_len, rollouts, turns,
                  think_len, answer_len, tool_len, think_mode, branch_prob, branches, max_depth,
                  mask_outputs) -> Tree:
    # Shape and token ids draw from separate streams, so the shape does not change when
    # prefix_scale does (POR then grows monotonically with it).
    rng, token_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))

    def toks(n):
        return token_rng.integers(1, vocab_size, size=n).tolist()

    sequences: list[list[int]] = []
    masks: list[list[int]] = []

    def call(context: list[int], n_turns: int, depth: int):
        """Run ``n_turns`` more model calls from ``context``; record each call."""
        if n_turns <= 0:
            return
        think = toks(_length(rng, think_len)) if think_mode else []
        answer = toks(_length(rng, answer_len))
        out = think + answer
        sequences.append(context + out)
        masks.append([0] * len(context) + [1] * len(out))
        kept = context + answer if think_mode else context + out
        fork = depth < max_depth and n_turns > 1 and rng.random() < branch_prob
        for _ in range(_length(rng, branches) if fork else 1):
            call(kept + toks(_length(rng, tool_len)), n_turns - 1, depth + fork)

    shared = toks(_length(rng, system_len, prefix_scale)) + toks(
        _length(rng, prompt_len, prefix_scale)
    )
    for _ in range(rollouts):
        call(list(shared), _length(rng, turns), 0)
    return Tree.from_sequences(sequences, loss_masks=masks if mask_outputs else None)


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
