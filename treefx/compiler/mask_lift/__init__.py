"""Lift a model-built attention mask out of the graph into a FlexAttention ``mask_mod``.

A model builds its mask from index grids: ``arange`` vectors broadcast to [B, H, Q, KV]
(``q_idx[None, None, :, None]``, ``kv_idx[None, None, None, :]``), combined elementwise
(causal ``kv <= q``, sliding window ``kv > q - W``, a padding lookup ``attention_mask[b, kv]``).
After the positions pass its q/kv grids are path positions. This module re-evaluates that
subgraph for one (b, h, q, kv) at a time, which is what a ``mask_mod`` is:

- a *vector* node (1-D, from an index source) is evaluated at the index of the axis it is
  broadcast to: tree positions at ``q_idx`` / ``kv_idx``, a batch or head ``arange`` at
  ``b`` / ``h``;
- a *grid* node (broadcast) is a scalar: shape ops (``expand``, ``view``, ``None``-indexing)
  are identities, elementwise ops apply, indexing a buffer by grid scalars is a lookup;
- tensors that do not depend on an index source are buffers, passed to the ``mask_mod`` at
  run time (e.g. the padding mask).

Anything else raises :class:`MaskLiftError`; the attention pass turns it into an error naming
the attention site.

The package, one concept a module: :mod:`.lifted` (:class:`LiftedMask` and its evaluation per
index), :mod:`.lift` (:func:`lift_mask`, :func:`lift_value`: the subgraph found and copied),
:mod:`.fills` (filled tensors), :mod:`.applications` (a mask's constants and how a model applies
it to its scores), :mod:`.probe` (the mask probed on pairs of positions) and :mod:`.window` (a
sliding window read off its structure).
"""

from __future__ import annotations

from .applications import mask_applications
from .lift import leaves_of, lift_mask, lift_value
from .lifted import TABLE, DenseSide, LiftedMask, LiftedScore, MaskLiftError, dense_side
from .probe import implied_by_tree, is_all_ones_input, sees_later_keys
from .window import window_of

__all__ = ["MaskLiftError", "LiftedMask", "LiftedScore", "DenseSide", "dense_side", "lift_mask",
           "lift_value", "sees_later_keys", "window_of", "TABLE", "implied_by_tree",
           "is_all_ones_input", "leaves_of", "mask_applications"]
