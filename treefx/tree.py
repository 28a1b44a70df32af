"""Prefix trees of token sequences.

A :class:`Tree` holds the model calls of one task (one token list each) merged into a prefix
tree whose nodes are maximal shared segments. Every input sequence stays its own path, even when
it is a prefix of, or equal to, another one, and keeps its own weight and per-token loss mask.

Nodes are stored parents-first (``parents[i] < i``); the depth-first layout is made by
:func:`treefx.pack`.

A tree may carry **metadata** (``Tree.metadata``, a read-only mapping): what a trainer knows
about its sequences besides the tokens. Keys treefx knows, each checked when the tree is built:

- ``"task"``: the task (GRPO group) id, a string or an integer;
- ``"rollouts"``: per sequence, the rollout (agent trajectory) it is a model call of;
- ``"rewards"``: per sequence, a finite number (a rollout's reward, on each of its calls);
- ``"advantages"``: per sequence a finite number, or per token (``len(sequence) − 1`` values,
  entry k for token k + 1, as :mod:`treefx.rl` takes them);
- ``"logprobs"``: per sequence, the sampling log-probabilities of its tokens
  (``len(sequence) − 1`` values, entry k for token k + 1; NaN, or ``null`` in JSON, where there
  is none, such as prompt tokens), or None for a sequence without any.

Any other key is kept as given (JSON-like values: numbers, strings, lists, objects; lists
become tuples and objects read-only mappings, so the tree stays unchanged). :meth:`Tree.subtree`
keeps the per-sequence keys above for the sequences it takes and every other key as it is.
:func:`read_jsonl` / :func:`write_jsonl` write metadata beside ``"sequences"`` in each record.
"""

from __future__ import annotations

import difflib
import json
import math
import numbers
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType

import numpy as np

__all__ = ["Tree", "por", "bound", "read_jsonl", "write_jsonl"]

# Record keys that are the tree itself; every other key of a record is metadata. A record holds
# its tree by nodes (segments, parents, sequence_ends, the masks as runs: what to_dict writes)
# or by sequences (what it wrote before, still read).
NODE_KEYS = ("segments", "parents", "sequence_ends", "loss_mask_runs")
STRUCTURE_KEYS = ("sequences", "weights", "loss_masks", *NODE_KEYS)
# Metadata holding one entry per sequence: Tree.subtree keeps the entries of its sequences.
SEQUENCE_KEYS = ("rollouts", "rewards", "advantages", "logprobs")


def as_token_array(seq, what: str) -> np.ndarray:
    """Validate one token list: non-empty, integers, non-negative. ``what`` names it in errors."""
    if isinstance(seq, (str, bytes, dict, set)):
        raise TypeError(f"{what} must be a list of integer token ids, got {type(seq).__name__}")
    if isinstance(seq, np.ndarray) and seq.ndim == 1 and np.issubdtype(seq.dtype, np.integer):
        arr = seq.astype(np.int64, copy=False)  # the fast path: already integer ids
    else:
        if hasattr(seq, "tolist"):  # numpy arrays, torch tensors
            seq = seq.tolist()
        try:
            items = list(seq)
        except TypeError:
            raise TypeError(f"{what} must be a list of integer token ids, got "
                            f"{type(seq).__name__}") from None
        # Check the elements as given: converting the list first would turn [1, True] into
        # [1, 1] and [3, 1.5] into floats, hiding which entry is wrong.
        for j, x in enumerate(items):
            if isinstance(x, bool) or not isinstance(x, numbers.Integral):
                if isinstance(x, (list, tuple)):
                    raise ValueError(f"{what} must be a flat list of token ids; position {j} "
                                     "holds a list")
                raise TypeError(f"{what}, position {j}: token id {x!r} is not an integer")
            if not -(2**63) <= x < 2**63:
                raise ValueError(f"{what}, position {j}: token id {x} does not fit in int64")
        arr = np.asarray(items, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a flat list of token ids, got shape {tuple(arr.shape)}")
    if arr.size == 0:
        raise ValueError(f"{what} is empty; every sequence needs at least one token")
    neg = np.flatnonzero(arr < 0)
    if neg.size:
        raise ValueError(f"{what}, position {int(neg[0])}: token id {int(arr[neg[0]])} is negative")
    return arr


def _frozen(arr: np.ndarray, dtype) -> np.ndarray:
    """A private, read-only copy of ``arr`` in ``dtype``.

    A Tree's arrays must not change after it is built: :func:`treefx.pack` and
    :mod:`treefx.rl` read them again later, and a caller's array (or a view of it) changed in
    place would change those results without any error."""
    out = np.array(arr, dtype=dtype, copy=True)
    out.flags.writeable = False
    return out


def _as_mask_array(mask, length: int, what: str) -> np.ndarray:
    if isinstance(mask, (str, bytes)):
        raise TypeError(f"{what} must be a list of 0/1 values")
    arr = np.asarray(mask)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a flat list of 0/1 values, got shape {tuple(arr.shape)}")
    if arr.size != length:
        raise ValueError(f"{what} has {arr.size} entries but its sequence has {length} tokens")
    if arr.dtype == object or not (
        np.issubdtype(arr.dtype, np.number) or arr.dtype == bool
    ):
        raise TypeError(f"{what} must hold 0/1 values, got dtype {arr.dtype}")
    bad = np.flatnonzero((arr != 0) & (arr != 1))
    if bad.size:
        raise ValueError(
            f"{what}, position {int(bad[0])}: mask value {arr[bad[0]].item()!r} is not 0 or 1"
        )
    return arr.astype(np.float64)


def _as_weights(weights, num_sequences: int) -> np.ndarray:
    """Per-sequence weights as float64; ``None`` gives 1.0 each (the loss is normalized by the
    batch's sequence count in :func:`treefx.pack`, not by the weights)."""
    if weights is None:
        return np.ones(num_sequences)
    if isinstance(weights, (str, bytes)):
        raise TypeError("weights must be a list of numbers, one per sequence")
    arr = np.asarray(weights)
    if arr.ndim != 1 or arr.size != num_sequences:
        raise ValueError(
            f"weights has {arr.size} entries but there are {num_sequences} sequences; "
            "give one weight per sequence"
        )
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.number) or arr.dtype == bool:
        raise TypeError(f"weights must be numbers, got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"sequence {i}: weight {float(arr[i])} must be finite and non-negative")
    return arr


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
        # the built tree's sequence lengths, then set by _set_metadata.
        if not _checked:
            raise TypeError("build a Tree with Tree.from_sequences or Tree.from_nodes")
        # Own, read-only copies: segments may be views of the caller's arrays.
        init = object.__setattr__
        init(self, "segments", tuple(_frozen(s, np.int64) for s in segments))
        init(self, "parents", _frozen(parents, np.int64))
        init(self, "sequence_ends", _frozen(sequence_ends, np.int64))
        init(self, "weights", _frozen(weights, np.float64))
        init(self, "loss_masks", None if loss_masks is None
             else tuple(_frozen(m, np.float64) for m in loss_masks))
        start = np.zeros(len(segments), dtype=np.int64)
        lens = self.segment_lengths
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                start[i] = start[p] + lens[p]
        start.flags.writeable = False
        init(self, "_node_start", start)  # position (depth) of each node's first token
        init(self, "_sequences", None)
        init(self, "metadata", _EMPTY_METADATA)

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
        return (_rebuild_tree, (list(self.segments), self.parents, self.sequence_ends,
                                self.weights, None if self.loss_masks is None
                                else list(self.loss_masks), _thaw(self.metadata, json=False)))

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
        w = _as_weights(weights, len(seqs))
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
                _as_mask_array(m, len(s), f"loss mask of sequence {i}")
                for i, (m, s) in enumerate(zip(loss_masks, seqs))
            ]
        segments, parents, ends = _build_trie(seqs)
        return _set_metadata(cls(segments, parents, ends, w, masks, _checked=True), metadata)

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
        par = list(parents)
        if len(par) != len(segs):
            raise ValueError(f"parents has {len(par)} entries but there are {len(segs)} segments")
        for i, p in enumerate(par):
            if not isinstance(p, numbers.Integral) or isinstance(p, bool):
                raise TypeError(f"parents[{i}] = {p!r} is not an integer node index")
            if p < -1 or p >= len(segs):
                raise ValueError(
                    f"parents[{i}] = {p} is out of range; use -1 for a root or 0..{len(segs) - 1}"
                )
            if p == i:
                raise ValueError(f"parents[{i}] = {p}: node {i} is its own parent (a cycle)")
            if p > i:
                raise ValueError(
                    f"parents[{i}] = {p}: parent comes after its child; list parents before "
                    "children (this also rules out cycles)"
                )
        par_arr = np.asarray(par, dtype=np.int64)
        has_child = np.zeros(len(segs), dtype=bool)
        has_child[par_arr[par_arr >= 0]] = True
        if sequence_ends is None:
            ends = np.flatnonzero(~has_child).astype(np.int64)
        else:
            ends_list = list(sequence_ends)
            if not ends_list:
                raise ValueError("sequence_ends is empty; a tree needs at least one sequence")
            for i, e in enumerate(ends_list):
                if not isinstance(e, numbers.Integral) or isinstance(e, bool):
                    raise TypeError(f"sequence_ends[{i}] = {e!r} is not an integer node index")
                if not 0 <= e < len(segs):
                    raise ValueError(f"sequence_ends[{i}] = {e} is out of range 0..{len(segs) - 1}")
            ends = np.asarray(ends_list, dtype=np.int64)
        on_path = np.zeros(len(segs), dtype=bool)
        for e in ends.tolist():
            while e >= 0 and not on_path[e]:
                on_path[e] = True
                e = int(par_arr[e])
        off = np.flatnonzero(~on_path)
        if off.size:
            raise ValueError(
                f"node {int(off[0])} lies on no sequence (no entry of sequence_ends is it or below "
                "it); remove it or add a sequence ending there"
            )
        first_seen: dict[tuple[int, int], int] = {}
        for i, (p, seg) in enumerate(zip(par.tolist() if hasattr(par, "tolist") else par, segs)):
            other = first_seen.setdefault((int(p), int(seg[0])), i)
            if other != i:
                # Such siblings share a prefix: the tree would compute it twice and count its
                # tokens twice. Tree.from_sequences builds the merged tree.
                raise ValueError(
                    f"nodes {other} and {i} have the same parent ({p}) and both start with token "
                    f"{int(seg[0])}; siblings must start with different tokens (use "
                    "Tree.from_sequences to merge shared prefixes)"
                )
        tree = cls(segs, par_arr, ends, _as_weights(weights, len(ends)), None, _checked=True)
        if loss_masks is not None:
            loss_masks = list(loss_masks)
            if len(loss_masks) != len(ends):
                raise ValueError(
                    f"loss_masks has {len(loss_masks)} entries but there are {len(ends)} sequences"
                )
            lens = tree.sequence_lengths
            masks = [
                _as_mask_array(m, int(n), f"loss mask of sequence {i}")
                for i, (m, n) in enumerate(zip(loss_masks, lens))
            ]
            object.__setattr__(tree, "loss_masks", tuple(_frozen(m, np.float64) for m in masks))
        return _set_metadata(tree, metadata)

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
        return _set_metadata(
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
            d["loss_mask_runs"] = [_mask_runs(m) for m in self.loss_masks]
        d.update(_thaw(self.metadata, json=True))
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
            masks = [_mask_from_runs(r, int(lengths[i]), f"loss_mask_runs[{i}]")
                     for i, r in enumerate(runs)]
        if masks is None and not meta:
            return tree
        return _set_metadata(Tree(tree.segments, tree.parents, tree.sequence_ends, tree.weights,
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


def _rebuild_tree(segments, parents, sequence_ends, weights, loss_masks, metadata=None) -> Tree:
    """Unpickle / copy a Tree (see ``Tree.__reduce__``); its data was validated when built."""
    tree = Tree(segments, parents, sequence_ends, weights, loss_masks, _checked=True)
    return _set_metadata(tree, metadata) if metadata else tree


# ---------------------------------------------------------------------- metadata

_EMPTY_METADATA = MappingProxyType({})


def _set_metadata(tree: Tree, metadata) -> Tree:
    """Check ``metadata`` against ``tree``'s sequences and attach it, frozen; returns tree."""
    if metadata is None:
        return tree
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a mapping (a dict), got {type(metadata).__name__}")
    out = {}
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise TypeError(f"metadata keys must be strings, got {key!r}")
        if key in STRUCTURE_KEYS:
            raise ValueError(f"metadata key {key!r} is part of the tree itself; pass it as "
                             f"{key}= when building the tree")
        check = _METADATA_CHECKS.get(key)
        out[key] = check(value, tree) if check is not None else _freeze(value, key)
    object.__setattr__(tree, "metadata", MappingProxyType(out) if out else _EMPTY_METADATA)
    return tree


def _per_sequence(value, tree: Tree, key: str) -> list:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"metadata {key!r} must be a list with one entry per sequence, got "
                        f"{type(value).__name__}")
    items = value.tolist() if isinstance(value, np.ndarray) and value.ndim == 1 else list(value)
    if len(items) != tree.num_sequences:
        raise ValueError(f"metadata {key!r} has {len(items)} entries but the tree has "
                         f"{tree.num_sequences} sequences; give one per sequence")
    return items


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_task(value, tree: Tree):
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Integral)):
        raise TypeError(f"metadata 'task' must be a string or an integer id, got {value!r}")
    return value if isinstance(value, str) else int(value)


def _check_rollouts(value, tree: Tree) -> tuple:
    items = _per_sequence(value, tree, "rollouts")
    for i, r in enumerate(items):
        if isinstance(r, bool) or not isinstance(r, (str, numbers.Integral)):
            raise TypeError(f"metadata 'rollouts', sequence {i}: rollout id {r!r} is not a "
                            "string or an integer")
    return tuple(r if isinstance(r, str) else int(r) for r in items)


def _finite_numbers(items, what: str) -> np.ndarray:
    for j, x in enumerate(items):
        if not _is_number(x):
            raise TypeError(f"{what}, entry {j}: {x!r} is not a number")
        if not math.isfinite(x):
            raise ValueError(f"{what}, entry {j}: {x} is not finite")
    return _frozen(np.asarray(items, dtype=np.float64), np.float64)


def _token_values(x, length: int, what: str, *, missing_ok: bool) -> np.ndarray:
    """One value per predicted token of a sequence of ``length`` tokens (``length − 1``)."""
    if isinstance(x, np.ndarray) and x.ndim == 1 and x.dtype.kind == "f" \
            and x.size == length - 1 and (missing_ok or np.isfinite(x).all()):
        return _frozen(x, np.float64)  # the fast path: already the right floats
    if isinstance(x, np.ndarray):
        x = x.tolist()
    if isinstance(x, (str, bytes, Mapping)) or not isinstance(x, Iterable):
        raise TypeError(f"{what} must be a list of numbers, got {type(x).__name__}")
    items = list(x)
    if len(items) != length - 1:
        raise ValueError(f"{what} has {len(items)} entries but its sequence has {length} "
                         f"tokens; give {length - 1}, one per predicted token (entry k for "
                         "token k + 1)")
    out = np.empty(len(items), dtype=np.float64)
    for j, v in enumerate(items):
        if v is None and missing_ok:
            out[j] = np.nan
        elif not _is_number(v):
            raise TypeError(f"{what}, entry {j}: {v!r} is not a number"
                            + (" (or None where there is none)" if missing_ok else ""))
        elif not missing_ok and not math.isfinite(v):
            raise ValueError(f"{what}, entry {j}: {v} is not finite")
        else:
            out[j] = v
    return _frozen(out, np.float64)


def _check_rewards(value, tree: Tree) -> np.ndarray:
    return _finite_numbers(_per_sequence(value, tree, "rewards"), "metadata 'rewards'")


def _check_advantages(value, tree: Tree):
    items = _per_sequence(value, tree, "advantages")
    if all(_is_number(x) for x in items):
        return _finite_numbers(items, "metadata 'advantages'")
    if any(_is_number(x) for x in items):
        raise TypeError("metadata 'advantages' mixes numbers and lists; give one number per "
                        "sequence, or one list of per-token values per sequence")
    lengths = tree.sequence_lengths.tolist()
    return tuple(_token_values(x, n, f"metadata 'advantages', sequence {i}", missing_ok=False)
                 for i, (x, n) in enumerate(zip(items, lengths)))


def _check_logprobs(value, tree: Tree) -> tuple:
    items = _per_sequence(value, tree, "logprobs")
    lengths = tree.sequence_lengths.tolist()
    return tuple(
        _frozen(np.full(n - 1, np.nan), np.float64) if x is None else
        _token_values(x, n, f"metadata 'logprobs', sequence {i}", missing_ok=True)
        for i, (x, n) in enumerate(zip(items, lengths))
    )


_METADATA_CHECKS = {
    "task": _check_task,
    "rollouts": _check_rollouts,
    "rewards": _check_rewards,
    "advantages": _check_advantages,
    "logprobs": _check_logprobs,
}


def _freeze(value, where: str):
    """A read-only copy of JSON-like data: lists become tuples, dicts read-only mappings."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (str, bytes, numbers.Number)) or value is None:
        return value
    if isinstance(value, np.ndarray):
        return _frozen(value, value.dtype)
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): _freeze(v, f"{where}.{k}") for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v, f"{where}[{i}]") for i, v in enumerate(value))
    raise TypeError(f"metadata {where!r}: a {type(value).__name__} is not JSON-like data "
                    "(numbers, strings, lists, dicts)")


def _thaw(value, *, json: bool):
    """Plain data back from frozen metadata (``json``: NaN as None, arrays as lists)."""
    if isinstance(value, Mapping):
        return {k: _thaw(v, json=json) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v, json=json) for v in value]
    if isinstance(value, np.ndarray):
        if not json:
            return value.copy()
        if value.dtype.kind == "f":
            return [None if math.isnan(x) else x for x in value.tolist()]
        return value.tolist()
    return value


def values_equal(a, b) -> bool:
    """Metadata equality: arrays elementwise (NaN equal to NaN), containers recursively."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        kind = "fc"
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in kind and b.dtype.kind in kind))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b))
    return a == b


def _build_trie(seqs: list[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Compressed trie of ``seqs``: (segments, parents, end node per sequence), nodes in DFS
    preorder.

    Sort the sequences, take the longest common prefix of neighbours, and walk a stack of the
    current path (as when building a suffix tree from a suffix array): O(total tokens) after the
    sort, no per-token Python loop.
    """
    # Token ids are non-negative, so their big-endian bytes sort as the id lists do (a
    # prefix first), compared in C rather than element by element in Python.
    keys = [s.astype(">i8").tobytes() for s in seqs]
    order = sorted(range(len(seqs)), key=keys.__getitem__)
    # Mutable nodes: [start, end, source sequence, children, ends-here]
    nodes: list[list] = []
    roots: list[int] = []
    end_node = np.empty(len(seqs), dtype=np.int64)
    stack: list[int] = []
    prev = None
    for i in order:
        s = seqs[i]
        if prev is None:
            lcp = 0
        else:
            m = min(len(prev), len(s))
            diff = np.flatnonzero(prev[:m] != s[:m])
            lcp = int(diff[0]) if diff.size else m
        while stack and nodes[stack[-1]][0] >= lcp:
            stack.pop()
        if stack and nodes[stack[-1]][1] > lcp:
            # Split the top node at lcp: its tail keeps its children and its sequence ends.
            top = nodes[stack[-1]]
            tail = [lcp, top[1], top[2], top[3], top[4]]
            nodes.append(tail)
            top[1], top[3], top[4] = lcp, [len(nodes) - 1], []
        if lcp < len(s):
            nodes.append([lcp, len(s), i, [], []])
            new = len(nodes) - 1
            (nodes[stack[-1]][3] if stack else roots).append(new)
            stack.append(new)
        nodes[stack[-1]][4].append(i)
        prev = s
    # Preorder renumbering.
    segments: list[np.ndarray] = []
    parents: list[int] = []
    work = [(r, -1) for r in reversed(roots)]
    while work:
        n, p = work.pop()
        start, end, src, children, ends = nodes[n]
        k = len(segments)
        segments.append(seqs[src][start:end])
        parents.append(p)
        for e in ends:
            end_node[e] = k
        work.extend((c, k) for c in reversed(children))
    return segments, np.asarray(parents, dtype=np.int64), end_node


def por(tree: Tree) -> float:
    """Prefix overlap ratio of a tree (or of a list of trees taken together)."""
    if isinstance(tree, Tree):
        return tree.por
    trees = list(tree)
    return 1.0 - sum(t.num_tokens for t in trees) / sum(t.num_baseline_tokens for t in trees)


def bound(tree: Tree) -> float:
    """Token-count bound on the speedup, 1 / (1 - POR)."""
    return 1.0 / (1.0 - por(tree))


def read_jsonl(path: str | os.PathLike) -> Iterator[Tree]:
    """Trees from a JSON Lines file, one tree a line; errors name the line."""
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield Tree.from_dict(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{os.fspath(path)}, line {lineno}: not valid JSON ({e})") from e
            except (ValueError, TypeError) as e:
                raise type(e)(f"{os.fspath(path)}, line {lineno}: {e}") from e


def write_jsonl(path: str | os.PathLike, trees: Iterable[Tree]) -> int:
    """Write trees as JSON Lines; returns the number written."""
    n = 0
    with open(path, "w") as f:
        for t in trees:
            f.write(json.dumps(t.to_dict(), separators=(",", ":")))
            f.write("\n")
            n += 1
    return n


def _mask_runs(mask: np.ndarray) -> list[int]:
    """A 0/1 mask as the flat list of its runs of ones, ``[start, end, start, end, ...]``."""
    m = np.concatenate([[0], (np.asarray(mask) != 0).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(m))
    return edges.tolist()


def _mask_from_runs(runs, length: int, what: str) -> np.ndarray:
    """The 0/1 mask of ``length`` whose ones are the runs ``[start, end, ...]``, checked."""
    if not isinstance(runs, list) or len(runs) % 2 or not all(
            isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in runs):
        raise ValueError(f"{what} must be a flat list of integer [start, end) pairs")
    edges = np.asarray(runs, dtype=np.int64)
    if len(edges) and (edges[0] < 0 or edges[-1] > length or np.any(np.diff(edges) <= 0)):
        raise ValueError(f"{what}: runs must be increasing, non-empty and within the "
                         f"sequence's {length} tokens, got {runs}")
    mask = np.zeros(length, dtype=np.float64)
    for a, b in edges.reshape(-1, 2):
        mask[a:b] = 1.0
    return mask
