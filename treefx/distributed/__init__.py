"""Data parallelism on trees: balance trees over ranks, normalize the loss over all of them.

Data parallelism on trees: balance trees over ranks, and pack each rank's share so that the
ranks' losses and gradients, averaged the way DDP and FSDP average them, are the global batch's.

**Normalization.** The loss of a global batch of P sequences (over all ranks) is the mean over
its sequences (see :func:`treefx.pack`):

    L = (1/P) Σ_p ω_p · r_p · Σ_{j≥1} m_p(j) · ℓ_p(j)

Rank k holds the sequences S_k (a partition of the P sequences, whole trees each), computes
its own loss L_k and its gradient, and DDP / FSDP all-reduce the gradients and divide by the
group size W: the update is (1/W) Σ_k ∇L_k. For that to be ∇L, for any split of the trees,

    L_k = W · (1/P) Σ_{p in S_k} ω_p · r_p · Σ_{j≥1} m_p(j) · ℓ_p(j)

so each rank divides by the **global** count P (not its own |S_k|: ranks with fewer sequences
would otherwise count each of them more) and multiplies by W. :func:`pack` does both: one
all-reduce gives P, and the batch is packed with ``num_sequences=P`` and ``loss_scale=W``, so
``batch.loss_weights`` (read by ``treefx.tree_loss`` and ``@treefx.step``) and the coefficients
of every :mod:`treefx.rl` objective carry the factor W / P. The mean of the W rank losses is
then L, and the averaged gradient ∇L, exactly as one process training on the whole batch. A
policy-gradient or PPO objective is linear in its per-sequence terms too (PPO's clip is per
token), so the same holds for it; its per-sequence inputs (advantages) must be computed over
whole groups before the split (:func:`treefx.rl.grpo_advantages` on the global batch, stored on
the trees as metadata).

**Balance.** A training step is as slow as its slowest rank. A tree's step time is close to
linear in its unique tokens N (every matmul, the MLPs, the output projection) and in its
attended pairs A = Σ over its tokens of (position + 1), the (query, key) pairs that tree
attention computes (a query sees its own path). :class:`CostModel` is ``a·N + b·A (+ c)``, from
FLOP counts of a model config (:meth:`CostModel.from_config`) or fitted to timed steps
(:meth:`CostModel.measure`); :func:`assign` balances with it (largest tree first, onto the
least-loaded rank).

Typical use, every rank running the same code on the same list of trees::

    parts = treefx.distributed.assign(trees, dist.get_world_size())
    batch = treefx.distributed.pack(parts[dist.get_rank()], reduction="mean").to(device)
    loss = train_step(ddp_model, batch)      # @treefx.step, tree_loss, or a treefx.rl objective
    loss.backward()                          # DDP / FSDP average the gradients over the ranks
"""

# One concept a module: sizes (a tree's attended pairs), flops (a config's FLOPs per token
# and pair), timing (timed steps and their fit), cost (CostModel, DEFAULT_COST), balance
# (assign), packing (pack, the global normalization).

from __future__ import annotations

from .balance import assign
from .cost import (ATTENTION_BACKWARD_FACTOR, DEFAULT_COST,  # noqa: F401
                   MATMUL_FLOPS_FWD_BWD, CostModel)
from .packing import pack
from .sizes import attended_pairs

__all__ = ["DEFAULT_COST", "CostModel", "assign", "attended_pairs", "pack"]
