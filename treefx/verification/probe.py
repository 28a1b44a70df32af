"""The probe forest the first-call check runs (every tree shape that breaks tree training),
and the vocabulary its token ids are drawn below."""

from __future__ import annotations

import numpy as np
import torch

from .. import reference as oracle_mod
from ..tree import Tree
from .oracle import model_state_kept

__all__ = ["VocabularyUnknown", "declared_vocab_sizes", "probe_forest", "probe_vocab_size"]


def probe_forest(vocab_size: int, *, min_tokens: int = 0, seed: int = 0) -> list[Tree]:
    """The small forest the first-call check runs: every tree shape that breaks tree training.

    Two trees with every shape that breaks tree training: a shared prefix with branches, a
    single-token node, a sequence that ends inside another (a prefix of it), a duplicate
    sequence, a one-token sequence, random weights and loss masks on one tree and none on the
    other. Segments are scaled so that the forest has at least ``min_tokens`` tokens (more
    than one attention block on the GPU)."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    rng = np.random.default_rng(seed)
    scale = 1
    while True:
        trees = _probe_trees(rng, vocab_size, scale)
        if sum(t.num_tokens for t in trees) >= min_tokens:
            return trees
        scale *= 2
        rng = np.random.default_rng(seed)


def _probe_trees(rng, vocab: int, scale: int) -> list[Tree]:
    def seg(n):
        return rng.integers(0, vocab, size=n * scale).tolist()

    def fresh(prefix, n):
        """A segment whose first token differs from ``prefix``'s (so siblings branch)."""
        s = seg(n)
        while prefix and s[0] == prefix[0]:
            s[0] = int(rng.integers(0, vocab))
        return s

    root = seg(5)
    a = seg(4)
    b = fresh(a, 6)
    x = [int(rng.integers(0, vocab))]
    y = fresh(x, 1)
    c = fresh(root[3:], 3)
    first = [
        root + a,
        root + a + x,  # a single-token node
        root + a + y,
        root + b,
        root[:3],  # ends inside the root node: a prefix of every other sequence
        root + b,  # a duplicate
        root[:3] + c,
    ]
    weights = rng.uniform(0.5, 1.5, size=len(first)).tolist()
    masks = [(rng.random(len(s)) < 0.8).astype(int).tolist() for s in first]
    trunk, tail = seg(4), seg(5)
    one = fresh(trunk, 1)  # a one-token sequence: a root of its own, nothing to predict
    second = [trunk + tail, trunk + fresh(tail, 2), one]
    return [Tree.from_sequences(first, weights=weights, loss_masks=masks),
            Tree.from_sequences(second)]


class VocabularyUnknown(ValueError):
    """The probe cannot tell which token ids a model takes. ``reason``: why, in words."""

    def __init__(self, model: torch.nn.Module, reason: str):
        self.reason = reason
        super().__init__(
            f"cannot tell which token ids {type(model).__name__} takes for the probe forest: "
            f"{reason}; pass trees= of its token ids (or vocab_size=) to treefx.verify, or give "
            "the model a config with vocab_size (model.config.vocab_size)")


def declared_vocab_sizes(model: torch.nn.Module) -> list[int]:
    """The vocabulary sizes a model declares: ``model.config.vocab_size``, its input
    embedding's ``num_embeddings`` (``get_input_embeddings()``) and its output layer's
    ``out_features`` (``get_output_embeddings()``), those it has."""
    sizes = []
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        sizes.append(size)
    for getter, attr in (("get_input_embeddings", "num_embeddings"),
                         ("get_output_embeddings", "out_features")):
        get = getattr(model, getter, None)
        try:
            module = get() if callable(get) else None
        except (NotImplementedError, AttributeError):
            module = None
        size = getattr(module, attr, None)
        if isinstance(size, int) and size > 0:
            sizes.append(size)
    return sizes


def _measured_vocab_size(model: torch.nn.Module) -> tuple[int | None, str]:
    """The model run once on two tokens of id 0 (no grad, its state kept): the width of its
    logits, and of the ``nn.Embedding`` the ids go into if one does; ``(None, why)`` if it
    cannot run so."""
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    fed = []

    def record(module, args):
        if args and args[0] is ids:
            fed.append(module.num_embeddings)

    handles = [m.register_forward_pre_hook(record) for m in model.modules()
               if isinstance(m, torch.nn.Embedding)]
    try:
        with model_state_kept(model, []), torch.no_grad(), oracle_mod.oracle_attention(model):
            logits = oracle_mod.logits_of(model(ids))
    except Exception as e:  # noqa: BLE001 - any failure: the size is not known
        first_line = (str(e).strip().splitlines() or [""])[0][:200]
        return None, f"running it on two tokens of id 0 failed: {type(e).__name__}: {first_line}"
    finally:
        for h in handles:
            h.remove()
    if logits.dim() < 2 or tuple(logits.shape[-3:-1]) not in ((1, 2), (2,)):
        return None, (f"its output on two tokens has shape {tuple(logits.shape)}, not "
                      "[1, 2, vocabulary]")
    return min([int(logits.shape[-1]), *fed]), ""


def probe_vocab_size(model: torch.nn.Module, largest_id: int | None = None) -> int:
    """Token ids the probe forest may use are below this: the smallest vocabulary the model
    declares (:func:`declared_vocab_sizes`); else the width of its logits (and of the
    ``nn.Embedding`` its ids go into), the model run once on two tokens; else ``largest_id +
    1``, the largest id of a batch the model takes. A :class:`VocabularyUnknown` when none
    tells. (The first ``nn.Embedding`` of a model need not be its token embedding: a model
    whose token embedding is a custom module may have one for positions.)"""
    sizes = declared_vocab_sizes(model)
    if sizes:
        return min(sizes)
    measured, why = _measured_vocab_size(model)
    if measured is not None and measured >= 2:
        return measured
    if largest_id is not None and largest_id >= 1:
        return largest_id + 1
    if measured is not None:
        why = f"its logits have {measured} entries"
    raise VocabularyUnknown(model, "it declares no vocabulary (no config.vocab_size, "
                                   f"get_input_embeddings() or get_output_embeddings()), and {why}")
