"""Exact RL objectives on trees: policy gradient, PPO-clip, KL penalties.

Every objective here is the per-branch objective — each sequence ``s_p`` scored alone — averaged
over the batch's sequences the way its SFT loss is (see :func:`treefx.pack`):

    L = (1/P) Σ_p ω_p · r_p · Σ_{j≥1} m_p(j) · f_p(j)    r_p = 1 ("sum") or 1/Σ_{j≥1} m_p(j) ("mean")

with ``ω_p`` the sequence weight, ``m_p`` its loss mask, ``r_p`` from ``batch.reduction`` and
P = ``batch.num_sequences_normalizer`` (the batch's sequence count, or the global count given to
``pack(..., num_sequences=)``: micro-batches packed with the global count sum to the global
objective), times ``s = batch.loss_scale`` (1 unless given to ``pack``; the world size under
:func:`treefx.distributed.pack`, so that the rank objectives DDP / FSDP average are the global
batch's). Token j of sequence p is one token t of the tree, and its log-probability (so its
ratio to an old or reference policy) is the same in every sequence through t. Writing
``c_p(j) = ω_p · r_p · m_p(j) · s / P ≥ 0``, each objective collapses to per-token weights:

- policy gradient, f = −A_p(j) · log π:     L = −Σ_t log π_t · Σ_{p∋t} c_p(t) A_p(t)
- PPO-clip, f = −min(ρA, clip(ρ)A):         L = −Σ_t [min(ρ_t, clip ρ_t) · Σ_{p∋t} c_p A_p⁺
                                                      + max(ρ_t, clip ρ_t) · Σ_{p∋t} c_p A_p⁻]
  (for A ≥ 0, min(ρA, clip(ρ)A) = A·min(ρ, clip ρ); for A < 0 it is A·max(ρ, clip ρ))
- KL penalty, f = kl(log π, log π_ref):     L = coef · Σ_t kl_t · Σ_{p∋t} c_p(t)

Advantages may differ between sequences sharing a token (GRPO rollouts share the prompt, agent
calls share the earlier turns), so they are never put "on the tree" one value per token: the
sums over the sequences through each token come from a flat *incidence* of all sequences' paths
(one entry per predicted baseline token: tree token, sequence, position), built once per batch
and reduced with ``index_add``. Only old/reference log-probabilities, which are a function of
the context, map onto the tree one value per token (:func:`to_tree`), and must agree.

Per-sequence per-token data use one convention throughout, the one of
:func:`treefx.reference.sequence_logprobs`: a sequence of length L gets L − 1 values, entry k
for token k + 1 (the predicted tokens; token 0 has no prefix to be predicted from).

Other aggregations are weights: a token-level mean over the whole group (DAPO) is
``reduction="sum"`` with ``ω_p = P / Σ_q Σ_{j≥1} m_q(j)``; a constant normalizer (Dr. GRPO) is
``reduction="sum"`` with ``ω_p = P / constant`` (P the normalizer above).

Trees may carry what these objectives take as metadata (:mod:`treefx.tree`, built by
:mod:`treefx.data`): :func:`from_metadata` reads a batch's sampling log-probabilities or
advantages in the forms above, and :func:`grpo_advantages` computes GRPO's advantages from
rewards.

Every input is checked: advantages and values must be finite (GRPO's ``(R − mean) / std`` is
NaN for a group whose rewards are all equal), and so must old/reference log-probabilities on
every token the loss reads; an error names the sequence and token.
"""

# One concept a module: incidence (where each sequence's predicted tokens lie in the tree),
# values (per-sequence data summed onto the tree, or mapped onto it where it agrees),
# objectives (policy gradient, PPO-clip, KL penalty), metadata (what they take, read from the
# trees; GRPO's advantages).

from __future__ import annotations

from .incidence import PathIncidence, path_incidence, restricted_incidence
from .metadata import from_metadata, grpo_advantages
from .objectives import KL_ESTIMATORS, kl_penalty, policy_gradient_loss, ppo_clip_loss
from .values import DEFAULT_ATOL, DEFAULT_RTOL, to_tree, token_sums  # noqa: F401

__all__ = [
    "KL_ESTIMATORS",
    "PathIncidence",
    "from_metadata",
    "grpo_advantages",
    "kl_penalty",
    "path_incidence",
    "policy_gradient_loss",
    "ppo_clip_loss",
    "restricted_incidence",
    "to_tree",
    "token_sums",
]
