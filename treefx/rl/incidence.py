"""Where each sequence's predicted tokens lie in the tree: the flat *path incidence* of all
sequences (:class:`PathIncidence`), built once per batch and cached."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..layout import TreeBatch

__all__ = ["PathIncidence", "path_incidence", "restricted_incidence"]


@dataclass(frozen=True, eq=False)
class PathIncidence:
    """Where each predicted token of each sequence lies in the tree, over all sequences.

    Every sequence's path through the tree, flattened: one entry per predicted baseline
    token (sequence p, position j ≥ 1), ordered by sequence, then position. T entries in all
    (the batch's baseline tokens minus one per sequence).

    - ``token`` [T]: the token's index in the DFS row.
    - ``sequence`` [T]: p, numbered over the forest as in :meth:`TreeBatch.sequence_index`.
    - ``position`` [T]: j, the token's offset in its sequence (≥ 1).
    - ``coef`` [T] float64: c_p(j) = ω_p · r_p · m_p(j) · s / P (P =
      ``batch.num_sequences_normalizer``, s = ``batch.loss_scale``); ``token_sums`` of it is
      ``batch.loss_weights``.
    - ``sequence_lengths`` [P]: tokens per sequence (L_p; each has L_p − 1 entries here).
    - ``first`` / ``first_trained`` [N]: per token, the first entry through it (among entries
      with ``coef > 0`` for the latter), −1 where there is none.
    - ``sequence_names``: how errors name sequence p ("sequence 7 (tree 1, its sequence 2)").
    """

    token: torch.Tensor
    sequence: torch.Tensor
    position: torch.Tensor
    coef: torch.Tensor
    sequence_lengths: torch.Tensor
    first: torch.Tensor
    first_trained: torch.Tensor
    num_tokens: int
    sequence_names: tuple[str, ...]

    @property
    def num_sequences(self) -> int:
        return int(self.sequence_lengths.numel())

    @property
    def trained(self) -> torch.Tensor:
        """[N] bool: tokens that some sequence trains on (some ``coef > 0`` through them)."""
        return self.first_trained >= 0


# Keyed by the batch object: a batch is immutable by convention, and `batch.to(device)` makes a
# new one (which gets its own incidence on its own device).
_INCIDENCE: weakref.WeakKeyDictionary[TreeBatch, PathIncidence] = weakref.WeakKeyDictionary()


def path_incidence(batch: TreeBatch) -> PathIncidence:
    """Build where each sequence's predicted tokens lie in the tree, once per batch.

    The flat incidence of all sequences' paths (see :class:`PathIncidence`), built once per
    batch (a loop over sequences walking node paths, the rest vectorized) and cached."""
    if not isinstance(batch, TreeBatch):
        raise TypeError(f"expected a treefx.TreeBatch (see treefx.pack), got "
                        f"{type(batch).__name__}")
    inc = _INCIDENCE.get(batch)
    if inc is None:
        inc = _build_incidence(batch)
        _INCIDENCE[batch] = inc
    return inc


def restricted_incidence(batch: TreeBatch, inc: PathIncidence,
                         mask: torch.Tensor) -> TreeBatch:
    """Give a batch the path incidence of another, restricted to the tokens of one part.

    ``batch``'s path incidence becomes ``inc`` with its coefficients zero outside ``mask``
    [N] (the tokens one part of a tree predicts, :func:`treefx.backward`): what
    :func:`path_incidence` returns for that batch from then on. ``batch`` must be a new batch
    (one made by ``dataclasses.replace``), not yet given an incidence."""
    if batch in _INCIDENCE:
        raise ValueError("restricted_incidence: the batch already has its path incidence")
    keep = mask[inc.token.to(mask.device)].to(inc.coef.device)
    coef = torch.where(keep, inc.coef, torch.zeros_like(inc.coef))
    token = inc.token.cpu().numpy()
    first_trained = _first_entry(token, (coef > 0).cpu().numpy(), inc.num_tokens)
    _INCIDENCE[batch] = replace(inc, coef=coef, first_trained=torch.as_tensor(
        first_trained, device=inc.first_trained.device))
    return batch


def _build_incidence(batch: TreeBatch) -> PathIncidence:
    node_parent = batch.node_parent.tolist()
    node_offset = batch.node_offset.cpu().numpy()
    node_length = batch.node_length.cpu().numpy()
    path_nodes: list[int] = []
    path_sizes: list[int] = []
    for end in batch.sequence_node_ends.tolist():
        path = []
        while end >= 0:
            path.append(end)
            end = node_parent[end]
        path_nodes.extend(reversed(path))
        path_sizes.append(len(path))
    nodes = np.asarray(path_nodes, dtype=np.int64)
    lengths = node_length[nodes]
    total = int(lengths.sum())
    # Entry e lies in path node n at offset e − (n's first entry): its token is offset[n] + that.
    node_first_entry = np.cumsum(lengths) - lengths
    token = np.repeat(node_offset[nodes] - node_first_entry, lengths) + np.arange(total)
    path_ends = np.cumsum(path_sizes)
    seq_lengths = np.add.reduceat(lengths, path_ends - np.asarray(path_sizes))
    num_seq = len(path_sizes)
    sequence = np.repeat(np.arange(num_seq), seq_lengths)
    position = np.arange(total) - np.repeat(np.cumsum(seq_lengths) - seq_lengths, seq_lengths)

    trees = batch.trees
    tree_lengths = np.concatenate([t.sequence_lengths for t in trees])
    if not np.array_equal(tree_lengths, seq_lengths):
        raise RuntimeError("the batch's layout does not match its trees' sequences; was the "
                           "batch built by treefx.pack and its trees left unchanged?")
    weights = np.concatenate([np.asarray(t.weights, dtype=np.float64) for t in trees])
    masks = np.concatenate([t.loss_mask(i) for t in trees for i in range(t.num_sequences)])
    predicted = position >= 1  # nothing predicts a sequence's first token
    token, sequence, position, mask = (a[predicted] for a in (token, sequence, position, masks))
    masked_count = np.bincount(sequence, weights=mask, minlength=num_seq)
    if batch.reduction == "sum":
        r = np.ones(num_seq)
    else:  # a sequence with nothing to predict adds nothing
        r = np.divide(1.0, masked_count, out=np.zeros(num_seq), where=masked_count > 0)
    coef = weights[sequence] * r[sequence] / batch.num_sequences_normalizer * batch.loss_scale \
        * mask

    n = batch.num_tokens
    first = _first_entry(token, np.ones(len(token), dtype=bool), n)
    first_trained = _first_entry(token, coef > 0, n)
    names = tuple(
        f"sequence {p}" if len(trees) == 1 else f"sequence {p} (tree {ti}, its sequence {i})"
        for p, (ti, i) in enumerate((ti, i) for ti, t in enumerate(trees)
                                    for i in range(t.num_sequences))
    )

    dev = batch.device

    def tensor(a, dtype=torch.int64):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=dev, dtype=dtype)

    return PathIncidence(
        token=tensor(token), sequence=tensor(sequence), position=tensor(position),
        coef=tensor(coef, torch.float64), sequence_lengths=tensor(seq_lengths),
        first=tensor(first), first_trained=tensor(first_trained), num_tokens=n,
        sequence_names=names,
    )


def _first_entry(token: np.ndarray, selected: np.ndarray, n: int) -> np.ndarray:
    """Per tree token, the index of the first selected entry through it, or −1."""
    out = np.full(n, -1, dtype=np.int64)
    entries = np.flatnonzero(selected)
    uniq, first = np.unique(token[entries], return_index=True)
    out[uniq] = entries[first]
    return out
