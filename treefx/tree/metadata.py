"""A tree's metadata: the record keys that are the tree itself, the keys treefx knows (each
checked against the tree's sequences), and every other key frozen as given (see
:mod:`treefx.tree`); :func:`thaw` gives plain data back, :func:`values_equal` compares it."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np

from .inputs import frozen

if TYPE_CHECKING:
    from .core import Tree

# Record keys that are the tree itself; every other key of a record is metadata. A record holds
# its tree by nodes (segments, parents, sequence_ends, the masks as runs: what to_dict writes)
# or by sequences (what it wrote before, still read).
NODE_KEYS = ("segments", "parents", "sequence_ends", "loss_mask_runs")
STRUCTURE_KEYS = ("sequences", "weights", "loss_masks", *NODE_KEYS)
# Metadata holding one entry per sequence: Tree.subtree keeps the entries of its sequences.
SEQUENCE_KEYS = ("rollouts", "rewards", "advantages", "logprobs")


EMPTY_METADATA = MappingProxyType({})


def set_metadata(tree: Tree, metadata) -> Tree:
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
    object.__setattr__(tree, "metadata", MappingProxyType(out) if out else EMPTY_METADATA)
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
    return frozen(np.asarray(items, dtype=np.float64), np.float64)


def _token_values(x, length: int, what: str, *, missing_ok: bool) -> np.ndarray:
    """One value per predicted token of a sequence of ``length`` tokens (``length − 1``)."""
    if isinstance(x, np.ndarray) and x.ndim == 1 and x.dtype.kind == "f" \
            and x.size == length - 1 and (missing_ok or np.isfinite(x).all()):
        return frozen(x, np.float64)  # the fast path: already the right floats
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
    return frozen(out, np.float64)


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
        frozen(np.full(n - 1, np.nan), np.float64) if x is None else
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
        return frozen(value, value.dtype)
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): _freeze(v, f"{where}.{k}") for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v, f"{where}[{i}]") for i, v in enumerate(value))
    raise TypeError(f"metadata {where!r}: a {type(value).__name__} is not JSON-like data "
                    "(numbers, strings, lists, dicts)")


def thaw(value, *, json: bool):
    """Plain data back from frozen metadata (``json``: NaN as None, arrays as lists)."""
    if isinstance(value, Mapping):
        return {k: thaw(v, json=json) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v, json=json) for v in value]
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
