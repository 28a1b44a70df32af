"""The :class:`Tree` itself: built from token lists or from its nodes, its views (sizes,
sequences, masks), its subtrees, and its record (:meth:`Tree.to_dict` / :meth:`Tree.from_dict`);
:func:`por` and :func:`bound` of a tree or a list of them. What it is built from is checked in
:mod:`treefx.tree.inputs` and :mod:`treefx.tree.nodes`, its metadata in
:mod:`treefx.tree.metadata`."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

import numpy as np

from .inputs import (as_mask_array, as_token_array, as_weights, frozen, loss_mask_arrays,
                     mask_from_runs, mask_runs)
from .metadata import (EMPTY_METADATA, NODE_KEYS, SEQUENCE_KEYS, STRUCTURE_KEYS, set_metadata,
                       thaw, values_equal)
from .nodes import (build_trie, check_every_node_on_a_sequence, check_parents, check_siblings,
                    node_sequence_ends)

__all__ = ["Tree", "bound", "por"]


class Tree:
    """A prefix tree of token sequences with per-sequence weights and loss masks.

    Build one with :meth:`from_sequences` (trie-merge token lists) or :meth:`from_nodes` (give
    the segments and their parents). A tree does not change once built: its arrays are
    private copies marked read-only (``flags.writeable`` is False) and its attributes cannot be
    reassigned, so a batch packed from it, and everything computed later from the batch's
    trees (:mod:`treefx.rl`), always see the same data. Attributes:

    - ``segments``: tuple of int64 arrays, the tokens of each node;
    - ``parents``: int64 array, parent node of each node (-1 for a root), ``parents[i] < i``;
    - ``sequence_ends``: int64 array, the node each sequence ends in (at that node's last token);
    - ``weights``: float64 array, one weight ω_p per sequence (default 1.0). The loss of a
      batch is ``(1/P) Σ_p ω_p · (sequence p's loss)`` with P the batch's sequence count (see
      :func:`treefx.pack`), so the default is the plain mean over sequences;
    - ``loss_masks``: tuple of float64 0/1 arrays, one per sequence, one entry per token, or
      None (all ones).
    """

    __slots__ = (
        "segments",
        "parents",
        "sequence_ends",
        "weights",
        "loss_masks",
        "metadata",
        "_node_start",
        "_sequences",
    )

    def __init__(self, segments, parents, sequence_ends, weights, loss_masks, *, _checked=False):
        # Private: use from_sequences / from_nodes, which validate. Metadata is checked against
        # the built tree's sequence lengths, then set by set_metadata.
        if not _checked:
            raise TypeError("build a Tree with Tree.from_sequences or Tree.from_nodes")
        # Own, read-only copies: segments may be views of the caller's arrays.
        init = object.__setattr__
        init(self, "segments", tuple(frozen(s, np.int64) for s in segments))
        init(self, "parents", frozen(parents, np.int64))
        init(self, "sequence_ends", frozen(sequence_ends, np.int64))
        init(self, "weights", frozen(weights, np.float64))
        init(self, "loss_masks", None if loss_masks is None
             else tuple(frozen(m, np.float64) for m in loss_masks))
        start = np.zeros(len(segments), dtype=np.int64)
        lens = self.segment_lengths
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                start[i] = start[p] + lens[p]
        start.flags.writeable = False
        init(self, "_node_start", start)  # position (depth) of each node's first token
        init(self, "_sequences", None)
        init(self, "metadata", EMPTY_METADATA)

    def __setattr__(self, name, value):
        raise AttributeError(
            f"a Tree does not change once built (setting {name!r}); build a new one with "
            "Tree.from_sequences / Tree.from_nodes (or tree.subtree for some of its sequences)"
        )

    def __delattr__(self, name):
        raise AttributeError(f"a Tree does not change once built (deleting {name!r})")

    def __reduce__(self):
        # Pickle and copy through the constructor (the default slot-by-slot restore would set
        # attributes); a copy is a Tree of its own, read-only again. Metadata travels as plain
        # data (a read-only mapping does not pickle) and is frozen again.
        return (rebuild_tree, (list(self.segments), self.parents, self.sequence_ends,
                                self.weights, None if self.loss_masks is None
                                else list(self.loss_masks), thaw(self.metadata, json=False)))

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_sequences(cls, sequences, *, weights=None, loss_masks=None, metadata=None) -> Tree:
        """Trie-merge token lists into a prefix tree whose nodes are maximal shared segments.

        ``sequences``: the token id lists (each model call of a rollout). ``weights``: one
        non-negative weight ω_p per sequence, kept as given (default 1.0; the batch loss divides
        by the sequence count, see :func:`treefx.pack`). ``loss_masks``: one 0/1 list per
        sequence, as long as the sequence (default all ones). ``metadata``: a mapping (see the
        module's docstring), its per-sequence entries in the order of ``sequences``. Sequences
        that are prefixes of, or equal to, others still count as their own paths.
        """
        if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Iterable):
            raise TypeError("sequences must be a list of token id lists")
        seqs = [as_token_array(s, f"sequence {i}") for i, s in enumerate(sequences)]
        if not seqs:
            raise ValueError("sequences is empty; a tree needs at least one sequence")
        w = as_weights(weights, len(seqs))
        masks = None
        if loss_masks is not None:
            if isinstance(loss_masks, (str, bytes)) or not isinstance(loss_masks, Iterable):
                raise TypeError("loss_masks must be a list of 0/1 lists, one per sequence")
            loss_masks = list(loss_masks)
            if len(loss_masks) != len(seqs):
                raise ValueError(
                    f"loss_masks has {len(loss_masks)} entries but there are {len(seqs)} sequences"
                )
            masks = [
                as_mask_array(m, len(s), f"loss mask of sequence {i}")
                for i, (m, s) in enumerate(zip(loss_masks, seqs))
            ]
        segments, parents, ends = build_trie(seqs)
        return set_metadata(cls(segments, parents, ends, w, masks, _checked=True), metadata)

    @classmethod
    def from_nodes(
        cls, segments, parents, *, sequence_ends=None, weights=None, loss_masks=None,
        metadata=None,
    ) -> Tree:
        """A tree given explicitly: ``segments[i]`` holds node i's tokens, ``parents[i]`` its
        parent node (-1 for a root), and every parent comes before its children.

        ``sequence_ends`` lists, per sequence, the node it ends in (default: one sequence per
        leaf, in node order). ``weights``, ``loss_masks`` and ``metadata`` are per sequence, as
        in :meth:`from_sequences`. Every node must lie on at least one sequence.
        """
        segs = [as_token_array(s, f"segment {i}") for i, s in enumerate(segments)]
        if not segs:
            raise ValueError("segments is empty; a tree needs at least one node")
        par = check_parents(parents, len(segs))
        par_arr = np.asarray(par, dtype=np.int64)
        ends = node_sequence_ends(sequence_ends, par_arr)
        check_every_node_on_a_sequence(ends, par_arr)
        check_siblings(par, segs)
        tree = cls(segs, par_arr, ends, as_weights(weights, len(ends)), None, _checked=True)
        if loss_masks is not None:
            masks = loss_mask_arrays(loss_masks, tree.sequence_lengths)
            object.__setattr__(tree, "loss_masks", tuple(frozen(m, np.float64) for m in masks))
        return set_metadata(tree, metadata)

    # ------------------------------------------------------------------ views

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_ends)

    @property
    def num_nodes(self) -> int:
        return len(self.segments)

    @property
    def segment_lengths(self) -> np.ndarray:
        return np.fromiter((len(s) for s in self.segments), dtype=np.int64, count=len(self.segments))

    @property
    def node_depths(self) -> np.ndarray:
        """Position (offset in its sequences) of each node's first token."""
        return self._node_start

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self._node_start[self.sequence_ends] + self.segment_lengths[self.sequence_ends]

    @property
    def num_tokens(self) -> int:
        """Unique tokens: what the tree layout computes."""
        return int(self.segment_lengths.sum())

    @property
    def num_baseline_tokens(self) -> int:
        """Tokens over all sequences: what per-sequence training computes."""
        return int(self.sequence_lengths.sum())

    @property
    def por(self) -> float:
        """Prefix overlap ratio, 1 - unique / baseline tokens."""
        return 1.0 - self.num_tokens / self.num_baseline_tokens

    @property
    def bound(self) -> float:
        """Token-count bound on the speedup, baseline / unique tokens = 1 / (1 - POR)."""
        return self.num_baseline_tokens / self.num_tokens

    def node_path(self, i: int) -> list[int]:
        """Nodes from the root to the end of sequence ``i``."""
        path = []
        n = int(self.sequence_ends[i])
        while n >= 0:
            path.append(n)
            n = int(self.parents[n])
        return path[::-1]

    def sequence(self, i: int) -> np.ndarray:
        if not -self.num_sequences <= i < self.num_sequences:
            raise IndexError(f"sequence {i} out of range for a tree of {self.num_sequences}")
        return np.concatenate([self.segments[n] for n in self.node_path(i % self.num_sequences)])

    @property
    def sequences(self) -> list[list[int]]:
        """The token lists, in input order (computed once and cached, as a tree does not
        change: treat the lists as read-only, or copy them)."""
        if self._sequences is None:
            object.__setattr__(
                self, "_sequences", [self.sequence(i).tolist() for i in range(self.num_sequences)]
            )
        return self._sequences

    def loss_mask(self, i: int) -> np.ndarray:
        """Sequence ``i``'s 0/1 loss mask (float64, one entry per token): a fresh, writable
        copy (``loss_masks`` holds the tree's own, read-only)."""
        if self.loss_masks is not None:
            return self.loss_masks[i].copy()
        return np.ones(int(self.sequence_lengths[i]), dtype=np.float64)

    def subtree(self, sequence_ids: Sequence[int]) -> Tree:
        """The tree of a subset of the sequences (weights and masks kept as they are; metadata:
        the per-sequence keys for these sequences, every other key as it is)."""
        ids = [int(i) for i in sequence_ids]
        if not ids:
            raise ValueError("subtree needs at least one sequence")
        seqs = [self.sequence(i) for i in ids]
        masks = [self.loss_masks[i] for i in ids] if self.loss_masks is not None else None
        meta = {}
        for k, v in self.metadata.items():
            if k in SEQUENCE_KEYS:
                v = v[ids] if isinstance(v, np.ndarray) else [v[i] for i in ids]
            meta[k] = v
        return Tree.from_sequences(seqs, weights=self.weights[ids], loss_masks=masks,
                                   metadata=meta)

    def with_metadata(self, **changes) -> Tree:
        """A copy of this tree with its metadata updated: ``changes`` are set (checked as when
        building), a key given as None is removed. The tokens, weights and masks are the same."""
        meta = dict(self.metadata)
        for k, v in changes.items():
            if v is None:
                meta.pop(k, None)
            else:
                meta[k] = v
        return set_metadata(
            Tree(self.segments, self.parents, self.sequence_ends, self.weights,
                 self.loss_masks, _checked=True), meta)

    # ------------------------------------------------------------------ serialization

    def to_dict(self) -> dict:
        """The tree as a JSON-ready record, by nodes: ``{"segments": ..., "parents": ...,
        "sequence_ends": ...?, "weights": ...?, "loss_mask_runs": ...?, **metadata}``.

        Each node's tokens are stored once, so a record grows with the tree, not with the sum of
        its sequences' lengths (an agent task's calls laid out separately are often 10-50x the
        tree). ``sequence_ends`` only when it is not one sequence per leaf in node order,
        weights only when some differ from the default 1, and the loss masks, when the tree has
        them, as runs: per sequence a flat list ``[start, end, start, end, ...]`` of the
        positions trained. Metadata as plain JSON values (a missing log-probability as None).
        :meth:`from_dict` reads this and the earlier record by sequences
        (``{"sequences": ..., "loss_masks": ...}``)."""
        d = {"segments": [s.tolist() for s in self.segments], "parents": self.parents.tolist()}
        has_child = np.zeros(len(self.segments), dtype=bool)
        has_child[self.parents[self.parents >= 0]] = True
        if not np.array_equal(self.sequence_ends, np.flatnonzero(~has_child)):
            d["sequence_ends"] = self.sequence_ends.tolist()
        if not np.all(self.weights == 1.0):
            d["weights"] = self.weights.tolist()
        if self.loss_masks is not None:
            d["loss_mask_runs"] = [mask_runs(m) for m in self.loss_masks]
        d.update(thaw(self.metadata, json=True))
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Tree:
        """A tree from a record of :meth:`to_dict` (by nodes), or by sequences
        (``{"sequences": ..., "weights": ...?, "loss_masks": ...?}``). Every other key is
        metadata (a key that looks like a misspelling of a structure key is an error: it would
        be kept and the tree trained without it)."""
        if not isinstance(d, dict) or not ("sequences" in d or "segments" in d):
            raise ValueError('a tree record must be an object with a "sequences" list (by '
                             'sequences) or "segments" and "parents" lists (by nodes)')
        meta = {k: v for k, v in d.items() if k not in STRUCTURE_KEYS}
        for k in meta:
            close = difflib.get_close_matches(str(k), STRUCTURE_KEYS, n=1, cutoff=0.85)
            if close:
                raise ValueError(f"tree record key {k!r} is not {close[0]!r}; did you mean "
                                 f"{close[0]!r}? (other keys are kept as metadata)")
        if "sequences" in d:
            mixed = [k for k in NODE_KEYS if k in d]
            if mixed:
                raise ValueError(f"a tree record by sequences has no {mixed[0]!r}: give "
                                 '"sequences" or "segments" and "parents", not both')
            return cls.from_sequences(
                d["sequences"], weights=d.get("weights"), loss_masks=d.get("loss_masks"),
                metadata=meta,
            )
        if "parents" not in d:
            raise ValueError('a tree record by nodes needs "parents" beside "segments"')
        if "loss_masks" in d:
            raise ValueError('a tree record by nodes gives its masks as "loss_mask_runs"')
        tree = cls.from_nodes(d["segments"], d["parents"], sequence_ends=d.get("sequence_ends"),
                              weights=d.get("weights"))
        runs = d.get("loss_mask_runs")
        masks = None
        if runs is not None:
            if not isinstance(runs, list) or len(runs) != tree.num_sequences:
                raise ValueError(f"loss_mask_runs must hold one list per sequence "
                                 f"({tree.num_sequences})")
            lengths = tree.sequence_lengths
            masks = [mask_from_runs(r, int(lengths[i]), f"loss_mask_runs[{i}]")
                     for i, r in enumerate(runs)]
        if masks is None and not meta:
            return tree
        return set_metadata(Tree(tree.segments, tree.parents, tree.sequence_ends, tree.weights,
                                  masks, _checked=True), meta)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Tree):
            return NotImplemented
        return (
            self.sequences == other.sequences
            and np.array_equal(self.weights, other.weights)
            and (self.loss_masks is None) == (other.loss_masks is None)
            and (
                self.loss_masks is None
                or all(np.array_equal(a, b) for a, b in zip(self.loss_masks, other.loss_masks))
            )
            and values_equal(self.metadata, other.metadata)
        )

    __hash__ = None

    def __repr__(self) -> str:
        task = f"task={self.metadata['task']!r}, " if "task" in self.metadata else ""
        return (
            f"Tree({task}sequences={self.num_sequences}, nodes={self.num_nodes}, "
            f"tokens={self.num_tokens}, baseline_tokens={self.num_baseline_tokens}, "
            f"por={self.por:.3f})"
        )


def rebuild_tree(segments, parents, sequence_ends, weights, loss_masks, metadata=None) -> Tree:
    """Unpickle / copy a Tree (see ``Tree.__reduce__``); its data was validated when built."""
    tree = Tree(segments, parents, sequence_ends, weights, loss_masks, _checked=True)
    return set_metadata(tree, metadata) if metadata else tree


def por(tree: Tree) -> float:
    """Prefix overlap ratio of a tree (or of a list of trees taken together)."""
    if isinstance(tree, Tree):
        return tree.por
    trees = list(tree)
    return 1.0 - sum(t.num_tokens for t in trees) / sum(t.num_baseline_tokens for t in trees)


def bound(tree: Tree) -> float:
    """Token-count bound on the speedup, 1 / (1 - POR)."""
    return 1.0 / (1.0 - por(tree))

