"""The lifted mask probed on pairs of positions: whether the tree implies it (a plain causal
mask, which can go) and whether it lets a query see a later key (no tree form)."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..graph import example, is_call
from .lifted import LiftedMask

__all__ = ["implied_by_tree", "is_all_ones_input", "sees_later_keys"]


def _probe_pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """(q_pos, kv_pos) pairs with kv_pos <= q_pos: every small position and distance, and
    positions and distances around each power of two up to 2^22 (4M tokens)."""
    marks = sorted({v for k in range(6, 23) for v in (2**k - 1, 2**k, 2**k + 1, 3 * 2**k)})
    qs = list(range(65)) + marks
    ds = list(range(65)) + marks
    pairs = [(q, q - d) for q in qs for d in ds if d <= q]
    t = torch.tensor(pairs, dtype=torch.int64)
    return t[:, 0], t[:, 1]


def is_all_ones_input(node) -> bool:
    """``torch.ones_like(<graph input>)`` (the attention_mask treefx gives the model), through
    casts and copies."""
    while is_call(node, methods=("to", "bool", "long", "int", "float", "contiguous", "clone",
                                 "view", "reshape")):  # a view of all ones is all ones
        node = node.args[0]
    return is_call(node, torch.ones_like) and isinstance(node.args[0], fx.Node) and \
        node.args[0].op == "placeholder"


def implied_by_tree(lifted: LiftedMask, leaves: tuple[fx.Node, ...]) -> bool:
    """Whether the model's mask is True for every key that the tree lets a query see.

    On a tree a visible key is an ancestor (or the token itself), so its position is at most
    the query's. A mask that is True on every probed pair with kv_pos <= q_pos, reading no data
    but our own all-ones padding mask, is the plain causal mask in positions: the tree mask
    implies it and it can go, keeping the tree's full blocks. A sliding window, chunked
    attention or anything else position-dependent shows up as a False pair and is kept.
    """
    out = _probe(lifted, leaves, *_probe_pairs())
    return out is not None and bool(out.all())


def _probe(lifted: LiftedMask, leaves, q: torch.Tensor, kv: torch.Tensor):
    """The mask at each (q[i], kv[i]) pair, [len(q)] bool; None where it reads data other than
    treefx's all-ones padding mask or cannot be evaluated so."""
    bufs = []
    for leaf in leaves:
        val = example(leaf)
        if not is_all_ones_input(leaf) or val is None or val.dim() != 2 or val.shape[0] != 1:
            return None
        bufs.append(torch.ones(1, int(max(q.max(), kv.max())) + 1, dtype=val.dtype))
    zero = torch.zeros((), dtype=torch.int64)
    try:
        with torch.no_grad():
            out = lifted.evaluate(zero, zero, q, kv, *bufs)
    except Exception:  # noqa: BLE001 - a mask the probe cannot evaluate is not judged here
        return None
    return out.reshape(-1).expand(q.shape[0]) if out.numel() == 1 else out.reshape(-1)


def sees_later_keys(lifted: LiftedMask, leaves: tuple[fx.Node, ...]) -> tuple[int, int] | None:
    """A (q_pos, kv_pos) pair with kv_pos > q_pos that the model's mask lets the query see
    (a bidirectional span: Gemma 3's image tokens, a prefix-LM prefix), or None. A tree gives
    each sequence its own later tokens, so such a mask has no tree form. Probed where the
    mask reads no data but treefx's all-ones padding mask (else None: the first-call check's
    causality probe is left to find it)."""
    kv, q = _probe_pairs()  # swapped: every pair has kv_pos >= q_pos
    later = kv > q
    q, kv = q[later], kv[later]
    out = _probe(lifted, leaves, q, kv)
    if out is None:
        return None
    hit = out.nonzero()
    return None if hit.numel() == 0 else (int(q[hit[0, 0]]), int(kv[hit[0, 0]]))
