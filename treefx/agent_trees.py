"""Synthetic agent trees of a given shape, deterministic in their seed.

:func:`agent_tree` is the core's one generator of synthetic trees: the cost model samples such
trees where it measures (:meth:`treefx.distributed.CostModel.measure`). Users reach it as
``treefx.synth.agent_tree``; :mod:`treefx.tools.synth` (the datasets, the odd-shaped trees for
checks) says what shape one task has.
"""

from __future__ import annotations

import numpy as np

from .tree import Tree

__all__ = ["agent_tree"]

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
