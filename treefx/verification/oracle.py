"""The per-sequence oracle's side of the check: the parameters compared, the model's state kept
across the runs, gradients that leave ``.grad`` alone, and the oracle's run."""

from __future__ import annotations

import contextlib

import torch

from .. import reference as oracle_mod

__all__ = ["grads_of", "model_state_kept", "oracle_run", "select_params"]


def select_params(model: torch.nn.Module, params, budget: int = 1 << 26):
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
def model_state_kept(model: torch.nn.Module, params):
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


def grads_of(make_loss, params, model: torch.nn.Module) -> list[torch.Tensor | None]:
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


def oracle_run(oracle, trees, reduction, chosen):
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

    grads = grads_of(loss, chosen, oracle)
    return kept, grads
