"""Log-probabilities recogniser: a compiled model asked for log-probabilities only
(``treefx.compile(model, logits=False)``) reads them from its hidden states, the output
projection fused with the log-softmax in chunks, so the [N, vocab] logits are never built.

The captured function marks where it reads the log-probabilities from the logits
(:func:`treefx.ops.logprobs.token_logprobs_site`, one node). When those logits are
``linear(h, W, b)`` and feed nothing else (through reshapes and casts), the site becomes
:func:`treefx.ops.logprobs.fused_linear_tree_logprobs` of ``h``, ``W``, ``b`` and the dead
projection goes with dead-code elimination. Otherwise (a model that transforms its logits
after the projection: a final softcap, a LoRA adapter on the output layer) the logits are
built, the values are the same, and a warning says why.
"""

from __future__ import annotations

import torch.fx as fx

from ...ops.logprobs import token_logprobs_site, token_loss_site
from ..graph import GraphContext, describe, is_call
from ..sites import LogprobsSite
from .loss import LINEAR, projection_only_for, strip_reshapes

__all__ = ["sites", "why_not_fused"]


def sites(ctx: GraphContext):
    """Every log-probability site of ``ctx``'s graph (the markers
    :func:`treefx.ops.logprobs.token_logprobs_site` and, in a part graph that makes its own
    loss, :func:`treefx.ops.logprobs.token_loss_site`)."""
    for site in [n for n in ctx.graph.nodes if is_call(n, token_logprobs_site, token_loss_site)]:
        logits, ids, parent, *weights = site.args
        yield LogprobsSite(site, logits, ids, parent,
                           projection_only_for(strip_reshapes(logits), site),
                           weights[0] if weights else None)


def why_not_fused(logits: fx.Node) -> str:
    """Why the log-probabilities at ``logits`` are not fused with the output projection."""
    node = strip_reshapes(logits)
    if not is_call(node, *LINEAR):
        return (f"they come from `{describe(node)}`, not straight from the output projection "
                "(a linear layer)")
    return "the logits (or the projection's output) feed more than the log-probabilities"
