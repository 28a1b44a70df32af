"""Random trees with the odd shapes that break tree training: single-token nodes, a sequence
that is a prefix of another, duplicate sequences, single-token sequences, forests."""

from __future__ import annotations

import numpy as np

import treefx


def random_sequences(seed: int, vocab: int = 64, n: int = 7, max_len: int = 12) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    seqs: list[list[int]] = []
    for _ in range(n):
        if seqs and rng.random() < 0.7:
            base = seqs[rng.integers(len(seqs))]
            cut = int(rng.integers(0, len(base) + 1))
            tail = rng.integers(0, vocab, size=int(rng.integers(0, max_len // 2 + 1))).tolist()
            s = base[:cut] + tail
        else:
            s = rng.integers(0, vocab, size=int(rng.integers(1, max_len + 1))).tolist()
        seqs.append(s or [int(rng.integers(vocab))])
    return seqs


def odd_tree(seed: int, vocab: int = 64, *, masks: bool = True) -> treefx.Tree:
    """A tree with every odd shape at once, plus random weights and loss masks."""
    rng = np.random.default_rng(seed + 1000)
    seqs = random_sequences(seed, vocab)
    a = seqs[0] + [1, 2, 3]
    seqs += [
        a,
        a[:2],  # a prefix of another sequence (ends inside the tree)
        list(a),  # a duplicate
        a + [5],  # a single-token node
        a + [6],
        [int(rng.integers(vocab))],  # a one-token sequence: nothing to predict
    ]
    weights = rng.uniform(0.1, 1.0, size=len(seqs))
    loss_masks = [(rng.random(len(s)) < 0.8).astype(int).tolist() for s in seqs] if masks else None
    return treefx.Tree.from_sequences(seqs, weights=weights, loss_masks=loss_masks)


def odd_forest(seed: int, vocab: int = 64) -> list[treefx.Tree]:
    return [odd_tree(seed, vocab), odd_tree(seed + 1, vocab, masks=False)]


def check_forward(tm, trees, *, atol: float, grad: bool = False, **pack_options):
    """A compiled model's tree log-probs against the per-branch oracle (the unmodified model on
    each sequence alone), forward only (``grad``: with autograd on). Returns the output."""
    import torch

    batch = treefx.pack(trees, **pack_options)
    with torch.set_grad_enabled(grad):
        out = tm(batch)
    with torch.no_grad():
        ref = treefx.reference.sequence_logprobs(tm.model, trees)
    for i, lp in enumerate(ref):
        torch.testing.assert_close(out.token_logprobs[batch.sequence_index(i)[1:]].detach(), lp,
                                   atol=atol, rtol=0)
    return out
