"""One call's parts, run: each part's tensors moved to the device, its context gathered from
the parts that computed it, its forward held until every later part that reads it ran its
backward, then its backward with the gradients those left (:class:`Run`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from ... import parts as parts_mod
from ...compiler import TreeCompileError
from ...layout import TreeBatch, forget_host_rows, move_tensors, pack
from ...tree import Tree
from .. import regional
from ..engine import check_batch
from ...layout import TreeOutput
from ..step import step_weights
from .host import HostStore
from .runner import PartRunner

__all__ = ["Held", "Run", "add_embedding_grad", "backward_part", "events"]

log = logging.getLogger("treefx")


@dataclass(eq=False)
class Held:
    """A part whose forward ran and whose backward has not: its loss and outputs (the graph
    to differentiate), and the detached leaves later parts read. A recompute part
    (``rerun`` set) holds no graph: its loss and outputs are None until :func:`_backward`
    runs its forward again (``rerun() -> (loss, own, exits, sink)``)."""

    loss: torch.Tensor | None
    own: torch.Tensor | None
    exits: torch.Tensor | None
    own_leaf: torch.Tensor
    exits_leaf: torch.Tensor
    sink: torch.Tensor | None  # the part's rows of the input embedding's gradient
    emb_rows: torch.Tensor  # the part's distinct ids, and each token's among them
    emb_inverse: torch.Tensor
    dummy: bool = False  # a zero-weight part run to keep the ranks' collectives in step
    rerun: Callable | None = None
    on_host: list | None = None  # a host part's saved tensors, held in host memory


def _exported(own: torch.Tensor, t: dict) -> torch.Tensor:
    """The rows of a part's own columns [n, W] that later parts read as context
    (:attr:`treefx.parts.PartPlan.exported_rows`, ``t["export"]``): the only ones it keeps
    until its backward, and the only ones whose gradients come back (the others would be
    rows of zeros)."""
    return own.index_select(0, t["export"])


def _hold(part, loss, own, exits, t: dict, rerun: Callable) -> Held:
    """What a part keeps from its forward until its backward: for a recompute part
    (``part.recompute``, its forward run without a graph) only the leaves later parts read,
    its inputs (``t``) and ``rerun``, which runs the forward again with a graph. Of its own
    columns, only the rows later parts read (:func:`_exported`)."""
    own = _exported(own, t)
    leaves = own.detach().requires_grad_(), exits.detach().requires_grad_()
    if part.recompute:  # the second forward makes its own sink for the embedding's rows
        t.pop("emb_sink")
        return Held(None, None, None, *leaves, None, t["emb_rows"], t["emb_inverse"],
                     rerun=rerun)
    return Held(loss, own, exits, *leaves, t["emb_sink"], t["emb_rows"], t["emb_inverse"])


def events(plan) -> list[tuple[str, int]]:
    """A plan's run in order: ("F", j), part j's forward; ("B", i), held part i's backward (as
    early as :func:`treefx.parts.ready` allows), ("R", i) where part i is a recompute part
    (its backward runs its forward again first)."""
    out, held = [], []
    for j, part in enumerate(plan.parts):
        out.append(("F", j))
        held.append(j)
        for i in parts_mod.ready(plan, sorted(held), part.end):
            out.append(("R" if plan.parts[i].recompute else "B", i))
            held.remove(i)
    return out


class Run:
    """One call's parts (``batch`` None: a rank with no trees) and their state: the parts held
    for their backward, the dummies (zero-weight parts a rank runs to keep the ranks'
    collectives in step: in FSDP2's rounds, :func:`.fsdp.rounds`, and the one that
    reduce-scatters, :func:`.fsdp.gather_once`), the loss so far."""

    def __init__(self, runner: PartRunner, batch: TreeBatch | None, max_tokens: int,
                 target: torch.nn.Module, *, step, loss_fn, collective: bool,
                 lockstep: bool = False, on_logprobs: Callable | None = None,
                 beyond: str = "recompute", host_copy: bool | None = None):
        self.runner, self.step, self.loss_fn = runner, step, loss_fn
        # called with each part's log-probabilities in the batch's row, in the forward that
        # builds the backward's graph (the first-call check records them)
        self.on_logprobs = on_logprobs
        self.model = target
        # collective: under FSDP2 (every backward takes every output as a root, so that every
        # part's backward, a dummy's too, is the same graph); lockstep: in FSDP2's common
        # rounds (the ranks meet in every part: no recompute parts, captures agreed on,
        # parts evened out), not with the units gathered once (fsdp.gather_once)
        self.collective = collective
        self.lockstep = lockstep
        self.device = device = next(target.parameters()).device
        self.events: list[tuple[str, int]] = []
        self.plan = None
        if batch is not None:
            # What the budget cannot hold on the device: recomputed (recompute parts, the
            # default), held on the host (host parts, each forward run once), or held on the
            # device over the budget ("device"). In FSDP2's rounds no recompute parts: a
            # recompute part's backward gathers the layers for its second forward too, once
            # more than another rank's backward in that round; what the budget cannot hold
            # there is held on the device, as before recompute parts, unless host parts are
            # asked for. With the units gathered once, a second forward gathers nothing.
            if lockstep and beyond == "recompute":
                beyond = "device"
            self.max_tokens = max_tokens
            self.plan = parts_mod.plan(batch, max_tokens, block_size=runner.plan.block_size,
                                       beyond=beyond)
            if self.plan.peak_held_tokens() > max_tokens:
                log.warning("treefx.backward: activations of %d tokens held at once, over "
                            "max_tokens=%d (an open path longer than the budget holds, "
                            "beyond=%r)", self.plan.peak_held_tokens(), max_tokens, beyond)
            self.full = batch.to(device)
            check_batch(target, self.full)
            self.events = events(self.plan)
            log.info("treefx.backward: %d tokens in %d part(s) of at most %d (%d held on the "
                     "host, %d recomputed)", batch.num_tokens, self.plan.num_parts,
                     self.plan.max_tokens, self.plan.host_tokens, self.plan.recompute_tokens)
            # Each part predicts the tokens whose predecessor it holds; for treefx.backward's
            # own loss and a step's only the trained ones (weight nonzero), whose weights come
            # with the part: no [N] scatter, and the log-prob backward needs no host
            # synchronization to find them.
            self.weights = self._weights(batch)
            self.incidence = _Incidence(self.full) if loss_fn is not None else None
        self.held: dict[int, Held] = {}
        self.dummies: list[Held] = []
        # the keys of the host rows kept for each held part's (and dummy's) ops
        self.row_keys: dict[int, list] = {}
        self.dummy_keys: list[list] = []
        self.dummy_plan = None
        # the weights whose gradients the part graphs add into .grad directly have one from here
        self.created = runner.prepare_grads()
        # where host parts' saved tensors go (never the parameters or the gradients the
        # graphs add into)
        self.host = HostStore(device, [*target.parameters(),
                                       *(p.grad for p in runner.grad_params)], copy=host_copy)
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self.dtype = next(target.parameters()).dtype
        self.min_tokens = 3 if step is not None else 2

    def even_parts(self, num_parts: int) -> None:
        """Under FSDP2, before the rounds: the plan replaced by the one with at most
        ``num_parts`` parts (the most any rank has) whose largest part is smallest
        (:func:`treefx.parts.plan_even`), within the same budget."""
        if self.plan is None or not self.lockstep:
            return
        even = parts_mod.plan_even(self.plan.batch, self.max_tokens, num_parts,
                                   block_size=self.runner.plan.block_size,
                                   beyond=self.plan.beyond)
        if even is not self.plan and even.num_parts <= num_parts:
            log.info("treefx.backward under FSDP2: %d part(s) of at most %d tokens, as many "
                     "as the rank with the most (%d), largest %d (was %d part(s), largest %d)",
                     even.num_parts, even.max_tokens, num_parts,
                     max(p.num_tokens for p in even.parts), self.plan.num_parts,
                     max(p.num_tokens for p in self.plan.parts))
            self.plan = even
            self.events = events(even)

    def _weights(self, batch: TreeBatch):
        if self.step is not None:  # the step's "sum" and "mean" weights
            return step_weights(batch)
        if self.loss_fn is None:
            return batch.loss_weights[None]
        return None

    def _agree(self, group):
        """Under FSDP2: before a forward, the ranks agree on the captures it makes (a capture
        gathers every unit): each rank tells how many it needs, and one that needs fewer than
        the most gathers and frees every unit as often, as a capture would."""
        if not self.lockstep:
            return None
        import torch.distributed as dist

        def agree(mine: int) -> None:
            most = torch.tensor([mine], dtype=torch.int64, device=self.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
            for _ in range(int(most.item()) - mine):
                with regional.capture_state(self.model):
                    pass

        return agree

    def forward(self, j: int | None, group=None) -> None:
        """Part ``j``'s forward, held for its backward; None: a dummy's."""
        if j is None:
            self._dummy_forward(group)
            return
        plan, part = self.plan, self.plan.parts[j]
        t, keys = _to_device(plan, part, self.device, self.weights,
                             min_tokens=self.min_tokens, every_label=self.on_logprobs is not None)
        self.row_keys[j] = keys
        # a recompute part's forward keeps no graph; its backward runs it again (_backward)
        rerun = _rerun(self.runner, plan, part, t, self.held, self.device, self._loss,
                       self._report)
        # a host part's forward saves what its backward reads in host memory
        with torch.no_grad() if part.recompute else \
                self.host.saving() if part.host else contextlib.nullcontext() as on_host:
            first, own, exits, *rest = _forward(self.runner, plan, part, t, self.held,
                                                self.device, self.created, self._agree(group))
            loss = self._loss(first, t)
        if not part.recompute:
            self._report(first, rest, t)
        if j == 0 and plan.recompute_tokens:
            _check_recompute(self.runner)
        self.total = self.total + loss.detach().to(self.total.dtype)
        self.dtype = first.dtype
        self.held[j] = _hold(part, loss, own, exits, t, rerun)
        self.held[j].on_host = on_host

    def _loss(self, lp: torch.Tensor, t: dict) -> torch.Tensor:
        """A part's loss from its graph's first output: the loss itself (a step's, or
        treefx.tree_loss made in the graph), or ``loss_fn`` on the part's batch from its
        log-probabilities."""
        if self.step is not None or self.runner.own_loss:
            loss = lp
        else:
            full = self.full
            toks = t["label_tokens"]
            mask = torch.zeros(full.num_tokens, dtype=torch.bool, device=self.device)
            mask.index_fill_(0, toks, True)  # `mask[toks] = True` copies from the host: a sync
            values = self._row(lp, t)
            part_batch = _part_batch(full, mask, self.incidence)
            loss = self.loss_fn(TreeOutput(None, values), part_batch)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            what = ("the @treefx.step function must return its loss alone, a scalar tensor"
                    if self.step is not None else "loss_fn must return a scalar tensor")
            raise TypeError(f"treefx.backward: {what}; got {type(loss).__name__}")
        return loss

    def _row(self, lp: torch.Tensor, t: dict) -> torch.Tensor:
        """The part's log-probabilities (over its predicted tokens, ``t["label_tokens"]``) in
        the batch's row [N], 0 elsewhere."""
        toks = t["label_tokens"]
        values = torch.zeros(self.full.num_tokens, dtype=lp.dtype, device=self.device)
        return values.index_put((toks,), lp[:toks.shape[0]])

    def _report(self, first: torch.Tensor, rest: list, t: dict) -> None:
        """``on_logprobs`` of the part's log-probabilities in the batch's row, from its graph's
        outputs: the last of a graph that makes its own loss, else the first (a step's graph
        hands out none)."""
        if self.on_logprobs is None or self.step is not None:
            return
        lp = rest[0] if self.runner.own_loss else first
        self.on_logprobs(self._row(lp.detach(), t))

    def _dummy_forward(self, group) -> None:
        """The forward of a two-token tree whose loss is backpropagated with a zero gradient:
        every module runs (so every collective), and nothing is added to any gradient."""
        if self.dummy_plan is None:
            batch = pack([Tree.from_sequences([[0, 0]])], reduction="sum")
            self.dummy_plan = parts_mod.plan(batch, 2, block_size=self.runner.plan.block_size)
            w = self._weights(batch)
            self.dummy_weights = None if w is None else torch.zeros_like(w)
        plan = self.dummy_plan
        part = plan.parts[0]
        t, keys = _to_device(plan, part, self.device, self.dummy_weights,
                             min_tokens=self.min_tokens)
        self.dummy_keys.append(keys)
        first, own, exits, *_ = _forward(self.runner, plan, part, t, {}, self.device,
                                         self.created, self._agree(group))
        self.dummies.append(Held(first.sum(), own, exits, own.detach().requires_grad_(),
                                  exits.detach().requires_grad_(), t["emb_sink"],
                                  t["emb_rows"], t["emb_inverse"], dummy=True))

    def backward(self, i: int | None) -> None:
        """Held part ``i``'s backward; None: a held dummy's."""
        h = self.held.pop(i) if i is not None else self.dummies.pop()
        backward_part(h, self.runner.embedding, every_output=self.collective)
        if h.on_host:
            self.host.release(h.on_host)
        forget_host_rows(self.row_keys.pop(i) if i is not None else self.dummy_keys.pop())

    def run_in_order(self) -> None:
        """The forwards and backwards in :attr:`events`' order, this process's alone; the
        held parts released after, on errors too."""
        try:
            for event, i in self.events:
                self.forward(i) if event == "F" else self.backward(i)
        finally:
            self.release()

    def finish(self) -> None:
        self.release()
        if self.held:  # cannot happen: every part is released at the row's end
            raise RuntimeError(f"treefx.backward: parts {sorted(self.held)} never ran their "
                               "backward")

    def release(self) -> None:
        """Forget the host rows kept for parts whose backward did not run (an error)."""
        for keys in [*self.row_keys.values(), *self.dummy_keys]:
            forget_host_rows(keys)
        self.row_keys.clear()
        self.dummy_keys.clear()


def _to_device(plan, part, device, weights: torch.Tensor | None = None, *,
               min_tokens: int = 2, every_label: bool = False) -> tuple[dict, list]:
    """The part's tensors and the indices its context is gathered with, moved in one pinned,
    non-blocking copy per dtype, and the keys of the rows whose host copies are kept for the
    part's ops until its backward (:func:`treefx.parts.keep_host_rows`). A plain copy from
    pageable memory would wait for the GPU to
    finish the previous part, so the host could not prepare this one meanwhile. ``weights``
    [R, N] (on the host): the part predicts only the tokens with a nonzero weight in some
    row, and their columns become ``tree_weights`` [R, m] (zero where ``labels`` is
    padded; ``every_label``: every token with a predecessor, weighted or not, as the
    first-call check reads every log-probability). ``min_tokens``: see
    :func:`treefx.parts.part_tensors`."""
    keep = None
    if weights is not None:
        mine = weights[:, torch.from_numpy(part.label_tokens)]
        keep = (mine != 0).any(0) | every_label
        mine = mine[:, keep]
        keep = keep.numpy()
    t = parts_mod.part_tensors(plan, part, min_tokens=min_tokens, keep_labels=keep)
    if weights is not None:
        w = weights.new_zeros(weights.shape[0], t["labels"].shape[1])
        w[:, :mine.shape[1]] = mine
        t["tree_weights"] = w
    rows, inverse = np.unique(t["input_ids"][0].numpy(), return_inverse=True)
    t["emb_rows"], t["emb_inverse"] = torch.from_numpy(rows), torch.from_numpy(inverse)
    # the context's rows in the exported rows their parts keep (_exported)
    exported = plan.exported_rows
    t["export"] = torch.from_numpy(exported[part.index])
    ctx = part.context
    if len(ctx):
        owner = plan.part_of_token[ctx]
        for i in np.unique(owner).tolist():
            rows = ctx[owner == i] - plan.parts[i].start
            t[f"rows_{i}"] = torch.from_numpy(np.searchsorted(exported[i], rows))
    names = list(t)
    moved = move_tensors([t[k] for k in names], torch.device(device))
    # move_tensors hands back views into one buffer per dtype; Dynamo makes a view's storage
    # offset a size of the graph, which regional execution does not bind: own storage each
    # (a few small device copies a part)
    moved = [m if m.storage_offset() == 0 else m.clone() for m in moved]
    t_dev = dict(zip(names, moved))
    return t_dev, parts_mod.keep_host_rows(t_dev, t, pinned=True)


def _forward(runner: PartRunner, plan, part, t: dict, held: dict, device, created=(),
             agree=None):
    """A part's forward. ``agree(n)`` (under FSDP2): called with the number of captures this
    forward makes, before any (see :meth:`Run._agree`)."""
    t["emb_sink"] = runner.sink(t)
    settle = runner.engine is None
    if settle:
        if agree is not None:
            agree(2)  # the layout's capture, then the engine's first
        with torch.enable_grad():  # the layout and routing of the training graph
            runner.settle(t, created)
    layout = runner.layout
    ctx_tok = _gather_tokens(part, t, held, layout.tok_width, layout.tok_dtype, device)
    ctx_state = _gather_states(plan, part, held, layout.state_width, layout.state_dtype, device)
    if agree is not None and not settle:
        agree(int(runner.needs_capture(t, ctx_tok, ctx_state, t["emb_sink"])))
    return runner(t, ctx_tok, ctx_state, t["emb_sink"], part.num_tokens)


def _gather_tokens(part, t: dict, held, width, dtype, device) -> torch.Tensor:
    """The context rows [A, W]: each context token's own row from the part that computed it
    (through the autograd graph into that part's leaf), then zero padding. It requires grad
    exactly when grad mode is on (:func:`_zeros`)."""
    pieces = [held[int(k[5:])].own_leaf[rows] for k, rows in t.items() if k.startswith("rows_")]
    pad = part.context_pad - len(part.context)
    pieces.append(_zeros(pad, width, dtype, device, alone=not pieces))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _gather_states(plan, part, held, width, dtype, device) -> torch.Tensor:
    """The entries' states [max(E, 2), S], each the exit state of its predecessor's part;
    requires grad exactly when grad mode is on (:func:`_zeros`)."""
    pieces = []
    for p in part.entries.tolist():
        i = int(plan.part_of_token[p])
        row = int(np.searchsorted(plan.parts[i].exits, p))
        pieces.append(held[i].exits_leaf[row:row + 1])
    pad = max(0, 2 - len(pieces))
    if pad or not pieces:
        pieces.append(_zeros(pad, width, dtype, device, alone=not pieces))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _zeros(rows: int, width: int, dtype, device, *, alone: bool) -> torch.Tensor:
    """Zero padding of a context buffer; ``alone``: the whole buffer (no earlier part gives it
    rows). A part graph is captured for the ``requires_grad`` of its inputs (Dynamo guards it,
    a regional graph compares it), so the buffers require grad exactly when grad mode is on,
    whatever the part: in grad mode rows gathered from earlier parts' leaves do, and zeros
    alone (a part without context, as the first) are made to; without grad (a recompute
    part's first forward) gathered rows do not, and zeros alone must not either, or a
    recompute part without context would capture a no-grad graph of its own."""
    return torch.zeros(rows, width, dtype=dtype, device=device,
                       requires_grad=alone and torch.is_grad_enabled())


def _rerun(runner: PartRunner, plan, part, t: dict, held: dict, device, part_loss, report):
    """A recompute part's forward again, with a graph, for its backward: its context read
    from the same leaves of the parts still held (so their gradients arrive through this
    graph only: the first forward built none), its loss by ``part_loss``; ``report`` (as
    :meth:`Run._report`) told of this run's outputs."""
    def rerun():
        with torch.enable_grad():
            first, own, exits, *rest = _forward(runner, plan, part, t, held, device)
            report(first, rest, t)
            return part_loss(first, t), _exported(own, t), exits, t["emb_sink"]

    return rerun


def _check_recompute(runner: PartRunner) -> None:
    """Refuse recompute parts whose graph draws random numbers: the forward run again would
    draw others (dropout masks), so the gradients would not be those of the loss returned.
    Checked after the call's first forward, before any backward adds into ``.grad``."""
    where = runner.draws_random()
    if where is not None:
        raise TreeCompileError(
            f"treefx.backward: this plan recomputes parts (an open path longer than "
            f"max_tokens allows to hold), but the part graph draws random numbers at {where} "
            "(dropout in training mode?), which a second forward would not draw again. Set "
            "the dropout to 0 (or call model.eval()), or raise max_tokens until "
            "treefx.parts.plan(batch, max_tokens).recompute_tokens is 0")


def backward_part(h: Held, embedding, *, every_output: bool = False) -> None:
    """A held part's backward: its loss (a dummy's with a zero gradient) and the outputs later
    parts read, with the gradients those left in its leaves. ``every_output`` (FSDP2): every
    output that requires grad is a root, with zeros where nothing read it, so that every
    part's backward (a dummy's too) has the same graph and reaches the layers' hooks
    (gathers, reduce-scatters) in the same order on every rank."""
    if h.rerun is not None:  # a recompute part: its forward again, with a graph
        h.loss, h.own, h.exits, h.sink = h.rerun()
    tensors, grads = [], []
    if h.loss.requires_grad:
        tensors.append(h.loss)
        grads.append(torch.zeros_like(h.loss) if h.dummy else torch.ones_like(h.loss))
    for out, leaf in ((h.own, h.own_leaf), (h.exits, h.exits_leaf)):
        if out.requires_grad and (leaf.grad is not None or every_output):
            tensors.append(out)
            grads.append(leaf.grad if leaf.grad is not None else torch.zeros_like(out))
    if tensors:
        torch.autograd.backward(tensors, grads)
    if h.sink.grad is not None:
        add_embedding_grad(embedding[0], h.sink.grad, h.emb_rows, h.emb_inverse)


def add_embedding_grad(weight: torch.nn.Parameter, g: torch.Tensor, rows: torch.Tensor,
                        inverse: torch.Tensor) -> None:
    """A part's gradient rows [n, D] of the input embedding added into ``weight.grad`` at its
    distinct ids ``rows`` (``inverse``: each token's among them): summed per id in float32,
    rounded once, added like ``AccumulateGrad`` adds a dense gradient, at those rows only."""
    acc = torch.zeros(rows.shape[0], g.shape[1], device=g.device,
                      dtype=torch.promote_types(g.dtype, torch.float32))
    acc.index_add_(0, inverse, g.to(acc.dtype))
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    weight.grad.index_add_(0, rows, acc.to(weight.grad.dtype))


class _Incidence:
    """The whole batch's path incidence (:func:`treefx.rl.path_incidence`), built once, from
    which each part's keeps the coefficients of its predicted tokens."""

    def __init__(self, batch: TreeBatch):
        from ... import rl

        self.rl = rl
        self.inc = rl.path_incidence(batch)

    def restrict(self, batch: TreeBatch, mask: torch.Tensor) -> TreeBatch:
        return self.rl.restricted_incidence(batch, self.inc, mask)


def _part_batch(full: TreeBatch, mask: torch.Tensor, incidence: _Incidence | None) -> TreeBatch:
    """``full`` with its loss weights (and, for :mod:`treefx.rl`, its incidence's
    coefficients) zero outside ``mask``."""
    def keep(w):
        return torch.where(mask, w, torch.zeros_like(w))

    part = replace(full, loss_weights=keep(full.loss_weights), _block_masks={},
                   loss_weights_by_reduction={r: keep(w) for r, w in
                                              full.loss_weights_by_reduction.items()})
    return incidence.restrict(part, mask) if incidence is not None else part
