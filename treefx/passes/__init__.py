"""The passes and the order they run in (see ARCHITECTURE.md, "The compiler")."""

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
from .loss import loss_pass
from .positions import positions_pass
from .ssm import UnmatchedStateError, check_no_state_left, ssm_pass

__all__ = [
    "GraphBreakError",
    "GraphContext",
    "Rewrite",
    "TreeCompileError",
    "UnmatchedAttentionError",
    "UnmatchedStateError",
    "run_passes",
]

log = logging.getLogger("treefx")

# Positions first: the attention pass then finds the model's masks already evaluated at path
# positions, and keeps them (ANDed with the tree) instead of dropping them.
PASSES = (
    ("positions", positions_pass),
    ("attention", attention_pass),
    ("ssm", ssm_pass),
    ("loss", loss_pass),
)


def run_passes(ctx: GraphContext) -> GraphContext:
    for name, fn in PASSES:
        count = fn(ctx)
        log.info("pass %s: %d rewrite(s)", name, count)
    check_no_attention_left(ctx)
    check_no_state_left(ctx)
    ctx.graph.eliminate_dead_code()
    ctx.graph.lint()
    ctx.gm.recompile()
    for r in ctx.log:
        log.debug("%s: %s [%s] -> %s", r.pass_name, r.before, r.module, r.after)
    return ctx
