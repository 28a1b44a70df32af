"""Per-row statistics of a tree's logits over the vocabulary, for the trainers' integrations.

A trainer asks for each row position's log-probability of its next token, and the entropy (and
other statistics) of the distribution there. On a tree, positions of different rows that share
a prefix share one logits row: the statistics are computed once per distinct tree row and
gathered back to the positions (:func:`logits_row_statistics`), in chunks of rows, each chunk
recomputed in the backward rather than held (no [rows, vocab] float32 copy of the logits is
kept for the backward)."""

from __future__ import annotations

import torch
import torch.utils.checkpoint

__all__ = ["CHUNK_ROWS", "logits_row_statistics"]

#: Logits rows per chunk: [rows, vocab] in float32 at a time (0.6 GB at a 152k vocabulary).
CHUNK_ROWS = 1024


def logits_row_statistics(logits: torch.Tensor, rows: torch.Tensor, temperature: float = 1.0, *,
                          entropy: bool = False, sum_pi_squared: bool = False,
                          chunk_rows: int = CHUNK_ROWS):
    """For each index ``r`` of ``rows`` into ``logits`` [N, V], with ``z = logits[r] /
    temperature`` in float32: ``(lse, ent, spp)``, the log-sum-exp of ``z``; the entropy of
    ``softmax(z)`` (``lse − Σ p·z``) when ``entropy``, else None; ``Σ p²`` when
    ``sum_pi_squared``, else None. Differentiable; in chunks of ``chunk_rows`` rows, each
    checkpointed when gradients are on."""

    def chunk(z_all, idx):
        z = z_all[idx].float() / temperature
        lse = torch.logsumexp(z, dim=-1)
        empty = lse.new_zeros(0)
        if not (entropy or sum_pi_squared):
            return lse, empty, empty
        p = torch.softmax(z, dim=-1)
        ent = lse - (p * z).sum(-1) if entropy else empty
        spp = (p * p).sum(-1) if sum_pi_squared else empty
        return lse, ent, spp

    grad = torch.is_grad_enabled() and logits.requires_grad
    parts = []
    for idx in rows.split(chunk_rows):
        if grad:
            parts.append(torch.utils.checkpoint.checkpoint(chunk, logits, idx, use_reentrant=False))
        else:
            parts.append(chunk(logits, idx))
    if not parts:
        empty = logits.new_zeros(0, dtype=torch.float32)
        return empty, (empty if entropy else None), (empty if sum_pi_squared else None)
    lse, ent, spp = (torch.cat(list(col)) for col in zip(*parts))
    return lse, (ent if entropy else None), (spp if sum_pi_squared else None)
