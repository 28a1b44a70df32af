"""The tree run against the oracle's: the worst log-probability, the gradients' relative
errors, and the values that are not finite in the tree run alone."""

from __future__ import annotations

import math

import torch

from .report import Tolerance

__all__ = ["grad_errors", "nonfinite_grads", "nonfinite_logprobs", "worst_logprob"]


def worst_logprob(lp: torch.Tensor, ref_lp, batch) -> tuple[float, tuple | None]:
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


def nonfinite_grads(chosen, g_tree, g_ref) -> tuple[str, ...]:
    """The parameters whose tree gradient holds NaN or inf where the oracle's is finite."""
    def finite(g):
        return g is None or bool(torch.isfinite(g).all())

    return tuple(name for (name, _), t, r in zip(chosen, g_tree, g_ref)
                 if not finite(t) and finite(r))


def nonfinite_logprobs(lp: torch.Tensor, ref_lp, batch) -> int:
    """How many of the tree's tokens have a log-prob that is NaN or inf where the oracle's
    (in some sequence through the token) is finite."""
    bad: set[int] = set()
    for i, ref in enumerate(ref_lp):
        idx = batch.sequence_index(i)[1:]
        if len(idx):
            hit = (~torch.isfinite(lp[idx]) & torch.isfinite(ref.detach())).cpu()
            bad.update(idx[hit].tolist())
    return len(bad)


def grad_errors(chosen, g_tree, g_ref, tol: Tolerance) -> dict[str, float]:
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
