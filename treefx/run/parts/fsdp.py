"""FSDP2 under :func:`treefx.backward`: every rank's parts run as one common sequence of
rounds, so that the collectives of their forwards and backwards (each layer's gather and
reduce-scatter) pair up across ranks."""

from __future__ import annotations

from ...compiler import TreeCompileError
from .executor import Run

__all__ = ["rounds"]


def rounds(run: Run, group) -> None:
    """Every rank's events run as one common sequence of rounds (FSDP2: each part's forward
    and backward gathers and reduce-scatters every layer, collectives all ranks must call in
    one order). The ranks' event strings are exchanged once; a round is a forward if any
    rank's next event is one, else a backward. A rank whose next event is not the round's
    runs a zero-weight dummy part's forward, or a held dummy's backward: every rank has run
    as many rounds, so every rank holds as many parts, and in a backward round that is at
    least one (a rank with a real backward holds it), all dummies on a rank that is done.
    The dummies left at the end run their backwards together."""
    import torch.distributed as dist

    def exchange() -> list:
        mine = "".join(e for e, _ in run.events)
        strings: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(strings, mine, group=group)
        return strings

    strings = exchange()
    # Every round lasts as long as its largest part: each rank cuts its trees into as many
    # parts as the rank with the most, as evenly as its trees allow (parts.plan_even), and
    # the event strings are exchanged again. Counted on real agent trees (benchmarks.balance
    # --rounds; medians over random steps of 2-8 ranks with 1-4 trees each), the rounds'
    # largest parts summed to 1.17-1.81x the busiest rank's tokens with each rank's own
    # plan, 1.00-1.50x so.
    most = max(s.count("F") for s in strings)
    if most > 1 and len(strings) > 1:
        run.even_parts(most)
        strings = exchange()
    # _Run plans without recompute parts under FSDP2; should one come, every rank sees it
    # here and all refuse together
    if any("R" in s for s in strings):
        raise TreeCompileError(
            "treefx.backward under FSDP2: a rank's plan recomputes parts (an open path longer "
            "than max_tokens lets it hold), whose second forward would gather the layers once "
            "more than the other ranks do. Raise max_tokens until treefx.parts.plan(batch, "
            "max_tokens).recompute_tokens is 0 on every rank, or use DDP")
    me = dist.get_rank(group)
    pos = [0] * len(strings)
    while True:
        nxt = [s[p] if p < len(s) else None for s, p in zip(strings, pos)]
        if all(x is None for x in nxt):
            break
        event = "F" if "F" in nxt else "B"
        real = run.events[pos[me]][1] if nxt[me] == event else None
        if event == "F":
            run.forward(real, group=group)
        elif real is not None:
            run.backward(real)
        else:
            run.backward(None)
        for r, x in enumerate(nxt):
            pos[r] += x == event
    while run.dummies:  # as many on every rank: backward rounds of dummies only
        run.backward(None)
    run.finish()
