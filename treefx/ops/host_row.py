"""What the ops that run eagerly inside a traced graph derive from the tree's predecessor row on
the host: copied there once per row, not once per layer.

Under AOTAutograd / Inductor the tree's structure is data (``parent_token``, a tensor on the
model's device). The ops that need it as Python values (the recurrence's nodes and levels,
the conv's node-boundary tokens) run as opaque custom ops and read the row on the host. On a
GPU each such copy waits for all queued work, so a step's layers (forward and recomputed
backward) share one: :func:`derived` keeps what was computed from the last row seen.

A hit needs the same storage, offset, shape, strides and version counter. The row tensor is
held, so its memory cannot be handed to another tensor while it is the key, and any in-place
change to it (or to a view of it) bumps the version counter; a change made behind torch's back
(through a NumPy array sharing its memory) would not be seen, which is why treefx hands these
functions rows it built itself.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

__all__ = ["derived", "row_key"]


class _LastRow:
    """One (key, row, {name: value}) tuple, replaced whole (a reader on another thread never
    sees a key with another row's values); values are added to its dict."""

    entry: tuple | None = None


def row_key(t: torch.Tensor):
    """The identity of a row tensor's current contents (None for tensors without storage:
    fake and functional wrappers, never cached)."""
    try:
        return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                t.stride(), t._version)
    except Exception:  # noqa: BLE001  (no storage: no caching)
        return None


def host_row(parent_token: torch.Tensor) -> np.ndarray:
    """The row as an int64 NumPy array (one device-to-host copy)."""
    return parent_token.detach().cpu().numpy().astype(np.int64, copy=False)


def derived(parent_token: torch.Tensor, name, compute: Callable[[np.ndarray], object]):
    """``compute(host row)``, computed once per row and ``name`` (a hashable naming the
    computation and its settings) while the same unchanged row comes back."""
    key = row_key(parent_token)
    entry = _LastRow.entry
    if key is None:
        return compute(host_row(parent_token))
    if entry is None or entry[0] != key:
        entry = (key, parent_token, {"row": host_row(parent_token)})
        _LastRow.entry = entry
    values = entry[2]
    if name not in values:
        values[name] = compute(values["row"])
    return values[name]
