"""Random trees with the odd shapes that break tree training: single-token nodes, a sequence
that is a prefix of another, duplicate sequences, single-token sequences, forests."""

from __future__ import annotations

import treefx
from treefx.tools.synth import odd_forest, odd_tree, random_sequences  # noqa: F401


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
