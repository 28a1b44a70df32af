"""The passes and the order they run in (see docs/ARCHITECTURE.md, "The compiler")."""

from __future__ import annotations

import logging

from ..plan import PartFindings
from .checks.dce import eliminate_dead_code
from .checks.leftovers import (
    check_key_selections,
    check_loss_found,
    check_no_attention_left,
    check_no_state_left,
)
from .checks.subgraphs import check_opaque_ops, discover, prune
from .checks.tokens import check_token_axis
from .find import attention as find_attention
from .find import logprobs as find_logprobs
from .find import loss as find_loss
from .find import ssm as find_ssm
from .graph import GraphContext
from .lower import parts, whole
from .lower.positions import positions_pass
from .registry import finders, rewrites

__all__ = ["PASSES", "run_passes"]

log = logging.getLogger("treefx")

def find_and_lower(find):
    """A pass that lowers every site ``find(ctx)`` yields, for the context's mode (a part of a
    tree: :mod:`.lower.parts`, else :mod:`.lower.whole`, which reads the backend) and in the
    order found; returns how many. A recogniser that yields as it goes has each site lowered
    before it looks at the next (as the passes always did); the attention recogniser returns
    all its sites before any is lowered."""

    def run(ctx: GraphContext) -> int:
        lowering = parts if ctx.part is not None else whole
        count = 0
        for site in find(ctx):
            lowering.lower(ctx, site)
            count += 1
        return count

    run.__name__ = f"lower_{getattr(find, '__name__', 'sites')}"
    return run


def family_sites(kind: str):
    """The sites of ``kind`` every registered family finder yields (:mod:`.registry`), finder
    by finder."""

    def sites(ctx: GraphContext):
        for find in finders(kind):
            yield from find(ctx)

    sites.__name__ = kind
    return sites


def family_rewrites(pass_name: str):
    """A pass that runs every rewrite the families registered for ``pass_name``; returns how
    many rewrites they made."""

    def run(ctx: GraphContext) -> int:
        return sum(fn(ctx) for fn in rewrites(pass_name))

    run.__name__ = f"{pass_name}_rewrites"
    return run


# Each pass finds its sites and lowers them, on all graphs before the next pass (a finder reads
# what the passes before it rewrote). Positions first: the attention pass then finds the
# model's masks already evaluated at path positions, and keeps them (ANDed with the tree)
# instead of dropping them. A top-k over a score row's keys (a sparse-attention indexer) gets
# the tree mask in its own mask. Attention over merged batch·head rows is put in the [B, H, N,
# D] form the attention recogniser matches. Positions and heads need neither mode nor backend:
# one rewrite each. Selection and heads are what model families registered (:mod:`.registry`:
# DeepSeek's indexer, merged batch·head attention).
PASSES = (
    ("positions", positions_pass),
    ("selection", find_and_lower(family_sites("selection"))),
    ("heads", family_rewrites("heads")),
    ("attention", find_and_lower(find_attention.sites)),
    ("ssm", find_and_lower(find_ssm.sites)),
    ("loss", find_and_lower(find_loss.sites)),
    ("logprobs", find_and_lower(find_logprobs.sites)),
)


def run_passes(ctx: GraphContext) -> PartFindings | None:
    """Every pass over the root graph and every higher-order-op body in it (activation
    checkpointing, ...), each pass on all graphs before the next (the attention pass of a body
    may read a mask the root built, which must still be there), then each mode's
    finish (:func:`.lower.whole.finish`, :func:`.lower.parts.finish`), then dead
    code out (effects kept, :mod:`.checks.dce`; nothing is removed before every pass ran, since a
    body may still import a root node that looks unused), then the checks. Returns, for a
    part's graph, what :func:`.lower.parts.finish` found (else None)."""
    discover(ctx)
    scopes = list(ctx.scopes())
    for name, fn in PASSES:
        count = sum(fn(c) for c in scopes)
        log.info("pass %s: %d rewrite(s)", name, count)
    check_loss_found(ctx)
    found = parts.finish(ctx) if ctx.part is not None else whole.finish(ctx)
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
