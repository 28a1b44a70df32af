"""The input embedding as the compiled paths run it.

:func:`embedding`, a whole tree's: ``F.embedding`` whose weight gradient is ATen's own kernel
(on CUDA: the ids sorted, each id's rows summed in float32, written once in the weight's dtype),
called as it is. Left to the compiler, Inductor decomposes that gradient into a float32 [vocab,
D] buffer zero-filled, an atomic scatter-add into it and a cast to the weight's dtype, slower
than ATen's in half precision; in float32, with no cast, Inductor's is the faster
(``benchmarks.embedding_grad``; BENCHMARKS.md, "Training step against sequence packing",
[emb-1]). The compiler takes it where it is faster
(:func:`treefx.compiler.lower.whole.finish`).

:func:`part_embedding`, a part's (:mod:`treefx.parts`): ``F.embedding`` whose weight gradient
goes to the part's rows only.

Both write the lookup into an output of its own shape: ``F.embedding`` returns a view (of its
[n, D] rows), and a custom op's output that is a view may not be modified in place (models add
position embeddings into it with ``+=``).
"""

from __future__ import annotations

import torch

__all__ = ["embedding", "part_embedding"]


def _lookup(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out = weight.new_empty(*ids.shape, weight.shape[1])
    torch.index_select(weight, 0, ids.reshape(-1), out=out.view(-1, weight.shape[1]))
    return out


def embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """``F.embedding(ids, weight, padding_idx)`` (``padding_idx`` -1: none; rows of that id
    get no gradient), its weight's gradient computed by ATen's ``embedding_dense_backward``
    opaquely to the compiler (see the module's text)."""
    return _embedding(ids, weight, padding_idx)


@torch.library.custom_op("treefx::embedding", mutates_args=())
def _embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int) -> torch.Tensor:
    return _lookup(ids, weight)


@_embedding.register_fake
def _(ids, weight, padding_idx):
    return weight.new_empty(*ids.shape, weight.shape[1])


@torch.library.custom_op("treefx::embedding_backward", mutates_args=())
def _embedding_backward(grad: torch.Tensor, ids: torch.Tensor, num_weights: int,
                        padding_idx: int) -> torch.Tensor:
    return torch.ops.aten.embedding_dense_backward(grad, ids, num_weights, padding_idx, False)


@_embedding_backward.register_fake
def _(grad, ids, num_weights, padding_idx):
    return grad.new_empty(num_weights, grad.shape[-1])


def _setup(ctx, inputs, output):
    ids, weight, padding_idx = inputs
    ctx.save_for_backward(ids)
    ctx.num_weights, ctx.padding_idx = weight.shape[0], padding_idx


def _grad(ctx, grad):
    if not ctx.needs_input_grad[1]:
        return None, None, None
    (ids,) = ctx.saved_tensors
    return None, _embedding_backward(grad.contiguous(), ids, ctx.num_weights,
                                     ctx.padding_idx), None


_embedding.register_autograd(_grad, setup_context=_setup)


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
    return _lookup(ids, weight)


@_part_embedding.register_fake
def _(ids, weight, sink, padding_idx):
    return weight.new_empty(*ids.shape, weight.shape[1])


def _part_setup(ctx, inputs, output):
    ids, _, sink, padding_idx = inputs
    ctx.save_for_backward(ids)
    ctx.padding_idx = padding_idx
    ctx.sink_dtype = sink.dtype


def _part_grad(ctx, grad):
    (ids,) = ctx.saved_tensors
    g = grad.reshape(-1, grad.shape[-1])
    if ctx.padding_idx >= 0:
        g = torch.where((ids.reshape(-1) == ctx.padding_idx)[:, None], torch.zeros_like(g), g)
    return None, None, g.to(ctx.sink_dtype), None


_part_embedding.register_autograd(_part_grad, setup_context=_part_setup)
