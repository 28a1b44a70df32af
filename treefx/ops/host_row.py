"""What the ops that run eagerly inside a traced graph derive from the tree's predecessor row on
the host: copied there once per row, not once per layer.

Under AOTAutograd / Inductor the tree's structure is data (``parent_token``, a tensor on the
model's device). The ops that need it as Python values (the recurrence's nodes and levels,
the conv's node-boundary tokens) run as opaque custom ops and read the row on the host. On a
GPU each such copy waits for all queued work, so a step's layers (forward and recomputed
backward) share one: :func:`derived` keeps what was computed from the last row seen. A row that
:meth:`treefx.TreeBatch.to` moved to the device from the host is not copied back at all: its
host copy is kept (:func:`treefx.layout.known_host_row`), so the step's first such op does not
wait for the device either.

A hit needs the same memory, dtype, layout and version counter (:func:`treefx.layout.row_key`).
The row tensor is held, so its memory cannot be handed to another tensor while it is the key,
and any in-place change to it (or to a view of it) bumps the version counter; a change made behind torch's back
(through a NumPy array sharing its memory) would not be seen, which is why treefx hands these
functions rows it built itself.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..layout import known_host_row, row_key

__all__ = ["derived", "on_host", "row_key"]


class _LastRow:
    """One (key, row, {name: value}) tuple, replaced whole (a reader on another thread never
    sees a key with another row's values); values are added to its dict."""

    entry: tuple | None = None


def host_row(parent_token: torch.Tensor) -> np.ndarray:
    """The row as an int64 NumPy array (one device-to-host copy)."""
    return parent_token.detach().cpu().numpy().astype(np.int64, copy=False)


def on_host(t: torch.Tensor) -> np.ndarray:
    """``t`` (int64 values) as a NumPy array: its kept host copy where it has one
    (:func:`treefx.layout.known_host_row`), else one device-to-host copy."""
    row = known_host_row(t)
    return host_row(t) if row is None else row


def derived(parent_token: torch.Tensor, name, compute: Callable[[np.ndarray], object]):
    """``compute(host row)``, computed once per row and ``name`` (a hashable naming the
    computation and its settings) while the same unchanged row comes back."""
    key = row_key(parent_token)
    entry = _LastRow.entry
    if key is None:
        return compute(host_row(parent_token))
    if entry is None or entry[0] != key:
        entry = (key, parent_token, {"row": on_host(parent_token)})
        _LastRow.entry = entry
    values = entry[2]
    if name not in values:
        values[name] = compute(values["row"])
    return values[name]
