"""What the objectives take, read from the trees' metadata (:func:`from_metadata`), and GRPO's
group-normalized advantages from their rewards (:func:`grpo_advantages`)."""

from __future__ import annotations

import numbers

import numpy as np
import torch

from ..layout import TreeBatch
from ..tree import Tree

__all__ = ["from_metadata", "grpo_advantages"]

_METADATA_HINTS = {
    "logprobs": "; treefx.data.from_ids records them from calls with logprobs",
    "rewards": "; treefx.data.group(rollouts, rewards=...) records one per rollout",
    "advantages": ("; compute them on the whole group and store them: "
                   "tree.with_metadata(advantages=rl.grpo_advantages(tree).tolist())"),
}


def from_metadata(batch: TreeBatch, key: str):
    """Read per-sequence metadata of a batch's trees (rewards, advantages, log-probs) as tensors.

    Per-sequence metadata of the batch's trees (``tree.metadata[key]``), in the batch's
    sequence order and the forms the objectives take: one number per sequence (rewards,
    GRPO advantages) as a [P] float64 tensor; per-token values (sampling ``"logprobs"``,
    per-token advantages: ``len(sequence) − 1`` each, entry k for token k + 1) as a list of P
    float64 tensors, NaN where a tree has none (the objectives read only trained tokens, and
    check those). Trees that hold one number per sequence beside trees that hold per-token
    values: the numbers are repeated over the tokens. Every tree must have the key.

    ``rl.ppo_clip_loss(lp, batch, advantages, from_metadata(batch, "logprobs"))`` trains
    against the log-probabilities the rollouts were sampled with; a token two calls both
    sampled (GRPO rollouts beginning alike) must have agreeing values, see :func:`to_tree`.
    """
    if not isinstance(batch, TreeBatch):
        raise TypeError(f"expected a treefx.TreeBatch (see treefx.pack), got "
                        f"{type(batch).__name__}")
    values = []
    for ti, tree in enumerate(batch.trees):
        if key not in tree.metadata:
            raise ValueError(f"tree {ti} of the batch has no metadata {key!r} (it has "
                             f"{sorted(tree.metadata)}){_METADATA_HINTS.get(key, '')}")
        v = tree.metadata[key]
        lengths = tree.sequence_lengths.tolist()
        try:
            if isinstance(v, np.ndarray) or all(isinstance(x, numbers.Real) for x in v):
                per_seq = np.asarray(v, dtype=np.float64)
                if per_seq.shape != (tree.num_sequences,):
                    raise ValueError(f"has shape {list(per_seq.shape)}")
                values.append(per_seq)
            else:
                per_tok = [np.asarray(x, dtype=np.float64) for x in v]
                if len(per_tok) != tree.num_sequences or any(
                        x.shape != (n - 1,) for x, n in zip(per_tok, lengths)):
                    raise ValueError("does not hold len(sequence) − 1 values per sequence")
                values.append(per_tok)
        except (TypeError, ValueError) as e:
            raise ValueError(f"tree {ti}: metadata {key!r} is neither one number per "
                             f"sequence nor per-token values of its sequences ({e})") from None
    if all(isinstance(v, np.ndarray) for v in values):
        return torch.from_numpy(np.concatenate(values))
    out = []
    for tree, v in zip(batch.trees, values):
        if isinstance(v, np.ndarray):
            v = [np.full(int(n) - 1, x) for x, n in zip(v.tolist(), tree.sequence_lengths)]
        out.extend(torch.from_numpy(np.array(x)) for x in v)
    return out


def grpo_advantages(trees, *, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """GRPO's group-normalized advantages, one per sequence, from the trees' rewards.

    GRPO's group-normalized advantages from the trees' metadata, one per sequence: for a
    sequence of rollout g, ``A = (R_g − mean R) / (std R + eps)`` over the rollouts of its group
    (``scale=False``: ``R_g − mean R``, Dr. GRPO), as a [P] float64 tensor in the order of the
    trees' sequences.

    ``trees``: a tree, a list of trees or a :class:`TreeBatch`. A group is the trees that share
    a task id (metadata ``"task"``; a tree without one is a group of its own), its rollouts are
    given by ``"rollouts"`` (each sequence its own rollout where a tree has none), and every
    sequence of a rollout must carry the same ``"rewards"`` entry: the rollout's reward, counted
    once however many calls the rollout made. ``std`` is the sample standard deviation (as in
    TRL and verl); a group of one rollout gets advantage 0.

    Compute advantages over whole groups: on a part of a group (a tree split by
    :func:`treefx.partition`) the mean and std would be the part's. Store them on the tree
    first (``tree.with_metadata(advantages=grpo_advantages(tree).tolist())``) and read them per
    part with :func:`from_metadata`.
    """
    if isinstance(trees, TreeBatch):
        trees = trees.trees
    elif isinstance(trees, Tree):
        trees = [trees]
    trees = list(trees)
    if not trees or not all(isinstance(t, Tree) for t in trees):
        raise TypeError("trees must be a treefx.Tree, a list of them or a TreeBatch")
    if not (isinstance(eps, numbers.Real) and np.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite non-negative number, got {eps!r}")
    # (group, rollout) of every sequence, and each rollout's reward
    keys, reward_of = [], {}
    for ti, t in enumerate(trees):
        if "rewards" not in t.metadata:
            raise ValueError(f"tree {ti} has no metadata 'rewards'{_METADATA_HINTS['rewards']}")
        task = t.metadata.get("task")
        group = ("task", task) if task is not None else ("tree", ti)
        rollouts = t.metadata.get("rollouts", range(t.num_sequences))
        for p, (r, reward) in enumerate(zip(rollouts, t.metadata["rewards"].tolist())):
            rollout = (group, ti, r)
            seen = reward_of.setdefault(rollout, (reward, p))
            if seen[0] != reward:
                raise ValueError(
                    f"tree {ti}: sequences {seen[1]} and {p} are calls of one rollout ({r!r}) "
                    f"but carry different rewards ({seen[0]} and {reward}); a rollout has one "
                    "reward")
            keys.append(rollout)
    by_group: dict = {}
    for rollout, (reward, _) in reward_of.items():
        by_group.setdefault(rollout[0], []).append(reward)
    stats = {}
    for group, rewards in by_group.items():
        r = np.asarray(rewards, dtype=np.float64)
        std = float(r.std(ddof=1)) if r.size > 1 else 0.0
        stats[group] = (float(r.mean()), std)
    adv = np.empty(len(keys))
    for k, rollout in enumerate(keys):
        mean, std = stats[rollout[0]]
        a = reward_of[rollout][0] - mean
        adv[k] = a / (std + eps) if scale and std + eps > 0 else a
    return torch.from_numpy(adv)
