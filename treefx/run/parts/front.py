"""``treefx.backward``: the front end. Which model (a compiled one, or a ``@treefx.step``
with its model), what it is wrapped in, the first call's check, the batch; then the parts run
on this process alone, under DDP (:mod:`.ddp`) or in FSDP2's common rounds (:mod:`.fsdp`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable

import torch

from ...compiler import TreeCompileError
from ...layout import TreeBatch, pack
from ...tree import Tree
from .. import wrapping
from ..model import TreeModel, tree_loss
from ..step import TreeStep
from .ddp import check_ddp, reduce_ddp, sync_ddp_buffers
from .executor import Run
from .fsdp import rounds
from .registry import runner_for, step_runner
from .runner import PartRunner

__all__ = ["backward"]

log = logging.getLogger("treefx")


def backward(tm: TreeModel, trees: Tree | Iterable[Tree] | TreeBatch | None, *,
             max_tokens: int | None = None, max_memory=None, memory=None,
             reduction: str | None = None, loss_fn: Callable | None = None,
             num_sequences: int | None = None, loss_scale: float | None = None,
             model: torch.nn.Module | None = None, beyond: str = "recompute") -> torch.Tensor:
    """Train on trees larger than memory: forward and backward in parts, each token computed once.

    Forward and backward of ``trees`` (one tree or a forest, packed as one batch) in parts
    of at most ``max_tokens`` tokens, every token computed once; the parameter gradients are
    added to ``.grad`` (like ``loss.backward()``). Returns the loss, detached: the batch's
    loss as :func:`treefx.tree_loss` gives it for ``treefx.pack(trees, reduction=...)``.

    ``tm``: a model from :func:`treefx.compile`. ``trees``: trees, packed here with
    ``reduction`` (default ``"mean"``), ``num_sequences`` and ``loss_scale`` as
    :func:`treefx.pack` takes them; or a batch already packed (by :func:`treefx.pack`, or
    :func:`treefx.distributed.pack` for a rank's share of a global batch), which carries
    those itself. ``loss_fn(out, part_batch) -> scalar``:
    another per-token objective instead of :func:`treefx.tree_loss` (every :mod:`treefx.rl`
    objective is one); it is called once per part with ``out.token_logprobs`` [N] over the
    whole batch's row, the part's predicted tokens filled in and 0 elsewhere (``out.logits``
    is None), and ``part_batch`` the whole batch with its loss weights (and the
    sequences' coefficients :mod:`treefx.rl` reads) kept only on those tokens. The losses of
    the parts add up to the batch's loss for any objective that is a sum over tokens of a term
    of that token's log-probability.

    ``tm`` may instead be a ``@treefx.step`` function, with the model it trains as ``model=``
    (``treefx.backward(train_step, trees, model=model, max_tokens=...)``): the step runs once
    per part, its cross-entropy rewritten to the part's predicted tokens, and the returned
    loss is what ``train_step(model, treefx.pack(trees))`` returns (the step's own reduction,
    so ``reduction`` and ``loss_fn`` are not taken; the step takes no extra arguments and
    returns the loss alone, as a scalar).

    Gradients: each linear layer whose weight trains, and the output projection, add their
    weight's gradient straight into ``.grad`` in a part's backward (no per-part gradient for
    autograd to add); such a weight without a ``.grad`` gets a zero one when the call starts.
    A parameter with a gradient hook (``register_hook``, ``register_post_accumulate_grad_hook``)
    gets its gradient through autograd, once per part that reads it, as usual; so does every
    parameter of a model run regionally (FSDP2, ``regional=True``).

    Several processes: a model sharded with FSDP2 (``fully_shard`` per layer and root) or
    wrapped in DDP trains in parts too. Every rank of the group calls ``backward`` with its
    share of the global batch (:func:`treefx.distributed.pack`, whose ``allow_empty=True``
    gives None to a rank without trees: pass that, or ``[]``) and may cut it into its own
    number of parts; the gathered gradients equal one process on all trees whole, and the
    returned loss is the rank's (their mean over ranks is the global batch's). Under FSDP2 the
    ranks run their parts in common rounds, a rank without a part to run in a round running a
    two-token part of zero weight, so that their collectives pair up; a round lasts as long
    as its largest part, so every rank cuts its trees into as many parts as the rank with the
    most, as evenly as they allow within ``max_tokens`` (:func:`treefx.parts.plan_even`); gradients go through
    autograd (FSDP reduce-scatters them in every part's backward). Under DDP the parts run on
    the inner module and the gradients are averaged over the group once, at the end (a
    wrapper with a communication hook or mixed precision is refused). See
    docs/ARCHITECTURE.md, "Parts on several processes".

    ``max_memory`` (bytes, or a string like ``"40GiB"``, ``"512MB"``): a budget in bytes
    instead of tokens, turned into ``max_tokens`` by the memory model ``memory`` (default
    :func:`treefx.run.parts.memory.for_model` of the model: its config's shape, its
    checkpointing, and as fixed bytes ``torch.cuda.memory_allocated()`` now on a GPU or its
    parameters and gradients on the CPU; pass ``memory.for_model(model, fixed_bytes=...)``
    or a calibrated :class:`~treefx.run.parts.memory.MemoryModel` instead): the whole batch
    in one part where it fits, else a token budget whose estimated peak, with the longest
    open path the batch can have, fits, chosen for the fewest parts
    (:func:`~treefx.run.parts.memory.plan_tokens`; docs/parts.md, "A memory budget"). Give
    ``max_tokens`` or ``max_memory``; given both, the smaller token budget wins. The
    estimate is derived from the shape, not yet measured on a GPU; with
    ``beyond="device"`` held parts may exceed it.

    Parts are planned by :func:`treefx.parts.plan`: a boundary may fall anywhere, inside a
    node too. Memory: activations are held for at most ``max_tokens`` tokens at once
    (``plan.peak_held_tokens()``): the current part's and those of the held parts of open
    nodes on the current root path (nodes whose subtrees exceed the room), as many as the
    budget leaves room for. ``beyond``: what becomes of the other open parts.
    ``"recompute"`` (the default): their forward runs twice, once without a graph
    (``plan.recompute_tokens``; refused under FSDP2, and for a model that draws random
    numbers); ``"host"``: their forward runs once, and what it saves for their backward is
    held in host memory until then (``plan.host_tokens``; on a GPU in pinned buffers, copied
    on a stream of its own so the copies overlap compute, a path not yet measured on a GPU;
    on the CPU nothing is copied); ``"device"``: held on the device over the budget. Beside them, the keys, values and conv
    inputs of the open path at every layer (``plan.peak_context_tokens()`` tokens, whatever
    the budget: later parts attend to them) and the recurrent states at the parts'
    boundaries; a held part's attention also saves its context's keys and values (it
    attends over them) for its backward. With activation checkpointing, a held part keeps
    its checkpointed layers' inputs instead of their activations, and its backward
    recomputes them. Runs on
    the compiled model's backend. Attention the model scores itself (a softcap, a sink, a
    bias of positions) is exact in parts; a bias the passes can read only at the part's own
    rows (not a function of positions) is refused.

    The first call for a compiled model checks the part graph on a small probe forest cut
    into parts against each sequence run alone (log-probabilities and gradients), unless the
    model was compiled with ``verify=False`` (or ``TREEFX_VERIFY=0``); the report is
    ``treefx.run.parts.runners(tm)[0].verification`` (a step is not checked: its loss is
    the user's code; nor is an FSDP2 model's part graph, whose gradients are shards).
    """
    from ..engine import unwrap_compiled

    step = None
    if isinstance(tm, TreeStep):
        if not isinstance(model, torch.nn.Module):
            raise TypeError("treefx.backward(step, trees, model=..., max_tokens=...): a "
                            "@treefx.step function needs the model it trains as model=")
        if loss_fn is not None or reduction is not None:
            raise TypeError("treefx.backward: a @treefx.step function computes its own loss "
                            "and reduction; loss_fn= and reduction= are for a compiled model")
        step, root = tm, unwrap_compiled(model)
        target = wrapping.unwrap_ddp(root)[0]
    elif isinstance(tm, TreeModel):
        if model is not None:
            raise TypeError("treefx.backward: model= goes with a @treefx.step function; a "
                            "model from treefx.compile is the first argument itself")
        target, root = tm.model, tm._root[0]
    else:
        raise TypeError(f"treefx.backward takes a model from treefx.compile or a @treefx.step "
                        f"function, got {type(tm).__name__}")

    kind = wrapping.distributed_kind(target, root if root is not target else None)
    wrapper = wrapping.unwrap_ddp(root)[1] if kind == "ddp" else None
    group = wrapping.process_group(kind, target, wrapper)
    runner = runner_for(tm, own_loss=loss_fn is None) if step is None else \
        step_runner(step, target)
    if runner.verify:
        runner.verify = False
        if kind == "fsdp":
            # the probe's parts would gather and reduce-scatter (sharded .grad, collectives
            # every rank must match): not checked here; tests/test_distributed_parts.py
            runner.verification = ("not checked: the part graph of a model sharded with FSDP2 "
                                   "is not probed on its first call")
            log.info("treefx.backward: %s", runner.verification)
        else:  # a DDP model's parts run on its inner module, with no collective
            if trees is not None:  # the probe's vocabulary, where the model declares none
                tm._note_token_ids(trees)
            with wrapper.no_sync() if wrapper is not None else contextlib.nullcontext():
                _verify_first_call(tm, runner)
    if trees is None or (isinstance(trees, (list, tuple)) and not trees):
        if kind is None:
            raise ValueError("treefx.backward: no trees (an empty forest trains nothing); a "
                             "rank with no trees passes None (or []) only under FSDP2 or DDP")
        batch = None
    elif isinstance(trees, TreeBatch):
        given = [k for k, v in (("reduction", reduction), ("num_sequences", num_sequences),
                                ("loss_scale", loss_scale)) if v is not None]
        if given:
            raise TypeError(f"treefx.backward: a packed batch carries its own {given[0]}; "
                            "pack it with that, or pass the trees")
        batch = trees.to("cpu")
    else:
        batch = pack(trees, reduction=reduction or "mean", num_sequences=num_sequences,
                     loss_scale=1.0 if loss_scale is None else loss_scale)
    if kind == "ddp":
        check_ddp(wrapper)
    if beyond not in ("host", "recompute", "device"):
        raise ValueError(f"treefx.backward: beyond must be 'host', 'recompute' or 'device', "
                         f"got {beyond!r}")
    max_tokens = _token_budget(max_tokens, max_memory, memory, target, batch, beyond)
    run = Run(runner, batch, max_tokens, target, step=step, loss_fn=loss_fn,
              collective=kind == "fsdp", beyond=beyond)
    if kind == "fsdp":
        try:
            rounds(run, group)
        finally:
            run.release()
    elif kind == "ddp":
        # The parts run on the inner module, without DDP's hooks (no_sync: its reducer ignores
        # the parts' backwards); the gradients are averaged over the group once, at the end.
        with wrapper.no_sync():
            sync_ddp_buffers(wrapper)
            _run_in_order(run)
        run.finish()
        reduce_ddp(wrapper, group)
    else:
        _run_in_order(run)
        run.finish()
    return run.total.to(run.dtype)


def _run_in_order(run: Run) -> None:
    """The run's forwards and backwards in its events' order, its held parts released after."""
    try:
        for event, i in run.events:
            run.forward(i) if event == "F" else run.backward(i)
    finally:
        run.release()


def _token_budget(max_tokens, max_memory, memory, target, batch, beyond) -> int:
    """``max_tokens``, or the token budget of ``max_memory`` (the smaller where both)."""
    if max_memory is None:
        if max_tokens is None:
            raise TypeError("treefx.backward: give max_tokens= (a token budget) or "
                            "max_memory= (bytes, or e.g. '40GiB')")
        if memory is not None:
            raise TypeError("treefx.backward: memory= goes with max_memory=")
        return max_tokens
    from . import memory as mem

    if memory is None:
        memory = mem.for_model(target)
    elif not isinstance(memory, mem.MemoryModel):
        raise TypeError(f"treefx.backward: memory= takes a treefx.run.parts.memory."
                        f"MemoryModel, got {type(memory).__name__}")
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
                try:
                    for event, i in run.events:
                        run.forward(i) if event == "F" else run.backward(i)
                finally:
                    run.release()
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
