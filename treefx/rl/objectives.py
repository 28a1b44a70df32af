"""The objectives on a tree, exact per sequence: the policy gradient, PPO's clipped
surrogate, the KL penalty to a reference policy."""

from __future__ import annotations

import numbers

import numpy as np
import torch

from ..layout import TreeBatch, TreeOutput
from .incidence import path_incidence
from .values import flat_values, logprobs_on_tree, scatter

__all__ = ["KL_ESTIMATORS", "kl_penalty", "policy_gradient_loss", "ppo_clip_loss"]

KL_ESTIMATORS = ("k1", "k2", "k3")


def _check_logprobs(token_logprobs, batch: TreeBatch) -> torch.Tensor:
    if isinstance(token_logprobs, TreeOutput):
        token_logprobs = token_logprobs.token_logprobs
    if not isinstance(token_logprobs, torch.Tensor):
        raise TypeError(f"token_logprobs must be a tensor (out.token_logprobs), got "
                        f"{type(token_logprobs).__name__}")
    if token_logprobs.shape != (batch.num_tokens,):
        raise ValueError(f"token_logprobs has shape {list(token_logprobs.shape)} but the batch "
                         f"has {batch.num_tokens} tokens; pass out.token_logprobs of this batch")
    if not token_logprobs.is_floating_point():
        raise TypeError(f"token_logprobs must be floating point, got {token_logprobs.dtype}")
    return token_logprobs


def _check_eps(value, name: str) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not np.isfinite(value) \
            or value < 0:
        raise ValueError(f"{name} must be a finite non-negative number, got {value!r}")
    return float(value)


def policy_gradient_loss(token_logprobs, batch: TreeBatch, advantages) -> torch.Tensor:
    """The policy-gradient loss (REINFORCE, or GRPO without a ratio) on a tree.

    REINFORCE / GRPO without a ratio:

        L = −(1/P) Σ_p ω_p r_p Σ_{j≥1} m_p(j) A_p(j) log π(s_p[j] | s_p[<j])
          = −Σ_t log π_t · Σ_{p∋t} c_p(t) A_p(t)          c_p = ω_p r_p m_p s / P

    ``token_logprobs``: ``out.token_logprobs`` [N] (or the ``TreeOutput``). ``advantages``: per
    sequence ([P], GRPO) or per token (a list of P tensors of length len(sequence) − 1, entry k
    for token k + 1); every value finite. Differentiable through ``token_logprobs`` (and the
    advantages, as given).
    """
    lp = _check_logprobs(token_logprobs, batch)
    inc = path_incidence(batch)
    adv = flat_values(inc, advantages, "advantages", lp.dtype, lp.device)
    weight = scatter(inc, inc.coef.to(device=lp.device, dtype=lp.dtype) * adv)
    return -(weight * lp).sum()


def ppo_clip_loss(token_logprobs, batch: TreeBatch, advantages, old_logprobs, *,
                  clip_eps: float = 0.2, clip_eps_high: float | None = None,
                  return_stats: bool = False):
    """PPO's clipped surrogate loss (PPO, GRPO) on a tree, exact per sequence.

    PPO's clipped surrogate, per token ``−min(ρA, clip(ρ, 1−ε, 1+ε_high)·A)`` with
    ``ρ = exp(log π − log π_old)``, summed like the SFT loss:

        L = −(1/P) Σ_p ω_p r_p Σ_{j≥1} m_p(j) min(ρ A_p(j), clip(ρ) A_p(j))
          = −Σ_t [min(ρ_t, clip ρ_t) · Σ_{p∋t} c_p A_p⁺  +  max(ρ_t, clip ρ_t) · Σ_{p∋t} c_p A_p⁻]

    exact because ρ_t is the same in every sequence through t and c_p = ω_p r_p m_p s / P ≥ 0
    (P = ``batch.num_sequences_normalizer``, s = ``batch.loss_scale``).

    ``advantages``: per sequence [P] or per token (list of P tensors, len(sequence) − 1 each),
    all finite. ``old_logprobs``: on the tree ([N], e.g. a no-grad forward's
    ``token_logprobs``; finite on every trained token) or per sequence (list of P tensors like
    :func:`treefx.reference.sequence_logprobs`; values of a shared token must agree, see
    :func:`to_tree`). They are constants: detached here.
    ``clip_eps_high``: the upper clip (DAPO's clip-higher); default ``clip_eps``.

    Returns the loss, or ``(loss, stats)`` with ``return_stats``: detached 0-dim tensors
    ``clip_fraction`` (share of the weight ``c_p(j)`` on token terms whose clipped branch is
    taken, so they give no gradient) and ``approx_kl`` (``c``-weighted mean of
    ``ρ − 1 − log ρ``, an estimate of KL(π_old ‖ π)).
    """
    lp = _check_logprobs(token_logprobs, batch)
    eps_low = _check_eps(clip_eps, "clip_eps")
    eps_high = eps_low if clip_eps_high is None else _check_eps(clip_eps_high, "clip_eps_high")
    inc = path_incidence(batch)
    adv = flat_values(inc, advantages, "advantages", lp.dtype, lp.device)
    old = logprobs_on_tree(inc, old_logprobs, "old_logprobs", lp)
    # Tokens no sequence trains on have weight 0; zeroing their log-ratio keeps a placeholder
    # old value there (or padding) from making exp overflow and 0 · inf a NaN.
    log_ratio = torch.where(inc.trained.to(lp.device), lp - old, torch.zeros_like(lp))
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    coef = inc.coef.to(device=lp.device, dtype=lp.dtype)
    positive = scatter(inc, coef * adv.clamp(min=0))
    negative = scatter(inc, coef * adv.clamp(max=0))
    loss = -(positive * torch.minimum(ratio, clipped)
             + negative * torch.maximum(ratio, clipped)).sum()
    if not return_stats:
        return loss
    with torch.no_grad():
        token = inc.token.to(lp.device)
        r = ratio[token]
        cut = ((adv > 0) & (r > 1.0 + eps_high)) | ((adv < 0) & (r < 1.0 - eps_low))
        total = coef.sum().clamp_min(torch.finfo(coef.dtype).tiny)
        lr = log_ratio[token]
        stats = {
            "clip_fraction": (coef * cut).sum() / total,
            "approx_kl": (coef * (torch.expm1(lr) - lr)).sum() / total,
        }
    return loss, stats


def kl_penalty(token_logprobs, batch: TreeBatch, ref_logprobs, *, estimator: str = "k1",
               coef: float = 1.0) -> torch.Tensor:
    """The KL penalty to a reference policy (k1, k2 or k3 estimator) on a tree.

    A KL penalty to a reference policy, weighted like the loss:

        L = coef · (1/P) Σ_p ω_p r_p Σ_{j≥1} m_p(j) kl(s_p[j]) = coef · Σ_t w_t · kl_t

    with ``w_t = Σ_{p∋t} ω_p r_p m_p(t) s / P`` (``batch.loss_weights``, computed here in float64)
    and, for d = log π_ref − log π (Schulman's estimators of KL(π ‖ π_ref)):
    ``"k1"``: −d;  ``"k2"``: d² / 2;  ``"k3"``: exp(d) − d − 1.

    ``ref_logprobs``: on the tree ([N]; finite on every trained token) or per sequence (list of
    P tensors, len(sequence) − 1 each; values of a shared token must agree). Detached: the
    reference is a constant.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    lp = _check_logprobs(token_logprobs, batch)
    inc = path_incidence(batch)
    ref = logprobs_on_tree(inc, ref_logprobs, "ref_logprobs", lp)
    d = torch.where(inc.trained.to(lp.device), ref - lp, torch.zeros_like(lp))
    if estimator == "k1":
        kl = -d
    elif estimator == "k2":
        kl = 0.5 * d * d
    else:
        kl = torch.expm1(d) - d  # exp(d) − 1 − d without cancellation near d = 0
    weight = scatter(inc, inc.coef.to(device=lp.device, dtype=lp.dtype))
    return coef * (weight * kl).sum()
