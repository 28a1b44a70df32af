"""Attention sinks as an extra softmax column (gpt-oss, MiMo-V2-Flash): a [.., N, 1] logit
concatenated to the scores as one more key and dropped after the softmax, recognised for the
attention recogniser (:mod:`treefx.compiler.registry`); the lowering applies it from the
attention's log-sum-exp (:func:`treefx.ops.attention.sink_rescale`)."""

from __future__ import annotations

import torch.fx as fx

from ..compiler.graph import arg, example, same_size
from ..compiler.patterns import score_source
from ..compiler.registry import register_score_column

__all__ = ["sink_column"]


def sink_column(cat: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(sink, scores) when ``cat`` is ``cat([scores, sink], dim=-1)`` with ``sink`` one
    column ([.., 1]) not computed from the scores, else None."""
    parts, dim = arg(cat, 0, "tensors"), arg(cat, 1, "dim", 0)
    sv = example(parts[1]) if len(parts) == 2 else None
    if (sv is None or not isinstance(dim, int) or dim % sv.dim() != sv.dim() - 1
            or not same_size(sv.shape[-1], 1) or score_source(parts[1], {}) is not None):
        return None
    return parts[1], parts[0]


register_score_column(sink_column)
