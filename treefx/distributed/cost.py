"""The cost of a tree in a training step (:class:`CostModel`), from a model config's FLOPs or
fitted to timed steps, and :data:`DEFAULT_COST`."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from ..layout import TreeBatch
from ..tree import Tree
from .flops import ATTENTION_BACKWARD_FACTOR, MATMUL_FLOPS_FWD_BWD, step_flops, text_config
from .sizes import attended_pairs, tree_list
from .timing import fit_nonnegative, sample_batches, time_steps

__all__ = ["ATTENTION_BACKWARD_FACTOR", "DEFAULT_COST", "MATMUL_FLOPS_FWD_BWD", "CostModel"]


@dataclass(frozen=True)
class CostModel:
    """The cost of one tree in a training step, for balancing trees over ranks.

    Cost of one tree in a training step: ``per_token · N + per_pair · A + per_tree``, with N
    the tree's unique tokens and A its attended pairs (:func:`attended_pairs`). Units are
    whatever the coefficients are in (FLOPs from :meth:`from_config`, seconds from
    :meth:`measure`); for balancing only their ratios matter. All coefficients finite and
    non-negative, not all zero."""

    per_token: float
    per_pair: float
    per_tree: float = 0.0

    def __post_init__(self):
        for name in ("per_token", "per_pair", "per_tree"):
            v = getattr(self, name)
            if not isinstance(v, numbers.Real) or isinstance(v, bool):
                raise TypeError(f"CostModel.{name} must be a number, got {v!r}")
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"CostModel.{name} must be finite and non-negative, got {v!r}")
            object.__setattr__(self, name, float(v))
        if self.per_token == self.per_pair == self.per_tree == 0:
            raise ValueError("a CostModel with every coefficient 0 makes every tree free and "
                             "balances nothing")

    def __call__(self, tree: Tree) -> float:
        """The cost of ``tree``."""
        if not isinstance(tree, Tree):
            raise TypeError(f"expected a treefx.Tree, got {type(tree).__name__}")
        return (self.per_token * tree.num_tokens + self.per_pair * attended_pairs(tree)
                + self.per_tree)

    def of_batch(self, trees: Tree | Iterable[Tree]) -> float:
        """The cost of a rank's trees: the sum of their costs (a constant per step, the same on
        every rank, is left out: it does not change which rank is slowest)."""
        return sum(self(t) for t in tree_list(trees, "trees"))

    # ------------------------------------------------------------------ from a config

    @classmethod
    def from_config(cls, config) -> CostModel:
        """FLOPs of a training step (forward + backward) per token and per attended pair, from a
        Hugging Face config (a ``PretrainedConfig``, its ``to_dict()``, or any object with the
        attributes; a multimodal config's text config is used).

        ``per_token = 6 · (layers · matmul parameters per layer + vocab · hidden)``: 2 FLOPs
        per multiply-add forward and 4 backward (gradients of the input and of the weight; a
        frozen weight, LoRA say, skips the latter: this overestimates such a step uniformly,
        which balancing does not mind). Matmul parameters per layer: q, k, v, o
        (``hidden·heads·head_dim`` for q and o, ``hidden·kv_heads·head_dim`` for k and v; MLA
        configs (``kv_lora_rank``) their low-rank factors) plus the MLP (``3·hidden·
        intermediate``, gated; 2 for GPT-2-style model types). Embedding lookups, norms and
        activations are not matmuls and are left out. The output projection (vocab · hidden)
        counts once per token when the config has ``vocab_size``.

        MoE (``num_experts_per_tok`` with ``num_experts`` / ``num_local_experts`` /
        ``n_routed_experts``): the active experts only, ``top_k · 3·hidden·expert_intermediate``
        (``moe_intermediate_size``, else ``intermediate_size``) plus shared experts
        (``shared_expert_intermediate_size``, or ``n_shared_experts`` experts) and the router;
        dense layers (``first_k_dense_replace``, ``mlp_only_layers``, ``decoder_sparse_step``)
        take ``intermediate_size``. A config with experts but no top-k is counted as top-1 (one
        expert's MLP per token, logged). Dropped tokens and load imbalance are not modelled.

        ``per_pair = (1 + 2.5) · 2·heads·(d_qk + d_v) · attention layers`` (= 14·heads·
        head_dim·layers when d_qk = d_v): q·k and p·v forward, backward 2.5 × forward
        (:data:`ATTENTION_BACKWARD_FACTOR`), query heads (GQA shares keys and values, not
        their products). Layers that ``layer_types`` marks as linear attention / state-space
        count for tokens only; sliding-window layers count as full attention (an overestimate
        of their pairs beyond the window). Units: FLOPs.
        """
        per_token, per_pair = step_flops(text_config(config))
        return cls(per_token=per_token, per_pair=per_pair)

    # ------------------------------------------------------------------ measured

    @classmethod
    def measure(cls, step_fn: Callable[[TreeBatch], None], samples=None, *, device=None,
                repeats: int = 3, warmup: int = 1, vocab_size: int = 128, seed: int = 0,
                pack_kwargs: dict | None = None) -> CostModel:
        """Fit ``per_token``, ``per_pair`` and ``per_tree`` (seconds) to timed steps.

        ``step_fn(batch)`` runs one training step on a packed :class:`TreeBatch` (forward,
        backward, optimizer if you like; its return value is ignored); it is called ``warmup``
        times on each sample batch (compilation, caches), then ``repeats`` times timed with
        ``time.perf_counter`` (the device synchronized before and after on CUDA), and the
        median counts. ``samples``: ``None`` for token sizes (1024, 2048, 4096, 8192); a
        sequence of ints, token sizes, each made into three batches from :mod:`treefx.synth`
        agent trees of about that many tokens: one deep tree (one rollout, each call extending
        the last: ~N²/2 pairs), one wide tree (8 rollouts of one prompt, reasoning dropped: far
        fewer pairs per token) and the two side by side at half size each (two trees in one
        batch); or a sequence of trees / lists of trees, one batch each. Token ids are below
        ``vocab_size``. Batches are built with ``treefx.pack(trees, **pack_kwargs)`` and moved
        to ``device`` (default: the current CUDA device if there is one, else the CPU).

        The fit is a least-squares one of the step time t against
        ``per_token·N + per_pair·A + per_tree·(trees) + c``, relative (each residual divided
        by its t, so large and small batches count alike), with the three coefficients kept
        non-negative (every subset of them tried, the best non-negative solution kept); the
        intercept c, what a step costs whatever it holds, is the same on every rank and is
        dropped. Timing is noisy: use sizes like the trees you train on, on the device you
        train on.
        """
        if not callable(step_fn):
            raise TypeError(f"step_fn must be callable as step_fn(batch), got "
                            f"{type(step_fn).__name__}")
        for name, v, lo in (("repeats", repeats, 1), ("warmup", warmup, 0)):
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an integer ≥ {lo}, got {v!r}")
        pack_kwargs = dict(pack_kwargs or {})
        pack_kwargs.setdefault("reduction", "mean")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if torch.cuda.is_available() else torch.device("cpu")
        device = torch.device(device)
        batches = sample_batches(samples, vocab_size=vocab_size, seed=seed)

        rows, times = time_steps(step_fn, batches, device, repeats=repeats, warmup=warmup,
                                 pack_kwargs=pack_kwargs)
        coef = fit_nonnegative(np.asarray(rows, dtype=np.float64),
                               np.asarray(times, dtype=np.float64))
        if not np.any(coef > 0):
            raise RuntimeError(
                "CostModel.measure: the step times did not grow with tokens, pairs or trees "
                f"(times {['%.3g' % t for t in times]} s for {[r[0] for r in rows]} tokens); "
                "time larger batches, or more repeats"
            )
        return cls(per_token=float(coef[0]), per_pair=float(coef[1]), per_tree=float(coef[2]))


# Qwen3-8B's shape (hidden 4096, 36 layers, 32 heads, 8 KV heads, head_dim 128, intermediate
# 12288, vocab 151936) through CostModel.from_config: 6 · 7.568e9 matmul parameters per token
# and 14 · 32 · 128 · 36 per pair, in FLOPs (a pair ≈ 4.5e-5 tokens: attention matches the
# matmuls at ~22k positions). A placeholder until coefficients measured on the GPU replace it;
# only the ratio matters for balancing.
DEFAULT_COST = CostModel(per_token=45_408_583_680.0, per_pair=2_064_384.0)
