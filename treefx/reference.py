"""The per-branch oracle: the unmodified model run on every sequence alone.

This is what tree training must reproduce, values and gradients. It is slow on purpose: no
sharing, one forward per sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from .layout import check_num_sequences
from .tree import Tree

__all__ = ["logits_of", "logprob_loss", "output_vocab_size", "sequence_logprobs", "sequence_loss",
           "vocab_size"]


def logits_of(output) -> torch.Tensor:
    """The logits in a model's output, whatever form the output takes.

    Logits from a model's output: a tensor, a tuple whose first entry is one, or an object
    with ``.logits`` (Hugging Face)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(
        f"cannot find logits in the model's output of type {type(output).__name__}; "
        "return a tensor, a tuple starting with one, or an object with .logits"
    )


def _trees(tree) -> list[Tree]:
    if isinstance(tree, Tree):
        return [tree]
    trees = list(tree) if isinstance(tree, Iterable) else None
    if not trees or not all(isinstance(t, Tree) for t in trees):
        raise TypeError("expected a treefx.Tree or a non-empty list of them")
    return trees


# How the oracle runs a model's attention: context managers ``switch(model)`` that model
# families register (:func:`register_oracle_attention`); the oracle imports no family.
_ORACLE_ATTENTION: list = []


def register_oracle_attention(switch) -> None:
    """Have the oracle run every model within ``switch(model)``, a context manager: a model
    family's switch to an attention that runs each sequence alone on this device (a Hugging
    Face flex-attention model on the CPU runs its eager attention:
    :mod:`treefx.families.hf_flex`, which registers it when imported), or to its reference
    kernels (Hugging Face's torch Gated DeltaNet beneath its fla wrapper:
    :mod:`treefx.families.hf_recurrent`)."""
    if switch not in _ORACLE_ATTENTION:
        _ORACLE_ATTENTION.append(switch)


@contextlib.contextmanager
def oracle_attention(model: torch.nn.Module):
    """How the oracle runs ``model``: within every switch model families registered
    (:func:`register_oracle_attention`); as it is where none applies."""
    with contextlib.ExitStack() as stack:
        for switch in _ORACLE_ATTENTION:
            stack.enter_context(switch(model))
        yield


def _device(model: torch.nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def sequence_logprobs(model: torch.nn.Module, tree) -> list[torch.Tensor]:
    """Each sequence's token log-probabilities, from the unmodified model run on it alone.

    Per sequence (over all trees given, in order): log p(token j | tokens < j) for j >= 1,
    a tensor of length ``len(sequence) - 1`` in float32 (float64 for a float64 model), from the
    model run on that sequence alone (a flex-attention model on the CPU through its eager
    attention: :mod:`treefx.families.hf_flex`). Differentiable."""
    dev = _device(model)
    out = []
    with oracle_attention(model):
        for t in _trees(tree):
            for i in range(t.num_sequences):
                ids = torch.as_tensor(t.sequence(i), device=dev)[None]
                logits = logits_of(model(ids))[0, :-1]
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
                out.append(torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0])
    return out


def sequence_loss(model: torch.nn.Module, tree, *, reduction: str = "mean",
                  num_sequences: int | None = None) -> torch.Tensor:
    """The per-sequence baseline loss: the unmodified model run on each sequence alone.

    The baseline loss, the mean over all sequences of all trees given:

        L = (1/P) · Σ_p ω_p · r_p · Σ_{j≥1} m_p(j) · (−log p(s_p[j] | s_p[<j]))

    with r_p = 1 / Σ_{j≥1} m_p(j) ("mean", the default, as :func:`treefx.pack`'s; a sequence
    with nothing to predict adds 0) or 1 ("sum"), ω_p the tree's sequence weights and P = ``num_sequences``: by default the number of
    sequences given, or a global count as for :func:`treefx.pack` (its batch of the same trees
    and ``num_sequences`` has this loss). Differentiable."""
    trees = _trees(tree)
    return logprob_loss(trees, sequence_logprobs(model, trees), reduction=reduction,
                        num_sequences=num_sequences, device=_device(model))


def logprob_loss(tree, logprobs: list[torch.Tensor], *, reduction: str = "mean",
                 num_sequences: int | None = None, device=None) -> torch.Tensor:
    """The per-sequence loss made from the sequences' log-probabilities.

    The loss of :func:`sequence_loss`, from ``logprobs`` as :func:`sequence_logprobs` returns
    them (in its order): one forward gives both."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    trees = _trees(tree)
    normalizer = check_num_sequences(num_sequences, sum(t.num_sequences for t in trees))
    logps = iter(logprobs)
    total = torch.zeros((), device=device if device is not None else
                        (logprobs[0].device if logprobs else None))
    for t in trees:
        for i in range(t.num_sequences):
            lp = next(logps)
            m = torch.tensor(t.loss_mask(i)[1:], dtype=lp.dtype, device=lp.device)
            r = 1.0
            if reduction == "mean":
                n = float(m.sum())
                r = 1.0 / n if n > 0 else 0.0
            total = total + float(t.weights[i]) * r / normalizer * (m * -lp).sum()
    return total


def vocab_size(model: torch.nn.Module) -> int | None:
    """The size of a model's token embedding, or None.

    The token embedding's size: Hugging Face's get_input_embeddings, else the first
    nn.Embedding of the model (None if it has none)."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if emb is None:
        emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return getattr(emb, "num_embeddings", None)


def output_vocab_size(model: torch.nn.Module) -> int | None:
    """The output projection's size (Hugging Face's get_output_embeddings), or None."""
    get = getattr(model, "get_output_embeddings", None)
    out = get() if callable(get) else None
    return getattr(out, "out_features", None)
