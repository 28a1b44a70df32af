"""The input embedding of a part of a tree (:mod:`treefx.parts`): ``F.embedding`` whose weight
gradient goes to the part's rows only (:func:`part_embedding`)."""

from __future__ import annotations

import torch

__all__ = ["part_embedding"]


def part_embedding(ids: torch.Tensor, weight: torch.Tensor, sink: torch.Tensor,
                   padding_idx: int) -> torch.Tensor:
    """``F.embedding(ids, weight)`` whose gradient goes to ``sink`` [n, D] (a leaf of the
    caller's, one row per token) instead of ``weight``: a part's rows of the embedding's
    gradient, which :func:`treefx.backward` adds into ``weight.grad`` at those rows only (not a
    dense [vocab, D] gradient per part). ``padding_idx`` (-1: none): rows of that id get no
    gradient, as ``F.embedding`` gives."""
    return _part_embedding(ids, weight, sink, padding_idx)


@torch.library.custom_op("treefx::part_embedding", mutates_args=())
def _part_embedding(ids: torch.Tensor, weight: torch.Tensor, sink: torch.Tensor,
                    padding_idx: int) -> torch.Tensor:
    # Written into a tensor of the output's own shape: F.embedding returns a view (of its
    # [n, D] rows), and a custom op's output that is a view may not be modified in place
    # (models add position embeddings into it with +=).
    out = weight.new_empty(*ids.shape, weight.shape[1])
    torch.index_select(weight, 0, ids.reshape(-1), out=out.view(-1, weight.shape[1]))
    return out


@_part_embedding.register_fake
def _(ids, weight, sink, padding_idx):
    return weight.new_empty(*ids.shape, weight.shape[1])


def _embedding_setup(ctx, inputs, output):
    ids, _, sink, padding_idx = inputs
    ctx.save_for_backward(ids)
    ctx.padding_idx = padding_idx
    ctx.sink_dtype = sink.dtype


def _embedding_grad(ctx, grad):
    (ids,) = ctx.saved_tensors
    g = grad.reshape(-1, grad.shape[-1])
    if ctx.padding_idx >= 0:
        g = torch.where((ids.reshape(-1) == ctx.padding_idx)[:, None], torch.zeros_like(g), g)
    return None, None, g.to(ctx.sink_dtype), None


_part_embedding.register_autograd(_embedding_grad, setup_context=_embedding_setup)
