"""Hugging Face's packed-sequence inference, during a tree capture.

Called without ``attention_mask`` (and without a cache), a Hugging Face model of transformers
5.x infers packed sequences from ``position_ids``: a token whose position is not its
predecessor's plus one starts a new sequence (``masking_utils.find_packed_sequence_indices``,
a ``torch.diff`` over the tokens). Newer releases (5.24) always build ``position_ids`` before
the mask, so a step that calls ``model(input_ids=..., labels=...)`` reaches it.

On a tree, the model's positions are each token's offset in its own sequence: along every
root-to-token path they count 0, 1, 2, ... with no jump, so each sequence run alone finds one
sequence, for which the function returns ``None`` (no packing) outside a trace. On the DFS row
the positions jump where a branch starts, and the ``diff`` over the row would split the tree
into false sequences (the token-axis check refuses it). Within :func:`one_sequence_per_path`
the function gives the per-sequence answer, ``None``, so the model builds its plain causal
mask, which the attention pass turns into the tree mask.
"""

from __future__ import annotations

import contextlib
import sys

__all__ = ["one_sequence_per_path"]

_SITE = ("transformers.masking_utils", "find_packed_sequence_indices")


def _one_sequence(position_ids):
    """What each sequence of a tree gives alone: no packed sequences."""
    return None


@contextlib.contextmanager
def one_sequence_per_path():
    """Within this block, Hugging Face's packed-sequence inference finds one sequence per
    path (see the module's docstring). A transformers without the function, or not imported
    (no Hugging Face model is being captured), is left as it is."""
    mod_name, attr = _SITE
    mod = sys.modules.get(mod_name)
    original = getattr(mod, attr, None)
    if original is None:
        yield
        return
    setattr(mod, attr, _one_sequence)
    try:
        yield
    finally:
        setattr(mod, attr, original)
