"""The check itself: the compiled tree model and the per-sequence oracle run on the probe
forest, compared within the tolerance (raised to a multiple of the oracle's own floor where it
is measured)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from ..compiler.checks.dce import draws_random
from ..compiler.graph import module_path
from ..layout import pack
from ..ops.cross_entropy import weighted_logprob_loss
from ..tree import Tree
from .compare import grad_errors, nonfinite_grads, nonfinite_logprobs, worst_logprob
from .floor import causal_error, extended_trees, rounding_noise
from .oracle import grads_of, model_state_kept, oracle_run, select_params
from .probe import probe_forest, probe_vocab_size
from .report import Tolerance, TreeVerificationError, VerificationReport, \
    VerificationUnavailable, tolerance_for

__all__ = ["graph_draws_random", "verify_compiled"]

log = logging.getLogger("treefx")


def graph_draws_random(tree_model) -> str | None:
    """Where the compiled graphs of ``tree_model`` draw random numbers (dropout in training
    mode, ...), or None."""
    for ctx in getattr(tree_model, "contexts", ()):
        for scope in ctx.scopes():
            for node in scope.graph.nodes:
                if draws_random(node):
                    return f"{module_path(node)} ({node.name})"
    return None


def verify_compiled(tm, trees=None, *, reduction: str = "mean", grads: bool = True,
                    params="auto", tolerance: Tolerance | None = None, seed: int = 0,
                    reference: torch.nn.Module | None = None,
                    raise_on_failure: bool = True, tree_run=None,
                    vocab_size: int | None = None, pad_to: int | None = None,
                    floor: bool | str = "auto") -> VerificationReport:
    """Compare a tree-compiled model with the unmodified model run on each sequence alone
    (``treefx.verify`` compiles a module first).

    ``tm``: a :class:`treefx.TreeModel`; its compiled graph is what gets checked.
    ``trees``: the forest to compare on (default :func:`probe_forest`, with more than two
    attention blocks of tokens on the GPU). ``grads``: compare parameter gradients too
    (``params``: ``"all"``, ``"sample"`` — the first and last layers, bounded memory — or
    names; ``"auto"``: all up to 100M parameters, else a sample). ``tolerance``: default by
    the parameters' dtype (:func:`tolerance_for`). ``reference``: the module the oracle runs
    (default: the same one), e.g. a float32 copy of a bf16 model; its parameters are matched
    by name. ``tree_run(batch, params) -> (token_logprobs, gradients)``: how the tree side
    runs, for another entry point than ``tm(batch)`` (:func:`treefx.backward`'s parts); it
    may write ``.grad`` (restored after). ``vocab_size``: the probe's token ids are below it
    (default :func:`probe_vocab_size`, with the largest id of a batch ``tm`` ran on).
    ``pad_to``: the tree side's row padded with inert tokens (weight 0, in root nodes as long
    as the forest's longest sequence) to this many tokens, when the forest has fewer: a
    compiled model's first call checks on a row as long as the batch it was called with, so
    that the graph compiled for the probe is the one the batch runs (Inductor picks 32-bit
    indexing for a short row and recompiles for a batch whose [tokens, vocab] logits pass
    2^31 elements, a large share of an 8B-shaped model's first step; BENCHMARKS.md, "First
    step and compile time").

    Returns a :class:`VerificationReport`; raises :class:`TreeVerificationError` naming the
    worst token and parameter when over tolerance (unless ``raise_on_failure=False``). The
    model's ``.grad``, buffers and random state are left as they were.
    """
    t0 = time.perf_counter()
    net = tm.model
    first = next(net.parameters(), None)
    if first is None:
        raise ValueError("the model has no parameters")
    device, dtype = first.device, first.dtype
    if isinstance(trees, Tree):
        trees = [trees]
    if vocab_size is None:
        vocab_size = _probe_vocab(tm, trees)
    if trees is None:
        blocks = tm.engine.block_size if device.type == "cuda" else 0
        trees = probe_forest(vocab_size, min_tokens=2 * blocks + 1, seed=seed)
    tol = tolerance or tolerance_for(dtype)
    batch = _probe_batch(trees, reduction, pad_to, device)
    sides = _Sides.of(net, reference, params, grads)
    if floor not in (True, False, "auto"):
        raise ValueError(f"floor must be True, False or 'auto', got {floor!r}")
    stages: dict[str, float] = {}
    stage = _stage_clock(stages)
    with model_state_kept(net, sides.chosen), model_state_kept(sides.oracle, sides.ref_chosen), \
            torch.set_grad_enabled(grads):
        with stage("tree"):
            tree_lp, g_tree = _tree_side(tm, batch, sides.chosen, tree_run)
        _refuse_random_draws(tm)
        with stage("oracle"):
            ref_lp, g_ref = oracle_run(sides.oracle, trees, reduction, sides.ref_chosen)
        # judged at the dtype's tolerance first: the floor can only raise it
        report = _report(sides, trees, batch, dtype, tol, tree_lp.detach(), g_tree, ref_lp,
                         g_ref, stages)
        if floor is True or (floor == "auto" and not report.passed):
            report = _with_floor(report, sides, _FloorRun(trees, vocab_size, seed, reduction,
                                                          ref_lp, g_ref, stage))
    report = dataclasses.replace(report, seconds=time.perf_counter() - t0)
    log.info("%s", report)
    if raise_on_failure and not report.passed:
        raise _failure(report)
    return report


def _probe_vocab(tm, trees) -> int:
    """The probe's vocabulary: :func:`probe_vocab_size`, with the largest id of a batch ``tm``
    ran on and of ``trees``."""
    largest = [getattr(tm, "largest_token_id", None)]
    largest += [int(s.max()) for t in trees or () for s in t.segments if len(s)]
    return probe_vocab_size(tm.model, max((x for x in largest if x is not None), default=None))


def _probe_batch(trees, reduction: str, pad_to: int | None, device):
    """``trees`` packed for the tree side (padded to ``pad_to`` tokens when they have fewer),
    on ``device``."""
    pad = pad_to is not None and pad_to > sum(t.num_tokens for t in trees)
    # the padding in nodes as long as the probe's longest sequence (positions the model runs
    # on the probe anyway), not one root a token: a recurrent layer runs per node
    longest = max((int(t.sequence_lengths.max()) for t in trees if t.num_sequences), default=1)
    batch = pack(trees, reduction=reduction, pad_to_multiple=int(pad_to) if pad else None,
                 pad_node_tokens=max(1, longest))
    if device.type != "cpu":
        batch = batch.to(device)
    return batch


@dataclass(frozen=True)
class _Sides:
    """The two sides compared: the tree model's network and the parameters whose gradients
    are compared (``chosen``), the oracle's module and its parameters of the same names."""

    net: torch.nn.Module
    oracle: torch.nn.Module
    chosen: list
    ref_chosen: list

    @classmethod
    def of(cls, net: torch.nn.Module, reference: torch.nn.Module | None, params,
           grads: bool) -> _Sides:
        """``grads`` False: no gradients compared."""
        total = sum(p.numel() for p in net.parameters() if p.requires_grad)
        if params == "auto":
            params = "all" if total <= 100_000_000 else "sample"
        chosen = select_params(net, params) if grads else []
        oracle = net if reference is None else reference
        ref_chosen = chosen
        if reference is not None and chosen:
            by_name = dict(reference.named_parameters())
            missing = [n for n, _ in chosen if n not in by_name]
            if missing:
                raise ValueError(f"the reference model has no parameters named {missing[:3]}")
            ref_chosen = [(n, by_name[n]) for n, _ in chosen]
        return cls(net, oracle, chosen, ref_chosen)


def _tree_side(tm, batch, chosen, tree_run):
    """The tree run's log-probabilities and gradients of ``chosen``: ``tree_run``'s, or
    ``tm(batch)``'s."""
    if tree_run is not None:
        return tree_run(batch, chosen)
    out = tm(batch)
    tree_lp = out.token_logprobs
    g_tree = grads_of(lambda: weighted_logprob_loss(tree_lp, batch.loss_weights),
                      chosen, tm.model) if chosen else []
    return tree_lp, g_tree


def _refuse_random_draws(tm) -> None:
    where = graph_draws_random(tm)
    if where is not None:
        raise VerificationUnavailable(
            f"cannot verify: the compiled graph draws random numbers at {where} (dropout "
            "in training mode?), so the tree and the per-sequence runs cannot agree; "
            "verify with model.eval() or dropout set to 0")


def _report(sides: _Sides, trees, batch, dtype, tol: Tolerance, tree_lp, g_tree, ref_lp, g_ref,
            stages: dict[str, float]) -> VerificationReport:
    """The report at the dtype's tolerance, no floor measured."""
    chosen, net = sides.chosen, sides.net
    worst, worst_at = worst_logprob(tree_lp, ref_lp, batch)
    return VerificationReport(
        dtype=dtype, tolerance=tol, num_trees=len(trees),
        num_sequences=batch.num_sequences, num_tokens=batch.num_real_tokens,
        max_logprob_error=worst, worst_token=worst_at,
        grad_errors=grad_errors(chosen, g_tree, g_ref, tol), compared_params=len(chosen),
        total_params=len(list(p for p in net.parameters() if p.requires_grad)),
        floor_measured=False, stage_seconds=stages,
        nonfinite_grads=nonfinite_grads(chosen, g_tree, g_ref),
        nonfinite_logprobs=nonfinite_logprobs(tree_lp, ref_lp, batch))


@dataclass(frozen=True)
class _FloorRun:
    """What measuring the oracle's floor needs of the check: the forest, the probe's
    vocabulary and seed, the loss's reduction, the oracle's log-probs and gradients, and the
    stage clock."""

    trees: list
    vocab_size: int
    seed: int
    reduction: str
    ref_lp: list
    g_ref: list
    stage: object


def _with_floor(report: VerificationReport, sides: _Sides, run: _FloorRun
                ) -> VerificationReport:
    """``report`` with the oracle's own floor (the same computation in other shapes, rounded
    differently) and the model's causal error measured."""
    with run.stage("floor"), rounding_noise(sides.oracle, run.seed):
        ext_lp, g_ext = oracle_run(sides.oracle, extended_trees(run.trees, run.vocab_size,
                                                                run.seed),
                                   run.reduction, sides.ref_chosen)
    logprob_floor = max((float((ext[:len(ref)].double() - ref.double()).abs().max())
                         for ref, ext in zip(run.ref_lp, ext_lp) if len(ref)), default=0.0)
    grad_floor = max(grad_errors(sides.chosen, g_ext, run.g_ref, report.tolerance).values(),
                     default=0.0)
    with run.stage("floor"):
        causal = causal_error(sides.oracle, run.trees, run.vocab_size, run.seed, run.ref_lp)
    return dataclasses.replace(report, logprob_floor=logprob_floor, grad_floor=grad_floor,
                               floor_measured=True, causal_error=causal)


def _failure(report: VerificationReport) -> TreeVerificationError:
    if report.nonfinite_grads or report.nonfinite_logprobs:
        why = ("The tree run made NaN or inf where each sequence run alone did not: a "
               "kernel of the compiled graph, or a rewrite that lets a non-finite value "
               "through. Compare treefx.compile(model, backend=\"eager\") (the rewritten "
               "graph run as it is) and report it with `treefx explain` output.")
    else:
        why = ("The tree run differs from each sequence run alone: something in this "
               "model runs along the tokens in a way treefx did not rewrite. Please "
               "report it with `treefx explain` output.")
    return TreeVerificationError(f"{report}. {why}", report)


def _stage_clock(stages: dict[str, float]):
    """``with clock(name):`` adds the block's wall time (the device synchronized) to
    ``stages[name]``."""
    @contextlib.contextmanager
    def clock(name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            stages[name] = stages.get(name, 0.0) + time.perf_counter() - t0
    return clock
