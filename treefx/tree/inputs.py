"""What a tree is built from, checked: token lists, loss masks (also as runs of ones, the
form :meth:`treefx.Tree.to_dict` writes), per-sequence weights, and the read-only copies a
:class:`treefx.Tree` keeps of them."""

from __future__ import annotations

import numbers

import numpy as np


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


def frozen(arr: np.ndarray, dtype) -> np.ndarray:
    """A private, read-only copy of ``arr`` in ``dtype``.

    A Tree's arrays must not change after it is built: :func:`treefx.pack` and
    :mod:`treefx.rl` read them again later, and a caller's array (or a view of it) changed in
    place would change those results without any error."""
    out = np.array(arr, dtype=dtype, copy=True)
    out.flags.writeable = False
    return out


def as_mask_array(mask, length: int, what: str) -> np.ndarray:
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


def loss_mask_arrays(loss_masks, lengths) -> list[np.ndarray]:
    """One checked 0/1 mask per sequence, ``lengths[i]`` entries each (``loss_masks`` of
    :meth:`treefx.Tree.from_nodes`)."""
    loss_masks = list(loss_masks)
    if len(loss_masks) != len(lengths):
        raise ValueError(
            f"loss_masks has {len(loss_masks)} entries but there are {len(lengths)} sequences"
        )
    return [
        as_mask_array(m, int(n), f"loss mask of sequence {i}")
        for i, (m, n) in enumerate(zip(loss_masks, lengths))
    ]


def as_weights(weights, num_sequences: int) -> np.ndarray:
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


def mask_runs(mask: np.ndarray) -> list[int]:
    """A 0/1 mask as the flat list of its runs of ones, ``[start, end, start, end, ...]``."""
    m = np.concatenate([[0], (np.asarray(mask) != 0).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(m))
    return edges.tolist()


def mask_from_runs(runs, length: int, what: str) -> np.ndarray:
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
