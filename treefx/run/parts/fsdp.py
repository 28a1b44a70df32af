"""FSDP2 under :func:`treefx.backward`, two ways of pairing up the ranks' collectives:

- :func:`gather_once` (``fsdp="gather_once"``): every unit gathered once before the parts and
  held, the gradients accumulated unsharded and reduce-scattered once at the end (ZeRO-2 style
  for parts), so that each rank runs its own parts with no collective between them;
- :func:`rounds` (``fsdp="rounds"``): every rank's parts run as one common sequence of
  rounds, so that the collectives of their forwards and backwards (each layer's gather and
  reduce-scatter) pair up across ranks; memory stays sharded.

docs/distributed.md ("Trees larger than memory in parts") says what each holds and waits, and
why rounds is the default."""

from __future__ import annotations

import contextlib

import torch

from ...compiler import TreeCompileError
from .. import wrapping
from .executor import Run

__all__ = ["MODES", "gather_once", "held_bytes", "rounds"]

MODES = ("gather_once", "rounds")

# FSDP2's public methods gather_once calls (torch 2.11 and 2.13 have them all)
_API = ("unshard", "reshard", "set_reshard_after_forward", "set_reshard_after_backward",
        "set_requires_gradient_sync")


def held_bytes(model: torch.nn.Module) -> int:
    """What :func:`gather_once` holds beyond the shards for the whole step: every parameter
    unsharded and, for those that train, its unsharded gradient (each in the parameter's
    dtype; a mixed-precision policy's dtypes aside)."""
    return sum(p.numel() * p.element_size() * (2 if p.requires_grad else 1)
               for p in model.parameters())


def _check_api(unit) -> None:
    missing = [name for name in _API if not callable(getattr(unit, name, None))]
    if missing:
        raise TreeCompileError(
            f"treefx.backward(..., fsdp='gather_once'): this torch's FSDP2 ({torch.__version__}) "
            f"has no FSDPModule.{', .'.join(missing)}; use fsdp='rounds' (every rank's parts "
            "in common rounds), or a torch with them (2.11 and later)")


@contextlib.contextmanager
def _settings_restored(units):
    """Each unit's gather and reduce settings (what FSDP2's setters change: when it reshards
    after forward and after backward, whether it reduces gradients) as they were on entry,
    restored on exit; FSDP2 has setters for them, not getters, so they are read from its
    parameter groups."""
    saved = []
    try:
        for m in units:
            state = m._get_fsdp_state()
            saved.append((state, getattr(state, "_auto_reshard_after_forward", None),
                          [(g, g.post_forward_mesh_info, g.reshard_after_backward,
                            g.reduce_grads, g.all_reduce_grads)
                           for g in wrapping.fsdp_param_groups(m)]))
    except AttributeError as e:
        raise TreeCompileError(
            f"treefx.backward(..., fsdp='gather_once'): this torch's FSDP2 ({torch.__version__}) "
            f"keeps its settings elsewhere ({e}), so they could not be restored after the "
            "call; use fsdp='rounds'") from e
    try:
        yield saved
    finally:
        for state, auto, groups in saved:
            if auto is not None:
                state._auto_reshard_after_forward = auto
            for g, post_forward, after_backward, reduce, all_reduce in groups:
                g.post_forward_mesh_info = post_forward
                g.reshard_after_backward = after_backward
                g.reduce_grads, g.all_reduce_grads = reduce, all_reduce


def gather_once(run: Run, model: torch.nn.Module) -> None:
    """The run's parts under FSDP2 with no collective between them (ZeRO-2 style for parts).

    1. Every unit is gathered (``unshard()``, the root first, in module order on every rank:
       the step's only all-gathers) and kept gathered through the parts
       (``set_reshard_after_forward(False)``, ``set_reshard_after_backward(False)``), and the
       gradients accumulate unsharded (``set_requires_gradient_sync(False)``).
    2. Each rank runs its own parts, in its own plan's order (recompute parts too): their
       forwards gather nothing, their backwards reduce nothing, and a capture finds the units
       gathered and leaves them so (:func:`treefx.run.regional.capture_state`).
    3. Every rank, with its settings as they were, runs one two-token part of zero weight
       (its loss backpropagated with a zero gradient, so it adds nothing): the same graph on
       every rank, whose backward reaches every unit's post-backward hook in one order; there
       FSDP reduce-scatters the accumulated gradients (the step's only reduce-scatters, into
       the sharded ``.grad``) and reshards. Every trained parameter has a gradient before it
       (a zero one where this rank's parts left none), so every rank reduce-scatters the same
       tensors.

    A rank without trees runs only steps 1 and 3. The settings are restored, and the units
    resharded, on the way out (an error too)."""
    units = wrapping.fsdp_units(model)
    _check_api(units[0])
    units[0]._get_fsdp_state()._lazy_init()  # FSDP's root found (as its first forward does)
    with _settings_restored(units) as saved:
        try:
            for m in units:
                m.set_reshard_after_forward(False, recurse=False)
                m.set_reshard_after_backward(False, recurse=False)
                m.set_requires_gradient_sync(False, recurse=False)
            for m in units:
                m.unshard()
            run.run_in_order()
            run.finish()
            # the step's reduce-scatters: the units' own settings back, except that they stay
            # gathered until their backward (no gather again for the last forward)
            for (_, _, groups) in saved:
                for g, _, after_backward, reduce, all_reduce in groups:
                    g.reshard_after_backward = after_backward
                    g.reduce_grads, g.all_reduce_grads = reduce, all_reduce
            _zero_missing_grads(units)
            run.forward(None)
            run.backward(None)
        finally:
            for m in units:  # local: frees what a unit still holds, no collective
                if wrapping.fsdp_gathered(m):
                    m.reshard()
    run.finish()


def _zero_missing_grads(units) -> None:
    """A zero gradient for every gathered parameter that trains and has none (one this rank's
    parts did not reach, or every one on a rank without trees), so that FSDP's
    reduce-scatter on every rank takes the same parameters."""
    seen = set()
    for m in reversed(units):  # innermost first: a unit's own parameters are not its inner units'
        for p in m.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)


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
    # Run plans without recompute parts in rounds; should one come, every rank sees it
    # here and all refuse together
    if any("R" in s for s in strings):
        raise TreeCompileError(
            "treefx.backward under FSDP2: a rank's plan recomputes parts (an open path longer "
            "than max_tokens lets it hold), whose second forward would gather the layers once "
            "more than the other ranks do. Raise max_tokens until treefx.parts.plan(batch, "
            "max_tokens).recompute_tokens is 0 on every rank, or pass fsdp='gather_once' "
            "(no collective between parts), or use DDP")
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
