"""``treefx.backward``: the front end. Which model (a compiled one, or a ``@treefx.step``
with its model), what it is wrapped in, the first call's check, the batch; then the parts run
on this process alone, under DDP (:mod:`.ddp`), or under FSDP2 with its units gathered once or
in common rounds (:mod:`.fsdp`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ...compiler import TreeCompileError
from ...layout import TreeBatch, pack
from ...tree import Tree
from .. import wrapping
from ..model import TreeModel, tree_loss
from ..step import TreeStep
from .ddp import check_ddp, reduce_ddp, sync_ddp_buffers
from .executor import Run
from .fsdp import MODES, gather_once, held_bytes, rounds
from .registry import runner_for, step_runner
from .runner import PartRunner

__all__ = ["backward"]

log = logging.getLogger("treefx")


def backward(tm: TreeModel, trees: Tree | Iterable[Tree] | TreeBatch | None, *,
             max_tokens: int | None = None, max_memory=None, memory=None,
             reduction: str | None = None, loss_fn: Callable | None = None,
             num_sequences: int | None = None, loss_scale: float | None = None,
             model: torch.nn.Module | None = None, beyond: str = "recompute",
             fsdp: str | None = None) -> torch.Tensor:
    """Train on trees larger than memory: forward and backward in parts, each token computed once.

    Forward and backward of ``trees`` (one tree or a forest, packed as one batch) in parts of
    at most ``max_tokens`` tokens, planned by :func:`treefx.parts.plan` (a boundary may fall
    anywhere, inside a node too); the parameter gradients are added to ``.grad`` (like
    ``loss.backward()``). Returns the loss, detached: the batch's loss as
    :func:`treefx.tree_loss` gives it for ``treefx.pack(trees, reduction=...)``. How the parts
    train, what they hold and what they cost: docs/parts.md.

    ``tm``: a model from :func:`treefx.compile`. ``trees``: trees, packed here with
    ``reduction`` (default ``"mean"``), ``num_sequences`` and ``loss_scale`` as
    :func:`treefx.pack` takes them; or a batch packed already (:func:`treefx.pack`, or
    :func:`treefx.distributed.pack` for a rank's share of a global batch), which carries those.
    ``loss_fn(out, part_batch) -> scalar``: another per-token objective instead of
    :func:`treefx.tree_loss` (every :mod:`treefx.rl` objective), called once per part with
    ``out.token_logprobs`` [N] over the batch's row (the part's predicted tokens filled in, 0
    elsewhere; ``out.logits`` None) and the batch with its loss weights (and the coefficients
    :mod:`treefx.rl` reads) kept only on those tokens: the parts' losses add up to the batch's
    for any sum over tokens of a term of that token's log-probability. ``tm`` may instead be a
    ``@treefx.step`` function, its model given as ``model=``: it runs once per part, its
    cross-entropy rewritten to the part's predicted tokens, and the loss is what
    ``train_step(model, treefx.pack(trees))`` returns (its own reduction: no ``reduction`` or
    ``loss_fn``; it takes no extra arguments and returns the loss alone, a scalar).

    Gradients: a training linear layer's weight and the output projection's go straight into
    ``.grad`` in a part's backward (a zero ``.grad`` is made at the start where none is); a
    parameter with a gradient hook, and every parameter of a model run regionally (FSDP2,
    ``regional=True``), gets its gradient through autograd, once per part that reads it.

    Several processes (FSDP2, ``fully_shard`` per layer and root; DDP): every rank calls it
    with its share (:func:`treefx.distributed.pack`; None or ``[]`` for a rank without trees)
    and may cut it into its own parts; the gradients are one process's on all trees whole, the
    loss the rank's. DDP: the parts run on the inner module, the gradients averaged once at
    the end (a communication hook or mixed precision is refused). FSDP2, ``fsdp=``:
    ``"rounds"`` (the default) runs the ranks' parts in common rounds, each as long as its
    largest part (memory stays sharded); ``"gather_once"`` gathers every unit once and
    reduce-scatters the gradients once (ZeRO-2 style: each rank its own parts, no collective
    between them), holding every parameter and gradient unsharded for the call (counted in
    ``max_memory``). The same gradients either way: docs/distributed.md, "Trees larger than
    memory in parts"; docs/ARCHITECTURE.md, "Parts on several processes".

    ``max_memory`` (bytes, or ``"40GiB"``, ``"512MB"``): a budget in bytes instead, turned into
    the token budget with the fewest parts whose estimated peak fits by the memory model
    ``memory`` (default :func:`treefx.run.parts.memory.for_model`, or a calibrated
    :class:`~treefx.run.parts.memory.MemoryModel`; :func:`~treefx.run.parts.memory.plan_tokens`;
    docs/parts.md, "A memory budget": derived, not yet measured on a GPU). Given both budgets,
    the smaller wins. ``beyond``: what becomes of the open parts the budget cannot hold:
    ``"recompute"`` (the default) runs their forward again without a graph (refused in FSDP2's
    rounds and for a model that draws random numbers); ``"host"`` holds what their forward saves for
    their backward in host memory; ``"device"`` holds it on the device over the budget. Held
    besides, whatever the budget: the open path's keys, values and conv inputs
    (``plan.peak_context_tokens()``) and the states at the parts' boundaries. Activation
    checkpointing works in parts; attention the model scores itself (a softcap, a sink, a bias
    of positions) is exact, a bias read only at the part's own rows is refused. Runs on the
    compiled model's backend.

    The first call for a compiled model checks the part graph on a probe forest cut into parts
    against each sequence run alone, unless compiled with ``verify=False`` (or
    ``TREEFX_VERIFY=0``); the report is ``treefx.run.parts.runners(tm)[0].verification`` (a
    step is not checked, nor an FSDP2 model's part graph).
    """
    front = _Front.of(tm, model, loss_fn, reduction)
    mode = _fsdp_mode(fsdp, front.kind)
    if front.runner.verify:
        _check_first_call(tm, front, trees)
    batch = _batch(trees, front.kind, reduction, num_sequences, loss_scale)
    max_tokens = _token_budget(max_tokens, max_memory, memory, front, batch, beyond, mode)
    run = Run(front.runner, batch, max_tokens, front.target, step=front.step, loss_fn=loss_fn,
              collective=front.kind == "fsdp", lockstep=mode == "rounds", beyond=beyond)
    _run_parts(run, front, mode)
    return run.total.to(run.dtype)


@dataclass(frozen=True)
class _Front:
    """What a call trains: the ``@treefx.step`` function (None: a compiled model), the model
    it runs (``target``) and what wraps it (``root``), its distributed kind, its DDP wrapper,
    its ranks' process group and the part runner."""

    step: TreeStep | None
    target: torch.nn.Module
    root: torch.nn.Module
    kind: str | None
    wrapper: object
    group: object
    runner: PartRunner

    @classmethod
    def of(cls, tm, model, loss_fn, reduction) -> _Front:
        from ..engine import unwrap_compiled

        step = None
        if isinstance(tm, TreeStep):
            if not isinstance(model, torch.nn.Module):
                raise TypeError("treefx.backward(step, trees, model=..., max_tokens=...): a "
                                "@treefx.step function needs the model it trains as model=")
            if loss_fn is not None or reduction is not None:
                raise TypeError("treefx.backward: a @treefx.step function computes its own "
                                "loss and reduction; loss_fn= and reduction= are for a "
                                "compiled model")
            step, root = tm, unwrap_compiled(model)
            target = wrapping.unwrap_ddp(root)[0]
        elif isinstance(tm, TreeModel):
            if model is not None:
                raise TypeError("treefx.backward: model= goes with a @treefx.step function; a "
                                "model from treefx.compile is the first argument itself")
            target, root = tm.model, tm.root
        else:
            raise TypeError(f"treefx.backward takes a model from treefx.compile or a "
                            f"@treefx.step function, got {type(tm).__name__}")
        kind = wrapping.distributed_kind(target, root if root is not target else None)
        wrapper = wrapping.unwrap_ddp(root)[1] if kind == "ddp" else None
        if kind == "ddp":
            check_ddp(wrapper)
        group = wrapping.process_group(kind, target, wrapper)
        runner = runner_for(tm, own_loss=loss_fn is None) if step is None else \
            step_runner(step, target)
        return cls(step, target, root, kind, wrapper, group, runner)


def _check_first_call(tm, front: _Front, trees) -> None:
    """The runner's first-call check, once: skipped (and said why) under FSDP2."""
    runner = front.runner
    runner.verify = False
    if front.kind == "fsdp":
        # the probe's parts would gather and reduce-scatter (sharded .grad, collectives
        # every rank must match): not checked here; tests/test_distributed_parts.py
        runner.verification = ("not checked: the part graph of a model sharded with FSDP2 "
                               "is not probed on its first call")
        log.info("treefx.backward: %s", runner.verification)
    else:  # a DDP model's parts run on its inner module, with no collective
        if trees is not None:  # the probe's vocabulary, where the model declares none
            tm.note_token_ids(trees)
        wrapper = front.wrapper
        with wrapper.no_sync() if wrapper is not None else contextlib.nullcontext():
            _verify_first_call(tm, runner)


def _batch(trees, kind, reduction, num_sequences, loss_scale) -> TreeBatch | None:
    """The call's batch on the host: ``trees`` packed, or a packed batch; None for a rank
    without trees (under FSDP2 or DDP only)."""
    if trees is None or (isinstance(trees, (list, tuple)) and not trees):
        if kind is None:
            raise ValueError("treefx.backward: no trees (an empty forest trains nothing); a "
                             "rank with no trees passes None (or []) only under FSDP2 or DDP")
        return None
    if isinstance(trees, TreeBatch):
        given = [k for k, v in (("reduction", reduction), ("num_sequences", num_sequences),
                                ("loss_scale", loss_scale)) if v is not None]
        if given:
            raise TypeError(f"treefx.backward: a packed batch carries its own {given[0]}; "
                            "pack it with that, or pass the trees")
        return trees.to("cpu")
    return pack(trees, reduction=reduction or "mean", num_sequences=num_sequences,
                loss_scale=1.0 if loss_scale is None else loss_scale)


def _fsdp_mode(fsdp, kind) -> str | None:
    """``fsdp=`` checked: the FSDP2 mode of the call (its default ``"rounds"``), None for a
    model not sharded with FSDP2."""
    if fsdp is not None and fsdp not in MODES:
        raise ValueError(f"treefx.backward: fsdp must be one of {', '.join(map(repr, MODES))}, "
                         f"got {fsdp!r}")
    if kind != "fsdp":
        if fsdp is not None:
            raise TypeError(f"treefx.backward: fsdp={fsdp!r} is for a model sharded with "
                            f"FSDP2 (fully_shard); this one is "
                            f"{'wrapped in DDP' if kind == 'ddp' else 'not distributed'}")
        return None
    return fsdp or DEFAULT_FSDP


# FSDP2's default: rounds. gather_once holds every parameter and gradient unsharded for the
# whole call, which is the memory the user chose FSDP2's full sharding to avoid
# (docs/distributed.md, "Trees larger than memory in parts", has the reasoning and numbers).
DEFAULT_FSDP = "rounds"


def _run_parts(run: Run, front: _Front, mode: str | None) -> None:
    """The parts run: under FSDP2 with its units gathered once or in common rounds, under DDP
    on the inner module (its gradients averaged at the end), or on this process alone."""
    if mode == "gather_once":
        gather_once(run, front.target)
    elif front.kind == "fsdp":
        try:
            rounds(run, front.group)
        finally:
            run.release()
    elif front.kind == "ddp":
        # The parts run on the inner module, without DDP's hooks (no_sync: its reducer ignores
        # the parts' backwards); the gradients are averaged over the group once, at the end.
        with front.wrapper.no_sync():
            sync_ddp_buffers(front.wrapper)
            run.run_in_order()
        run.finish()
        reduce_ddp(front.wrapper, front.group)
    else:
        run.run_in_order()
        run.finish()


def _token_budget(max_tokens, max_memory, memory, front, batch, beyond, mode) -> int:
    """``max_tokens``, or the token budget of ``max_memory`` (the smaller where both; under
    ``fsdp="gather_once"`` the unsharded parameters and gradients count as fixed bytes; the
    default memory model counts each held part's output-weight gradient where the part graph
    makes its own loss)."""
    target = front.target
    if beyond not in ("host", "recompute", "device"):
        raise ValueError(f"treefx.backward: beyond must be 'host', 'recompute' or 'device', "
                         f"got {beyond!r}")
    if max_memory is None:
        if max_tokens is None:
            raise TypeError("treefx.backward: give max_tokens= (a token budget) or "
                            "max_memory= (bytes, or e.g. '40GiB')")
        if memory is not None:
            raise TypeError("treefx.backward: memory= goes with max_memory=")
        return max_tokens
    from . import memory as mem

    if memory is None:
        # each held part keeps the output weight's gradient its own loss made in the
        # forward, unless TREEFX_PART_LOSS_GRAD_LATE makes it in the backward
        late = front.runner.plan.options.part_loss_grad_late
        memory = mem.for_model(target, own_loss=front.runner.own_loss and not late)
    elif not isinstance(memory, mem.MemoryModel):
        raise TypeError(f"treefx.backward: memory= takes a treefx.run.parts.memory."
                        f"MemoryModel, got {type(memory).__name__}")
    if mode == "gather_once":
        memory = dataclasses.replace(memory, fixed=memory.fixed + held_bytes(target))
    tokens = mem.plan_tokens(memory, max_memory, batch, beyond=beyond)
    if max_tokens is not None:
        tokens = min(tokens, max_tokens)
    log.info("treefx.backward: max_memory=%s: max_tokens=%d", max_memory, tokens)
    return tokens


def _verify_first_call(tm: TreeModel, runner: PartRunner) -> None:
    """The probe check (:func:`treefx.verification.verify_compiled`) with the tree side run in
    parts: the probe forest cut at a third of its tokens (boundaries inside nodes, context and
    state crossing them), log-probabilities and gradients against each sequence alone, through
    ``runner``'s graph (one that makes treefx.tree_loss itself, or one handing out
    log-probabilities for a ``loss_fn``, with treefx.tree_loss as that). The model's ``.grad``,
    buffers and random state are left as they were."""
    from ... import verification
    from ...verification import VerificationUnavailable

    def tree_run(batch, chosen):
        # each part's log-probabilities in the batch's row, once: a recompute part's forward
        # runs twice, first without autograd (not reported), then in its backward
        lps = []
        for _, p in chosen:
            p.grad = None
        try:
            with torch.enable_grad():
                # this process's parts alone (a DDP model's inner module: no collective)
                run = Run(runner, batch.to("cpu"), max(3, batch.num_tokens // 3), tm.model,
                           step=None, loss_fn=None if runner.own_loss else tree_loss,
                           collective=False, on_logprobs=lps.append)
                run.run_in_order()
                run.finish()
        except TreeCompileError:
            if runner.draws_random() is None:
                raise  # else the probe's recompute parts were refused: unavailable, below
        where = runner.draws_random()
        if where is not None:
            raise VerificationUnavailable(
                f"cannot verify treefx.backward's part graph: it draws random numbers at "
                f"{where} (dropout in training mode?)")
        return sum(lps), [p.grad for _, p in chosen]

    try:
        runner.verification = verification.verify_compiled(tm, tree_run=tree_run)
    except VerificationUnavailable as e:
        runner.verification = str(e)
        log.warning("%s", e)
