"""The passes and the order they run in (see docs/ARCHITECTURE.md, "The compiler")."""

from __future__ import annotations

import logging

from .attention import attention_pass, check_no_attention_left
from .common import (
    GraphBreakError,
    GraphContext,
    Rewrite,
    TreeCompileError,
    UnmatchedAttentionError,
)
from ..plan import PartFindings
from .dce import eliminate_dead_code
from .heads import merged_heads_pass
from .logprobs import logprobs_pass
from .parts import finish as finish_part
from .loss import check_loss_found, loss_pass
from .positions import positions_pass
from .selection import check_key_selections, key_selection_pass
from .ssm import UnmatchedStateError, check_no_state_left, ssm_pass
from .subgraphs import UnsupportedSubgraphError, check_opaque_ops, discover, prune
from .tokens import SpecializedGraphError, TokenAxisError, check_token_axis

__all__ = [
    "GraphBreakError",
    "GraphContext",
    "Rewrite",
    "SpecializedGraphError",
    "TokenAxisError",
    "TreeCompileError",
    "UnmatchedAttentionError",
    "UnmatchedStateError",
    "UnsupportedSubgraphError",
    "run_passes",
]

log = logging.getLogger("treefx")

# Positions first: the attention pass then finds the model's masks already evaluated at path
# positions, and keeps them (ANDed with the tree) instead of dropping them. A top-k over a
# score row's keys (a sparse-attention indexer) gets the tree mask in its own mask. Attention
# over merged batch·head rows is put in the [B, H, N, D] form the attention pass matches.
PASSES = (
    ("positions", positions_pass),
    ("selection", key_selection_pass),
    ("heads", merged_heads_pass),
    ("attention", attention_pass),
    ("ssm", ssm_pass),
    ("loss", loss_pass),
    ("logprobs", logprobs_pass),
)


def run_passes(ctx: GraphContext) -> PartFindings | None:
    """Every pass over the root graph and every higher-order-op body in it (activation
    checkpointing, ...), each pass on all graphs before the next (the attention pass of a body
    may read a mask the root built, which must still be there), then dead
    code out (effects kept, :mod:`.dce`; nothing is removed before every pass ran, since a
    body may still import a root node that looks unused), then the checks. Returns, for a
    part's graph, what :func:`.parts.finish` found (else None)."""
    discover(ctx)
    scopes = list(ctx.scopes())
    for name, fn in PASSES:
        count = sum(fn(c) for c in scopes)
        log.info("pass %s: %d rewrite(s)", name, count)
    check_loss_found(ctx)
    found = finish_part(ctx) if ctx.part is not None else None
    if ctx.plan is not None and ctx.plan.find_layout:
        return found  # a capture that only finds a part's layout is never run
    prune(ctx, eliminate_dead_code)  # what the rewrites replaced must not trip the checks
    for c in scopes:
        check_opaque_ops(c)
        check_no_attention_left(c)
        check_token_axis(c)
        check_key_selections(c)
        check_no_state_left(c)
    for c in scopes:
        c.graph.lint()
        c.gm.recompile()
    for r in ctx.log:
        log.debug("%s: %s [%s] -> %s", r.pass_name, r.before, r.module, r.after)
    return found
