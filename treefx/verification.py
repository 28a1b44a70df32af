"""``treefx.verify``: the rewritten model against the unmodified one, on a probe forest.

The passes rewrite what they recognise and refuse what they know to be unsafe; a model can
still do something along the tokens that no check foresaw. The probe catches that: it runs the
compiled tree model (the same compiled graph the user trains with) and the unmodified model on
each sequence of a small random forest with every odd shape (branches, a single-token node, a
sequence that is a prefix of another, a duplicate, two trees, more than one attention block on
the GPU), and compares log-probabilities and gradients within a tolerance stated per dtype.

``treefx.compile`` runs it once, on the first call, before the user's batch (``verify=True``,
the default): forward and gradients in a call with autograd on, log-probabilities alone in a
call without. It leaves the model as it found it (gradients in ``.grad``, buffers, random
state) and is skipped, with a warning, when the graph draws random numbers (dropout in
training mode), since two runs could not agree.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from . import reference as oracle_mod
from .layout import pack
from .ops.cross_entropy import weighted_logprob_loss
from .compiler import TreeCompileError
from .compiler.checks.dce import draws_random
from .compiler.graph import module_path
from .tree import Tree

__all__ = ["TreeVerificationError", "VerificationUnavailable", "VerificationReport", "Tolerance",
           "VocabularyUnknown", "oracle_floor_gradients", "probe_forest", "probe_vocab_size",
           "verify_compiled", "tolerance_for"]

log = logging.getLogger("treefx")


class TreeVerificationError(TreeCompileError):
    """The rewritten model disagrees with the unmodified one on the probe forest."""

    def __init__(self, message: str, report: VerificationReport | None = None):
        super().__init__(message)
        self.report = report


class VerificationUnavailable(TreeVerificationError):
    """The probe cannot compare this model: its graph draws random numbers (dropout in
    training mode), so two runs disagree whatever treefx does."""


@dataclass(frozen=True)
class Tolerance:
    """How far a tree-compiled model may be from the per-sequence oracle and still pass.

    ``logprob``: max absolute log-probability error; ``grad``: max relative gradient error
    per parameter, ``|g_tree - g_ref| / max(|g_ref|, floor · |G_ref|)`` with ``|G_ref|`` the
    norm of all the compared gradients together (so a parameter the probe barely reaches is
    not judged on rounding noise)."""

    logprob: float
    grad: float
    floor: float = 1e-3


# What rounding leaves between two exact computations of the same log-probabilities in one
# dtype (the tree row and each sequence alone sum in different orders, and chunked state
# kernels cut chunks at different places). The defects treefx guards against are far larger:
# a causal mask over the DFS row is off by nats, a decayed state handed to a child by ~1e-3.
# Models that compute in float32 internally (Hugging Face's Gated DeltaNet, even for float64
# weights) need the float32 figures.
_TOLERANCES = {
    torch.float64: Tolerance(logprob=1e-7, grad=1e-6),
    torch.float32: Tolerance(logprob=1e-4, grad=1e-3),
    torch.float16: Tolerance(logprob=2e-2, grad=5e-2),
    torch.bfloat16: Tolerance(logprob=1e-1, grad=1e-1),
}


# The tolerance is at least this many times the oracle's own floor: the per-sequence run
# compared with itself on sequences extended by random tokens (no loss on them; the same
# values mathematically, for a causal model, in other kernel shapes), the outputs of its
# embeddings and linear layers perturbed by one rounding of their dtype (:func:`_rounding_noise`).
FLOOR_FACTOR = 4.0


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    """The default tolerance for a model whose parameters have ``dtype``."""
    return _TOLERANCES.get(dtype, _TOLERANCES[torch.float32])


@dataclass
class VerificationReport:
    """What :func:`verify` compared and found.

    ``worst_token``: (sequence, position in it,
    DFS index) of the largest log-probability error; ``grad_errors``: relative error per
    compared parameter (empty without autograd); ``causal_error`` (measured with the floor):
    how far a sequence's log-probs moved when only the tokens after them changed, above the
    dtype's tolerance for a model that is not causal (``causal`` False: the check fails)."""

    dtype: torch.dtype
    tolerance: Tolerance
    num_trees: int
    num_sequences: int
    num_tokens: int
    max_logprob_error: float
    worst_token: tuple[int, int, int] | None
    grad_errors: dict[str, float] = field(default_factory=dict)
    compared_params: int = 0
    total_params: int = 0
    seconds: float = 0.0
    logprob_floor: float = 0.0  # the oracle against itself, rounded differently
    grad_floor: float = 0.0
    floor_measured: bool = True  # False: within the dtype's tolerance, no floor needed
    stage_seconds: dict[str, float] = field(default_factory=dict)
    # With the floor: how far the per-sequence log-probs moved when only tokens after them
    # changed (two random suffixes). Rounding at most for a causal model; more, and the model
    # is not causal (its own tokens see later ones), which no tree can give it.
    causal_error: float = 0.0
    # The compared parameters whose tree gradient holds NaN or inf where the oracle's is
    # finite, and how many tokens' tree log-probs are not finite where the oracle's are.
    nonfinite_grads: tuple[str, ...] = ()
    nonfinite_logprobs: int = 0

    @property
    def causal(self) -> bool:
        return self.causal_error <= max(self.tolerance.logprob,
                                        tolerance_for(self.dtype).logprob)

    @property
    def logprob_tolerance(self) -> float:
        """The tolerance applied: the dtype's, or a multiple of the oracle's own floor."""
        return max(self.tolerance.logprob, FLOOR_FACTOR * self.logprob_floor)

    @property
    def grad_tolerance(self) -> float:
        return max(self.tolerance.grad, FLOOR_FACTOR * self.grad_floor)

    @property
    def worst_param(self) -> tuple[str, float] | None:
        if not self.grad_errors:
            return None
        name = max(self.grad_errors, key=self.grad_errors.get)
        return name, self.grad_errors[name]

    @property
    def max_grad_error(self) -> float:
        return max(self.grad_errors.values(), default=0.0)

    @property
    def passed(self) -> bool:
        return (self.causal and self.max_logprob_error <= self.logprob_tolerance
                and self.max_grad_error <= self.grad_tolerance)

    def __str__(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        floor = (f"; the oracle's own floor {self.logprob_floor:.1e}" if self.floor_measured
                 else "")
        text = (f"treefx verify {verdict}: forest of {self.num_trees} trees, "
                f"{self.num_sequences} sequences, {self.num_tokens} tokens, {self.dtype}; "
                f"max log-prob error {self.max_logprob_error:.2e} (tolerance "
                f"{self.logprob_tolerance:.1e}{floor})")
        if self.worst_token is not None and self.max_logprob_error > 0:
            s, j, t = self.worst_token
            text += f" at sequence {s}, position {j} (DFS token {t})"
        if self.grad_errors:
            name, err = self.worst_param
            floor = f"; floor {self.grad_floor:.1e}" if self.floor_measured else ""
            text += (f"; max relative gradient error {err:.2e} (tolerance "
                     f"{self.grad_tolerance:.1e}{floor}) in {name}, over "
                     f"{self.compared_params} of {self.total_params} parameters")
        if not self.floor_measured:
            text += "; the oracle's own floor not needed (within the dtype's tolerance)"
        if self.nonfinite_logprobs:
            text += (f"; {self.nonfinite_logprobs} token(s)' tree log-probs are NOT FINITE "
                     "where the oracle's are")
        if self.nonfinite_grads:
            names = ", ".join(self.nonfinite_grads[:3]) + \
                (f" and {len(self.nonfinite_grads) - 3} more" if len(self.nonfinite_grads) > 3
                 else "")
            text += (f"; the tree run's gradients of {len(self.nonfinite_grads)} parameter(s) "
                     f"are NOT FINITE ({names}) where the oracle's are finite")
        if not self.causal:
            text += (f"; the model is NOT CAUSAL: changing only the tokens after a position "
                     f"moved its log-prob by {self.causal_error:.2e} when each sequence ran "
                     "alone (a mask that lets a query see later keys: a bidirectional span, "
                     "a prefix-LM prefix?), and a tree gives each sequence later tokens of its "
                     "own, so the floor above is no rounding and treefx cannot train this "
                     "model on trees")
        return text + f"; {self.seconds:.2f} s"


# ---------------------------------------------------------------------------- probe forest


def probe_forest(vocab_size: int, *, min_tokens: int = 0, seed: int = 0) -> list[Tree]:
    """The small forest the first-call check runs: every tree shape that breaks tree training.

    Two trees with every shape that breaks tree training: a shared prefix with branches, a
    single-token node, a sequence that ends inside another (a prefix of it), a duplicate
    sequence, a one-token sequence, random weights and loss masks on one tree and none on the
    other. Segments are scaled so that the forest has at least ``min_tokens`` tokens (more
    than one attention block on the GPU)."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    rng = np.random.default_rng(seed)
    scale = 1
    while True:
        trees = _probe_trees(rng, vocab_size, scale)
        if sum(t.num_tokens for t in trees) >= min_tokens:
            return trees
        scale *= 2
        rng = np.random.default_rng(seed)


def _probe_trees(rng, vocab: int, scale: int) -> list[Tree]:
    def seg(n):
        return rng.integers(0, vocab, size=n * scale).tolist()

    def fresh(prefix, n):
        """A segment whose first token differs from ``prefix``'s (so siblings branch)."""
        s = seg(n)
        while prefix and s[0] == prefix[0]:
            s[0] = int(rng.integers(0, vocab))
        return s

    root = seg(5)
    a = seg(4)
    b = fresh(a, 6)
    x = [int(rng.integers(0, vocab))]
    y = fresh(x, 1)
    c = fresh(root[3:], 3)
    first = [
        root + a,
        root + a + x,  # a single-token node
        root + a + y,
        root + b,
        root[:3],  # ends inside the root node: a prefix of every other sequence
        root + b,  # a duplicate
        root[:3] + c,
    ]
    weights = rng.uniform(0.5, 1.5, size=len(first)).tolist()
    masks = [(rng.random(len(s)) < 0.8).astype(int).tolist() for s in first]
    trunk, tail = seg(4), seg(5)
    one = fresh(trunk, 1)  # a one-token sequence: a root of its own, nothing to predict
    second = [trunk + tail, trunk + fresh(tail, 2), one]
    return [Tree.from_sequences(first, weights=weights, loss_masks=masks),
            Tree.from_sequences(second)]


# ---------------------------------------------------------------------------- verify


class VocabularyUnknown(ValueError):
    """The probe cannot tell which token ids a model takes. ``reason``: why, in words."""

    def __init__(self, model: torch.nn.Module, reason: str):
        self.reason = reason
        super().__init__(
            f"cannot tell which token ids {type(model).__name__} takes for the probe forest: "
            f"{reason}; pass trees= of its token ids (or vocab_size=) to treefx.verify, or give "
            "the model a config with vocab_size (model.config.vocab_size)")


def declared_vocab_sizes(model: torch.nn.Module) -> list[int]:
    """The vocabulary sizes a model declares: ``model.config.vocab_size``, its input
    embedding's ``num_embeddings`` (``get_input_embeddings()``) and its output layer's
    ``out_features`` (``get_output_embeddings()``), those it has."""
    sizes = []
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        sizes.append(size)
    for getter, attr in (("get_input_embeddings", "num_embeddings"),
                         ("get_output_embeddings", "out_features")):
        get = getattr(model, getter, None)
        try:
            module = get() if callable(get) else None
        except (NotImplementedError, AttributeError):
            module = None
        size = getattr(module, attr, None)
        if isinstance(size, int) and size > 0:
            sizes.append(size)
    return sizes


def _measured_vocab_size(model: torch.nn.Module) -> tuple[int | None, str]:
    """The model run once on two tokens of id 0 (no grad, its state kept): the width of its
    logits, and of the ``nn.Embedding`` the ids go into if one does; ``(None, why)`` if it
    cannot run so."""
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    fed = []

    def record(module, args):
        if args and args[0] is ids:
            fed.append(module.num_embeddings)

    handles = [m.register_forward_pre_hook(record) for m in model.modules()
               if isinstance(m, torch.nn.Embedding)]
    try:
        with _model_state_kept(model, []), torch.no_grad(), oracle_mod.oracle_attention(model):
            logits = oracle_mod.logits_of(model(ids))
    except Exception as e:  # noqa: BLE001 - any failure: the size is not known
        first_line = (str(e).strip().splitlines() or [""])[0][:200]
        return None, f"running it on two tokens of id 0 failed: {type(e).__name__}: {first_line}"
    finally:
        for h in handles:
            h.remove()
    if logits.dim() < 2 or tuple(logits.shape[-3:-1]) not in ((1, 2), (2,)):
        return None, (f"its output on two tokens has shape {tuple(logits.shape)}, not "
                      "[1, 2, vocabulary]")
    return min([int(logits.shape[-1]), *fed]), ""


def probe_vocab_size(model: torch.nn.Module, largest_id: int | None = None) -> int:
    """Token ids the probe forest may use are below this: the smallest vocabulary the model
    declares (:func:`declared_vocab_sizes`); else the width of its logits (and of the
    ``nn.Embedding`` its ids go into), the model run once on two tokens; else ``largest_id +
    1``, the largest id of a batch the model takes. A :class:`VocabularyUnknown` when none
    tells. (The first ``nn.Embedding`` of a model need not be its token embedding: a model
    whose token embedding is a custom module may have one for positions.)"""
    sizes = declared_vocab_sizes(model)
    if sizes:
        return min(sizes)
    measured, why = _measured_vocab_size(model)
    if measured is not None and measured >= 2:
        return measured
    if largest_id is not None and largest_id >= 1:
        return largest_id + 1
    if measured is not None:
        why = f"its logits have {measured} entries"
    raise VocabularyUnknown(model, "it declares no vocabulary (no config.vocab_size, "
                                   f"get_input_embeddings() or get_output_embeddings()), and {why}")


def _select_params(model: torch.nn.Module, params, budget: int = 1 << 26):
    """(name, parameter) pairs to compare gradients of. ``"all"``: every trainable one;
    ``"sample"``: as many as fit ``budget`` elements from the first and the last layers (a
    first layer's gradient passes through the whole backward, so it sees any error there);
    a list of names: those."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if params == "all":
        return named
    if params == "sample":
        chosen, used = {}, 0
        for seq in (named, named[::-1]):
            for n, p in seq:
                if used >= budget:
                    break
                if n not in chosen and p.numel() <= budget // 4:
                    chosen[n] = p
                    used += p.numel()
            budget += budget  # the same amount again from the end
        return [(n, p) for n, p in named if n in chosen]
    names = set(params)
    missing = names - {n for n, _ in named}
    if missing:
        raise ValueError(f"no trainable parameters named {sorted(missing)}")
    return [(n, p) for n, p in named if n in names]


@contextlib.contextmanager
def _model_state_kept(model: torch.nn.Module, params):
    """Buffers (running statistics), random state and ``.grad`` as they were before."""
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    grads = {id(p): p.grad for _, p in model.named_parameters()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in buffers and b.shape == buffers[n].shape:
                    b.copy_(buffers[n])
        for _, p in model.named_parameters():
            p.grad = grads.get(id(p))
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _grads(make_loss, params, model: torch.nn.Module) -> list[torch.Tensor | None]:
    """d loss / d params for ``loss = make_loss()``: ``autograd.grad``, which leaves ``.grad``
    alone. Reentrant activation checkpointing refuses it (in an eager model), or, where no
    requested parameter outside a checkpoint needs the checkpoint's node (frozen input
    embeddings), gives None for the parameters inside: the loss is then computed again and
    differentiated with a plain ``backward``, the other parameters frozen
    (the caller restores ``.grad``). The graph is never retained: a compiled backward with
    donated buffers refuses that."""
    tensors = [p for _, p in params]
    try:
        loss = make_loss()
        reentrant = _has_reentrant_checkpoint(loss)
        got = list(torch.autograd.grad(loss, tensors, allow_unused=True))
        del loss
        if all(g is not None for g in got) or not reentrant:
            return got
        # A parameter autograd.grad finds unused may sit inside a reentrant checkpoint whose
        # node no requested input needs (frozen input embeddings), which autograd.grad then
        # never runs: ``backward`` below runs it.
    except RuntimeError as e:
        if "checkpoint" not in str(e).lower():
            raise
    chosen = {id(p) for p in tensors}
    frozen = [p for p in model.parameters() if p.requires_grad and id(p) not in chosen]
    for p in tensors:
        p.grad = None
    try:
        for p in frozen:
            p.requires_grad_(False)
        make_loss().backward()
    finally:
        for p in frozen:
            p.requires_grad_(True)
    return [p.grad for p in tensors]


def _has_reentrant_checkpoint(loss: torch.Tensor) -> bool:
    """Whether ``loss``'s autograd graph holds a reentrant checkpoint's node."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CheckpointFunction" in type(node).__name__:
            return True
        todo.extend(f for f, _ in node.next_functions)
    return False


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
    as the forest's longest sequence) to this many tokens, when the forest has fewer: a compiled model's first call checks on a
    row as long as the batch it was called with, so that the graph compiled for the probe is
    the one the batch runs (Inductor picks 32-bit indexing for a short row and recompiles
    for a batch whose [tokens, vocab] logits pass 2^31 elements, a large share of an
    8B-shaped model's first step; BENCHMARKS.md, "First step and compile time").

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
        largest = [getattr(tm, "largest_token_id", None)]
        largest += [int(s.max()) for t in trees or () for s in t.segments if len(s)]
        vocab_size = probe_vocab_size(net, max((x for x in largest if x is not None),
                                               default=None))
    if trees is None:
        blocks = tm.engine.block_size if device.type == "cuda" else 0
        trees = probe_forest(vocab_size, min_tokens=2 * blocks + 1, seed=seed)
    tol = tolerance or tolerance_for(dtype)
    pad = pad_to is not None and pad_to > sum(t.num_tokens for t in trees)
    # the padding in nodes as long as the probe's longest sequence (positions the model runs
    # on the probe anyway), not one root a token: a recurrent layer runs per node
    longest = max((int(t.sequence_lengths.max()) for t in trees if t.num_sequences), default=1)
    batch = pack(trees, reduction=reduction, pad_to_multiple=int(pad_to) if pad else None,
                 pad_node_tokens=max(1, longest))
    if device.type != "cpu":
        batch = batch.to(device)
    total = sum(p.numel() for p in net.parameters() if p.requires_grad)
    if params == "auto":
        params = "all" if total <= 100_000_000 else "sample"
    chosen = _select_params(net, params) if grads else []
    oracle = net if reference is None else reference
    ref_chosen = chosen
    if reference is not None and chosen:
        by_name = dict(reference.named_parameters())
        missing = [n for n, _ in chosen if n not in by_name]
        if missing:
            raise ValueError(f"the reference model has no parameters named {missing[:3]}")
        ref_chosen = [(n, by_name[n]) for n, _ in chosen]
    if floor not in (True, False, "auto"):
        raise ValueError(f"floor must be True, False or 'auto', got {floor!r}")
    stages: dict[str, float] = {}
    stage = _stage_clock(stages)
    with _model_state_kept(net, chosen), _model_state_kept(oracle, ref_chosen), \
            torch.set_grad_enabled(grads):
        with stage("tree"):
            if tree_run is not None:
                tree_lp, g_tree = tree_run(batch, chosen)
            else:
                out = tm(batch)
                tree_lp = out.token_logprobs
                g_tree = _grads(lambda: weighted_logprob_loss(tree_lp, batch.loss_weights),
                                chosen, net) if chosen else []
        where = graph_draws_random(tm)
        if where is not None:
            raise VerificationUnavailable(
                f"cannot verify: the compiled graph draws random numbers at {where} (dropout "
                "in training mode?), so the tree and the per-sequence runs cannot agree; "
                "verify with model.eval() or dropout set to 0")
        with stage("oracle"):
            ref_lp, g_ref = _oracle_run(oracle, trees, reduction, ref_chosen)
        worst, worst_at = _worst_logprob(tree_lp.detach(), ref_lp, batch)
        # judged at the dtype's tolerance first: the floor can only raise it
        report = VerificationReport(
            dtype=dtype, tolerance=tol, num_trees=len(trees),
            num_sequences=batch.num_sequences, num_tokens=batch.num_real_tokens,
            max_logprob_error=worst, worst_token=worst_at,
            grad_errors=_grad_errors(chosen, g_tree, g_ref, tol), compared_params=len(chosen),
            total_params=len(list(p for p in net.parameters() if p.requires_grad)),
            floor_measured=False, stage_seconds=stages,
            nonfinite_grads=_nonfinite_grads(chosen, g_tree, g_ref),
            nonfinite_logprobs=_nonfinite_logprobs(tree_lp.detach(), ref_lp, batch))
        if floor is True or (floor == "auto" and not report.passed):
            # The oracle's own floor: the same computation in other shapes, rounded differently.
            with stage("floor"), _rounding_noise(oracle, seed):
                ext_lp, g_ext = _oracle_run(oracle, _extended(trees, vocab_size, seed),
                                            reduction, ref_chosen)
            report.logprob_floor = max((float((ext[:len(ref)].double() - ref.double()).abs()
                                              .max()) for ref, ext in zip(ref_lp, ext_lp)
                                        if len(ref)), default=0.0)
            report.grad_floor = max(_grad_errors(chosen, g_ext, g_ref, tol).values(),
                                    default=0.0)
            report.floor_measured = True
            with stage("floor"):
                report.causal_error = _causal_error(oracle, trees, vocab_size, seed, ref_lp)
    report.seconds = time.perf_counter() - t0
    log.info("%s", report)
    if raise_on_failure and not report.passed:
        if report.nonfinite_grads or report.nonfinite_logprobs:
            why = ("The tree run made NaN or inf where each sequence run alone did not: a "
                   "kernel of the compiled graph, or a rewrite that lets a non-finite value "
                   "through. Compare treefx.compile(model, backend=\"eager\") (the rewritten "
                   "graph run as it is) and report it with `treefx explain` output.")
        else:
            why = ("The tree run differs from each sequence run alone: something in this "
                   "model runs along the tokens in a way treefx did not rewrite. Please "
                   "report it with `treefx explain` output.")
        raise TreeVerificationError(f"{report}. {why}", report)
    return report


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


def _worst_logprob(lp: torch.Tensor, ref_lp, batch) -> tuple[float, tuple | None]:
    """The largest log-probability error of the tree's ``lp`` against the per-sequence
    ``ref_lp`` (a NaN counts as infinite), and where: (sequence, position, DFS token)."""
    worst, worst_at = 0.0, None
    for i, ref in enumerate(ref_lp):
        idx = batch.sequence_index(i)[1:]
        if not len(idx):
            continue
        err = (lp[idx].double() - ref.detach().double()).abs()
        j = int(err.argmax())
        if not math.isfinite(float(err[j])) or float(err[j]) > worst:
            worst, worst_at = float(err[j]), (i, j + 1, int(idx[j]))
    return worst, worst_at


def _oracle_run(oracle, trees, reduction, chosen):
    """The per-sequence log-probabilities and, for ``chosen`` parameters, the gradients of the
    per-sequence loss, from one forward per sequence (the loss is made from the
    log-probabilities): ``(logprobs, gradients)``."""
    if not chosen:
        with torch.no_grad():
            return oracle_mod.sequence_logprobs(oracle, trees), []
    kept = []

    def loss():
        lps = oracle_mod.sequence_logprobs(oracle, trees)
        kept[:] = [lp.detach() for lp in lps]
        return oracle_mod.logprob_loss(trees, lps, reduction=reduction,
                                       device=next(oracle.parameters()).device)

    grads = _grads(loss, chosen, oracle)
    return kept, grads


@contextlib.contextmanager
def _rounding_noise(model: torch.nn.Module, seed: int):
    """The outputs of the model's input embeddings and of every ``nn.Linear`` moved,
    relatively, by up to one unit roundoff of their dtype: one rounding more or less at each
    layer, as a tree run's other kernels and shapes give it. Its effect on the outputs is the
    spread the model's own rounding has, where the model amplifies it: an MoE router whose
    top-k flips at near ties moves its gate's gradient by ~10% in bfloat16 at
    DeepSeek-V2-Lite's shapes, for the plain per-sequence run against float32 as much as for
    the tree. Extending the sequences alone leaves most tokens' arithmetic as it was."""
    mods = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        try:
            emb = getter()
        except (NotImplementedError, AttributeError):
            emb = None
        if isinstance(emb, torch.nn.Module) and emb not in mods:
            mods.append(emb)
    gens: dict = {}

    def hook(module, args, out):
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return None
        gen = gens.get(out.device)
        if gen is None:
            gen = gens[out.device] = torch.Generator(device=out.device).manual_seed(seed + 1)
        u = torch.rand(out.shape, generator=gen, device=out.device, dtype=torch.float32)
        eps = torch.finfo(out.dtype).eps / 2
        return out + (out.float() * (2 * u - 1) * eps).to(out.dtype)

    handles = [m.register_forward_hook(hook) for m in mods]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _causal_error(oracle, trees, vocab: int, seed: int, ref_lp) -> float:
    """The largest change of a sequence's log-probs when only the tokens after them change:
    each sequence run alone with two different random suffixes (no rounding noise, the same
    shapes). Zero up to rounding for a causal model. ``ref_lp``: the sequences' own
    log-probs (their lengths say where the suffixes start)."""
    a, b = (_oracle_run(oracle, _extended(trees, vocab, s), "sum", [])[0]
            for s in (seed + 1, seed + 2))
    return max((float((x[:len(r)].double() - y[:len(r)].double()).abs().max())
                for r, x, y in zip(ref_lp, a, b) if len(r)), default=0.0)


def _extended(trees: list[Tree], vocab: int, seed: int, extra: int = 8) -> list[Tree]:
    """``trees`` with ``extra`` random tokens appended to every sequence, loss mask 0 on them
    (weights kept): for a causal model the same losses and gradients, in other shapes."""
    rng = np.random.default_rng(seed + 7919)
    out = []
    for t in trees:
        seqs = [list(s) + rng.integers(0, vocab, size=extra).tolist() for s in t.sequences]
        masks = [list(t.loss_mask(i)) + [0] * extra for i in range(t.num_sequences)]
        out.append(Tree.from_sequences(seqs, weights=t.weights, loss_masks=masks))
    return out


def oracle_floor_gradients(model: torch.nn.Module, trees, *, reduction: str = "mean",
                           num_sequences: int | None = None, seed: int = 0
                           ) -> dict[str, torch.Tensor]:
    """The per-sequence gradients once more, computed another way, to measure the oracle's own
    floating-point floor. Each sequence gets random tokens appended with no loss on them (for a
    causal model the same loss and gradients, in other kernel shapes) and every embedding and
    linear output is moved by up to one rounding of its dtype. The difference between these
    and the oracle's gradients is what rounding alone gives; a tolerance below it fails on
    some CPUs whatever treefx does (Hugging Face's Gated DeltaNet, which computes in float32
    with cancellation on ``A_log`` and ``dt_bias``). Returns ``{name: gradient}`` of the
    trainable parameters (zeros where the loss does not reach one); ``.grad`` is left as it
    was."""
    trees = [trees] if isinstance(trees, Tree) else list(trees)
    vocab = probe_vocab_size(model, max(int(seg.max()) for t in trees for seg in t.segments
                                        if len(seg)))
    extended = _extended(trees, vocab, seed)
    chosen = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with _model_state_kept(model, chosen), _rounding_noise(model, seed):
        got = _grads(lambda: oracle_mod.sequence_loss(model, extended, reduction=reduction,
                                                      num_sequences=num_sequences),
                     chosen, model)
    return {n: torch.zeros_like(p) if g is None else g.detach()
            for (n, p), g in zip(chosen, got)}


def _nonfinite_grads(chosen, g_tree, g_ref) -> tuple[str, ...]:
    """The parameters whose tree gradient holds NaN or inf where the oracle's is finite."""
    def finite(g):
        return g is None or bool(torch.isfinite(g).all())

    return tuple(name for (name, _), t, r in zip(chosen, g_tree, g_ref)
                 if not finite(t) and finite(r))


def _nonfinite_logprobs(lp: torch.Tensor, ref_lp, batch) -> int:
    """How many of the tree's tokens have a log-prob that is NaN or inf where the oracle's
    (in some sequence through the token) is finite."""
    bad: set[int] = set()
    for i, ref in enumerate(ref_lp):
        idx = batch.sequence_index(i)[1:]
        if len(idx):
            hit = (~torch.isfinite(lp[idx]) & torch.isfinite(ref.detach())).cpu()
            bad.update(idx[hit].tolist())
    return len(bad)


def _grad_errors(chosen, g_tree, g_ref, tol: Tolerance) -> dict[str, float]:
    if not chosen:
        return {}

    def dense(g, p):
        return torch.zeros_like(p, dtype=torch.float64) if g is None else g.detach().double()

    refs = [dense(g, p) for g, (_, p) in zip(g_ref, chosen)]
    trees = [dense(g, p) for g, (_, p) in zip(g_tree, chosen)]
    scale = math.sqrt(sum(float(r.pow(2).sum()) for r in refs))
    out = {}
    for (name, _), t, r in zip(chosen, trees, refs):
        denom = max(float(r.norm()), tol.floor * scale, 1e-30)
        err = float((t - r).norm()) / denom
        out[name] = err if math.isfinite(err) else math.inf
    return out
