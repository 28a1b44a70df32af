"""Logprobs pass: a compiled model asked for log-probabilities only
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

import logging

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..ops.cross_entropy import tree_token_logprobs
from ..ops.logprobs import fused_linear_tree_logprobs, token_logprobs_site
from .common import GraphContext, describe, is_call
from .loss import _projection_only_for, _strip

__all__ = ["logprobs_pass"]

log = logging.getLogger("treefx")

_LINEAR = (F.linear, torch._C._nn.linear)


def logprobs_pass(ctx: GraphContext) -> int:
    """Rewrite every log-probability site; returns how many."""
    g = ctx.graph
    count = 0
    for site in [n for n in g.nodes if is_call(n, token_logprobs_site)]:
        logits, ids, parent = site.args
        proj = _projection_only_for(_strip(logits), site)
        with g.inserting_before(site):
            if proj is not None:
                h, weight, bias = proj
                # a part's labels are mostly trained tokens (only those for treefx.backward's
                # own loss): its backward takes every row, without a host synchronization
                new = g.call_function(fused_linear_tree_logprobs,
                                      (h, weight, bias, ids, parent, ctx.part is not None))
                note = "fused with the output projection: the logits are not built"
            else:
                new = g.call_function(tree_token_logprobs, (logits, ids, parent))
                note = f"the logits are built: {_why_not_fused(logits)}"
                log.warning("treefx.compile(logits=False): %s", note)
        new.meta["example_value"] = site.meta.get("example_value")
        ctx.record("logprobs", site, describe(new), note=note)
        site.replace_all_uses_with(new)
        g.erase_node(site)
        count += 1
    return count


def _why_not_fused(logits: fx.Node) -> str:
    node = _strip(logits)
    if not is_call(node, *_LINEAR):
        return (f"they come from `{describe(node)}`, not straight from the output projection "
                "(a linear layer)")
    return "the logits (or the projection's output) feed more than the log-probabilities"
