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

from __future__ import annotations

import heapq
import inspect
import logging
import math
import numbers
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from . import layout
from .agent_trees import agent_tree
from .layout import TreeBatch
from .tree import Tree

__all__ = ["DEFAULT_COST", "CostModel", "assign", "attended_pairs", "pack"]

log = logging.getLogger("treefx")

# ---------------------------------------------------------------------- sizes of a tree


def attended_pairs(tree: Tree) -> int:
    """The number of (query, key) pairs tree attention computes for a tree.

    The (query, key) pairs tree attention computes for ``tree``: Σ over its unique tokens of
    (the token's position in its own sequence + 1), since a query sees every token of its path
    up to itself (what ``batch.dense_mask()`` allows; padding excluded). A node of length ℓ
    whose first token is at position d adds ℓ·d + ℓ(ℓ+1)/2."""
    if not isinstance(tree, Tree):
        raise TypeError(f"expected a treefx.Tree, got {type(tree).__name__}")
    lens = tree.segment_lengths.astype(np.int64)
    depth = np.asarray(tree.node_depths, dtype=np.int64)
    return int((lens * depth).sum() + (lens * (lens + 1) // 2).sum())


# ---------------------------------------------------------------------- the cost model

# FLOPs per multiply-add of a weight matmul in a training step: 2 forward, 4 backward (the
# input's gradient and the weight's gradient, 2 each).
MATMUL_FLOPS_FWD_BWD = 6.0
# Attention per (query, key) pair and head, forward: q·k (d_qk multiply-adds) and p·v (d_v),
# 2 FLOPs each, so 2·(d_qk + d_v) = 4·head_dim. Backward ≈ 2.5 × forward, the convention of
# FlashAttention and of benchmarks/attention.py: five matmuls (S = QKᵀ recomputed, dV = PᵀdO,
# dP = dO Vᵀ, dQ = dS K, dK = dSᵀ Q) against the forward's two.
ATTENTION_BACKWARD_FACTOR = 2.5

# Model types whose MLP is two matrices (up, down) rather than a gated three (gate, up, down).
_UNGATED_MLP = frozenset({
    "gpt2", "gpt_neo", "gptj", "gpt_neox", "gpt_bigcode", "opt", "bloom", "phi", "falcon",
    "codegen", "mpt", "starcoder2", "biogpt", "xglm", "gpt_neox_japanese",
})


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
        return sum(self(t) for t in _tree_list(trees, "trees"))

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
        cfg = _text_config(config)
        hidden = _int_attr(cfg, "hidden_size", "n_embd", "d_model")
        layers = _int_attr(cfg, "num_hidden_layers", "n_layer", "num_layers")
        heads = _int_attr(cfg, "num_attention_heads", "n_head", "num_heads")
        kv_heads = _int_attr(cfg, "num_key_value_heads", default=heads)
        head_dim = _int_attr(cfg, "head_dim", default=None)
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"config has no head_dim and hidden_size {hidden} is not a "
                                 f"multiple of num_attention_heads {heads}")
            head_dim = hidden // heads
        intermediate = _int_attr(cfg, "intermediate_size", "n_inner", default=None) or 4 * hidden
        model_type = str(getattr(cfg, "model_type", "") or "")
        mlp_mats = 2 if model_type in _UNGATED_MLP else 3

        # Attention projections and the per-pair head dimensions.
        kv_lora = _int_attr(cfg, "kv_lora_rank", default=None)
        if kv_lora:  # multi-head latent attention (DeepSeek-V2/V3)
            nope = _int_attr(cfg, "qk_nope_head_dim")
            rope = _int_attr(cfg, "qk_rope_head_dim")
            d_v = _int_attr(cfg, "v_head_dim")
            d_qk = nope + rope
            q_lora = _int_attr(cfg, "q_lora_rank", default=None)
            q_params = (hidden * q_lora + q_lora * heads * d_qk) if q_lora else hidden * heads * d_qk
            attn_params = (q_params + hidden * (kv_lora + rope) + kv_lora * heads * (nope + d_v)
                           + heads * d_v * hidden)
        else:
            d_qk = d_v = head_dim
            attn_params = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim

        # MLP per layer, dense or MoE.
        dense_mlp = mlp_mats * hidden * intermediate
        experts = _int_attr(cfg, "num_experts", "num_local_experts", "n_routed_experts",
                            default=None)
        mlp_per_layer = [dense_mlp] * layers
        if experts and experts > 1:
            top_k = _int_attr(cfg, "num_experts_per_tok", "moe_topk", "top_k", default=None)
            if top_k is None:
                log.info("CostModel.from_config: %d experts but no num_experts_per_tok; "
                         "counting one active expert per token", experts)
                top_k = 1
            expert_inter = _int_attr(cfg, "moe_intermediate_size", default=None) or intermediate
            shared_inter = _int_attr(cfg, "shared_expert_intermediate_size", default=None)
            if shared_inter is None:
                shared_inter = (_int_attr(cfg, "n_shared_experts", default=None) or 0) * expert_inter
            moe_mlp = (mlp_mats * hidden * (top_k * expert_inter + shared_inter)
                       + hidden * experts)
            first_dense = _int_attr(cfg, "first_k_dense_replace", default=None) or 0
            only_dense = set(getattr(cfg, "mlp_only_layers", None) or ())
            step = _int_attr(cfg, "decoder_sparse_step", default=None) or 1
            mlp_per_layer = [
                dense_mlp if (i < first_dense or i in only_dense or (i + 1) % step) else moe_mlp
                for i in range(layers)
            ]

        vocab = _int_attr(cfg, "vocab_size", default=None) or 0
        matmul_params = layers * attn_params + sum(mlp_per_layer) + vocab * hidden

        attention_layers = layers
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types:
            attention_layers = sum(1 for t in layer_types if "attention" in str(t)
                                   and "linear" not in str(t))
        pair_fwd = 2.0 * heads * (d_qk + d_v) * attention_layers
        return cls(per_token=MATMUL_FLOPS_FWD_BWD * matmul_params,
                   per_pair=(1.0 + ATTENTION_BACKWARD_FACTOR) * pair_fwd)

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
        batches = _sample_batches(samples, vocab_size=vocab_size, seed=seed)

        rows, times = [], []
        for trees in batches:
            batch = layout.pack(trees, **pack_kwargs).to(device)
            for _ in range(warmup):
                step_fn(batch)
            samples_t = []
            for _ in range(repeats):
                _synchronize(device)
                t0 = time.perf_counter()
                step_fn(batch)
                _synchronize(device)
                samples_t.append(time.perf_counter() - t0)
            t = statistics.median(samples_t)
            rows.append([sum(x.num_tokens for x in trees), sum(attended_pairs(x) for x in trees),
                         len(trees)])
            times.append(t)
            log.debug("CostModel.measure: %d tokens, %d pairs, %d trees: %.6f s",
                      *rows[-1], t)
        coef = _fit_nonnegative(np.asarray(rows, dtype=np.float64),
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


# ---------------------------------------------------------------------- assign


_ORDERS = ("input", "largest_first")


def assign(trees, world_size: int, *, cost: CostModel | Callable[[Tree], float] | None = None,
           split: bool = False, order: str = "input") -> list[list[Tree]]:
    """Split trees over ranks so that the ranks' step times are close.

    Split ``trees`` over ``world_size`` ranks so that their step times are close: LPT
    (longest processing time first) — trees by decreasing cost, each onto the rank with the
    least cost so far (ties: the rank with fewer trees, then the lower rank; equal costs keep
    input order), so the slowest rank is within 4/3 of the best possible split. Returns one
    list per rank, each in input order; every tree lands on exactly one rank and every rank
    gets at least one (a rank without trees would still have to join every collective of the
    step, so fewer trees than ranks is an error). Deterministic: every rank can call it on the
    same list and take its own part.

    ``cost``: a :class:`CostModel` (default :data:`DEFAULT_COST`, FLOP ratios of a Qwen3-8B
    shape), or any callable ``cost(tree) -> float`` (finite, non-negative).

    ``split=True``: a tree may also be cut across ranks, into sub-trees of whole sequences
    (:meth:`Tree.subtree`, planned by :func:`treefx.partition.partition_ids`), when that
    lowers the slowest rank's cost. Each sequence still lands on exactly one rank with its
    weight, loss mask and per-sequence metadata, so :func:`pack`'s global normalization keeps
    the loss and gradients exact; what a cut costs is the prefix its pieces share, which every
    rank holding a piece computes, and the cost model counts it (each piece is costed as the
    tree it is). So wide trees (many rollouts or trials off a short prompt) are cut when one
    of them would hold up a step, and comb-shaped agent trees (each call extending the last)
    hardly ever are: every piece of a comb repeats most of its trunk. Repeated until no cut
    of a tree on the slowest rank helps; the returned lists then hold the pieces (new trees)
    in place of a tree that was cut, in input order. Fewer trees than ranks is accepted when
    the cuts give every rank something.

    ``order``: ``"input"`` (default) keeps each rank's trees in input order;
    ``"largest_first"`` puts them in decreasing order of cost (ties: input order). Under FSDP2
    :func:`treefx.backward` runs the ranks' parts in common rounds, each as long as its
    slowest part, so ranks whose parts come in the same order of size wait less (measured on
    real agent trees in docs/distributed.md, "Rounds"). Pack the trees (and give
    per-sequence values such as advantages) in the order returned.
    """
    if order not in _ORDERS:
        raise ValueError(f"order must be one of {_ORDERS}, got {order!r}")
    if not isinstance(world_size, numbers.Integral) or isinstance(world_size, bool):
        raise TypeError(f"world_size must be a positive integer, got {world_size!r} "
                        f"({type(world_size).__name__})")
    if world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size}")
    world_size = int(world_size)
    trees = _tree_list(trees, "trees")
    if cost is None:
        cost = DEFAULT_COST
    if not callable(cost):
        raise TypeError(f"cost must be a treefx.distributed.CostModel or a callable "
                        f"cost(tree) -> float, got {type(cost).__name__}")

    def costed(i: int, key: tuple, tree: Tree) -> _Unit:
        c = cost(tree)
        if not isinstance(c, numbers.Real) or isinstance(c, bool) or not math.isfinite(c) \
                or c < 0:
            raise ValueError(f"cost of trees[{i}] is {c!r}; a cost must be a finite "
                             "non-negative number")
        return _Unit(key, tree, float(c))

    units = [costed(i, (i,), t) for i, t in enumerate(trees)]
    ranks = _lpt(units, world_size)
    if split:
        ranks = _cut_until_balanced(units, ranks, world_size, costed)
    if any(not r for r in ranks):
        raise ValueError(
            f"{len(trees)} trees cannot be assigned to {world_size} ranks: every rank needs at "
            "least one tree (a rank with nothing to do still joins every collective of the "
            "step). Give more trees per step, "
            + ("" if split else "let assign cut trees (split=True), ")
            + "split large trees with treefx.partition, or use fewer ranks"
        )
    if order == "largest_first":
        return [[u.tree for u in sorted(r, key=lambda u: (-u.cost, u.key))] for r in ranks]
    return [[u.tree for u in sorted(r, key=lambda u: u.key)] for r in ranks]


@dataclass(frozen=True)
class _Unit:
    """What :func:`assign` places: a tree or a piece of one. ``key``: the tree's index, then
    (for a piece) the first sequence index of each cut it came from, for the output order."""

    key: tuple
    tree: Tree
    cost: float


def _lpt(units: list[_Unit], world_size: int) -> list[list[_Unit]]:
    """Largest cost first onto the least-loaded rank (ties: fewer units, then lower rank)."""
    order = sorted(units, key=lambda u: (-u.cost, u.key))
    # (load, units so far, rank): a rank without trees (load 0) always comes first.
    heap = [(0.0, 0, r) for r in range(world_size)]
    ranks: list[list[_Unit]] = [[] for _ in range(world_size)]
    for u in order:
        load, count, r = heapq.heappop(heap)
        ranks[r].append(u)
        heapq.heappush(heap, (load + u.cost, count + 1, r))
    return ranks


def _loads(ranks: list[list[_Unit]]) -> list[float]:
    """The ranks' costs, largest first."""
    return sorted((sum(u.cost for u in r) for r in ranks), reverse=True)


def _lower(a: list[float], b: list[float]) -> bool:
    """Whether loads ``a`` beat ``b``: the slowest rank faster, or as fast with fewer ranks
    that slow (the next cut may then lower it), compared largest first (relative 1e-9)."""
    for x, y in zip(a, b):
        if abs(x - y) > 1e-9 * max(abs(x), abs(y)):
            return x < y
    return False


def _cut_until_balanced(units, ranks, world_size: int, costed) -> list[list[_Unit]]:
    """Cut units of the slowest rank into pieces of whole sequences while that lowers the
    ranks' loads (:func:`_lower`); each unit is tried once, into 2..world_size pieces. Kept
    only if the slowest rank ends up faster than with whole trees."""
    from .partition import partition_ids

    start, tried = ranks, set()
    while True:
        slowest = max(ranks, key=lambda r: sum(u.cost for u in r))
        best = None
        for u in sorted(slowest, key=lambda u: (-u.cost, u.key)):
            if u.key in tried or u.tree.num_sequences < 2:
                continue
            tried.add(u.key)
            n, longest = u.tree.num_tokens, int(u.tree.sequence_lengths.max())
            seen = set()
            for k in range(2, world_size + 1):
                groups = partition_ids(u.tree, max(-(-n // k), longest))
                if len(groups) < 2 or str(groups) in seen:
                    continue
                seen.add(str(groups))
                pieces = [costed(u.key[0], u.key + (g[0],), u.tree.subtree(g)) for g in groups]
                rest = [v for v in units if v is not u]
                trial = _lpt(rest + pieces, world_size)
                if _lower(_loads(trial), best[0] if best else _loads(ranks)):
                    best = (_loads(trial), rest + pieces, trial)
            if best:
                break
        if best is None:
            return ranks if _loads(ranks)[0] < _loads(start)[0] * (1 - 1e-9) else start
        _, units, ranks = best


# ---------------------------------------------------------------------- pack


_PACK_OPTIONS = frozenset(inspect.signature(layout.pack).parameters) - {"trees", "reduction"}
_SET_HERE = ("num_sequences", "loss_scale")


def pack(my_trees, group=None, reduction: str = "mean", *, allow_empty: bool = False,
         **pack_kwargs) -> TreeBatch | None:
    """Pack this rank's trees with the loss normalized over all ranks' sequences.

    This rank's trees packed for data-parallel training: ``treefx.pack(my_trees,
    reduction=, num_sequences=P, loss_scale=W, **pack_kwargs)`` with P the **global** sequence
    count (an all-reduce SUM of every rank's count over ``group``) and W the group's size.

    So every loss weight is ``w_t = W · Σ_{p∋t} ω_p r_p m_p(t) / P``: the rank's loss is W
    times its sequences' share of the global mean, and the mean over the W ranks of their
    losses — what DDP and FSDP compute when they average gradients over the group — is the
    loss of the whole global batch, ``(1/P) Σ_p ω_p · loss_p``, with its gradients, however
    the trees are split (see the module's docstring). It holds for ``treefx.tree_loss``,
    ``@treefx.step`` and every :mod:`treefx.rl` objective (all read the weights, or
    ``batch.num_sequences_normalizer`` = P and ``batch.loss_scale`` = W). Don't multiply the
    loss by the world size again. A loss whose gradients are summed over ranks rather than
    averaged wants ``treefx.pack(trees, num_sequences=P)`` without the scale instead.

    Every rank of ``group`` must call it (it is a collective), with at least one tree and the
    same ``reduction``; a rank given no trees, something that is not a ``treefx.Tree`` or an
    unknown option raises on every rank, not only its own (so no rank is left waiting).
    ``allow_empty=True``: a rank given no trees counts none and gets None, which
    :func:`treefx.backward` takes as a rank with nothing to train (it still runs its share of
    the collectives).
    ``group``: the process group gradients are averaged over (DDP's ``process_group``, FSDP's
    data-parallel ranks); default the default group. With tensor / context parallelism, ranks
    that share one batch are one data-parallel rank: pass the data-parallel group. The
    all-reduce runs on the device the group's backend needs (a CPU tensor for gloo, the
    current CUDA device for NCCL; with NCCL reading P back waits for the current stream).
    ``pack_kwargs``: the other options of :func:`treefx.pack` (``pad_to_multiple``,
    ``pad_token_id``, ``weight_dtype``); ``num_sequences`` and ``loss_scale`` are set here.
    The batch stays on the CPU: ``.to(device)`` it.
    """
    import torch.distributed as dist

    for key in _SET_HERE:
        if key in pack_kwargs:
            raise TypeError(
                f"treefx.distributed.pack sets {key} itself (num_sequences = the global "
                "sequence count over the group, loss_scale = the group size); leave it out, or "
                "use treefx.pack directly to set it by hand"
            )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "treefx.distributed.pack needs an initialized torch.distributed process group: "
            "call torch.distributed.init_process_group(...) first (torchrun sets up its "
            "environment), or, in a single process, use treefx.pack(trees) (with "
            "num_sequences= for micro-batches of a larger batch)"
        )
    world = dist.get_world_size(group)
    if dist.get_rank(group) < 0:
        raise ValueError("this process is not a member of the given process group")

    # Problems found here are shared through the all-reduce, so that every rank raises.
    error: Exception | None = None
    trees: list[Tree] = []
    try:
        unknown = sorted(set(pack_kwargs) - _PACK_OPTIONS)
        if unknown:
            raise TypeError(f"treefx.pack has no option {', '.join(map(repr, unknown))}; it "
                            f"takes {', '.join(sorted(_PACK_OPTIONS - set(_SET_HERE)))}")
        if reduction not in layout.REDUCTIONS:
            raise ValueError(f"reduction must be one of {layout.REDUCTIONS}, got {reduction!r}")
        trees = _tree_list(my_trees, "my_trees")
        if not trees and not allow_empty:
            raise ValueError("this rank has no trees; every rank needs at least one (see "
                             "treefx.distributed.assign), or allow_empty=True for "
                             "treefx.backward")
    except (TypeError, ValueError) as e:
        error = e
    local = sum(t.num_sequences for t in trees) if error is None else 0
    stats = torch.tensor([local, int(error is not None), int(reduction == "mean")],
                         dtype=torch.int64, device=_collective_device(group))
    dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    total, failed, means = (int(x) for x in stats.tolist())
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(
            f"treefx.distributed.pack: {failed} other rank(s) of the group were given invalid "
            "input (their error is raised there); this rank stops as well so that none waits "
            "in a later collective"
        )
    if means not in (0, world):
        raise ValueError(
            f"ranks disagree on the reduction: {means} of {world} packed with \"mean\", the "
            "others with \"sum\"; one global batch has one reduction"
        )
    if not trees:
        return None
    return layout.pack(trees, reduction=reduction, num_sequences=total, loss_scale=world,
                       **pack_kwargs)


def _collective_device(group) -> torch.device:
    """Where a tensor for a collective of ``group`` must live: the CPU for gloo (and MPI), the
    current CUDA device for NCCL, the current accelerator for other device backends."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or backend == "mpi":  # "cpu:gloo,cuda:nccl" takes CPU tensors too
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        dev = accelerator.current_accelerator()
        return torch.device(dev.type, accelerator.current_device_index())
    return torch.device("cpu")


# ---------------------------------------------------------------------- helpers


def _tree_list(trees, what: str) -> list[Tree]:
    if isinstance(trees, Tree):
        return [trees]
    if not isinstance(trees, Iterable) or isinstance(trees, (str, bytes)):
        raise TypeError(f"{what} must be a treefx.Tree or a list of them, got "
                        f"{type(trees).__name__}")
    out = list(trees)
    for i, t in enumerate(out):
        if not isinstance(t, Tree):
            raise TypeError(f"{what}[{i}] is a {type(t).__name__}, not a treefx.Tree")
    return out


_MISSING = object()


def _text_config(config):
    if isinstance(config, dict):
        return SimpleNamespace(**config)
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            return get_text(decoder=True)
        except TypeError:
            return get_text()
    return config


def _int_attr(cfg, *names, default=_MISSING):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 0:
                raise ValueError(f"config.{n} must be a non-negative integer, got {v!r}")
            return int(v)
    if default is _MISSING:
        raise ValueError(f"config has no {' / '.join(names)}; CostModel.from_config needs it")
    return default


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None:
            accelerator.synchronize(device)


def _scaled_tree(shape: str, tokens: int, *, seed: int, vocab_size: int) -> Tree:
    """A synthetic agent tree of about ``tokens`` unique tokens: ``"deep"`` is one rollout whose
    calls each extend the last (one path: ~N²/2 pairs), ``"wide"`` eight rollouts of a short
    prompt with the reasoning dropped between calls (far fewer pairs per token)."""
    def make(f: float) -> Tree:
        def r(n):
            k = max(1, round(n * f))
            return (k, k)
        if shape == "deep":
            return agent_tree(seed, vocab_size=vocab_size, system_len=r(100), prompt_len=r(50),
                              rollouts=1, turns=(4, 4), answer_len=r(40), tool_len=r(60),
                              think_mode=False, branch_prob=0.0)
        return agent_tree(seed, vocab_size=vocab_size, system_len=r(30), prompt_len=r(10),
                          rollouts=8, turns=(2, 2), think_len=r(30), answer_len=r(15),
                          tool_len=r(20), think_mode=True, branch_prob=0.0)

    f = tokens / 500.0
    tree = make(f)
    for _ in range(8):
        if abs(tree.num_tokens - tokens) <= 0.05 * tokens:
            break
        f *= tokens / tree.num_tokens
        tree = make(f)
    return tree


def _sample_batches(samples, *, vocab_size: int, seed: int) -> list[list[Tree]]:
    if samples is None:
        samples = (1024, 2048, 4096, 8192)
    if isinstance(samples, Tree):
        samples = [samples]
    if not isinstance(samples, Sequence) or isinstance(samples, (str, bytes)) or not samples:
        raise TypeError("samples must be None, a non-empty sequence of token sizes (ints), or "
                        "of trees / lists of trees")
    if all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in samples):
        batches = []
        for k, n in enumerate(samples):
            if n < 16:
                raise ValueError(f"samples[{k}] = {n}: token sizes must be at least 16")
            s = seed + 1000 * k
            batches.append([_scaled_tree("deep", int(n), seed=s, vocab_size=vocab_size)])
            batches.append([_scaled_tree("wide", int(n), seed=s + 1, vocab_size=vocab_size)])
            batches.append([_scaled_tree("deep", int(n) // 2, seed=s + 2, vocab_size=vocab_size),
                            _scaled_tree("wide", int(n) // 2, seed=s + 3, vocab_size=vocab_size)])
        return batches
    batches = []
    for k, s in enumerate(samples):
        if isinstance(s, numbers.Integral) and not isinstance(s, bool):
            raise TypeError("samples mixes token sizes and trees; give one kind")
        batch = _tree_list(s, f"samples[{k}]")
        if not batch:
            raise ValueError(f"samples[{k}] is empty")
        batches.append(batch)
    return batches


def _fit_nonnegative(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Coefficients β ≥ 0 (one per column of ``x``) and a free intercept minimizing
    Σ ((x β + c − t) / t)²; exact for a few columns: every subset of them is solved by least
    squares and the best solution with all its coefficients ≥ 0 kept."""
    n, k = x.shape
    w = 1.0 / np.maximum(t, np.finfo(np.float64).tiny)
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    best, best_err = np.zeros(k), math.inf
    for mask in range(1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        a = np.column_stack([xs[:, cols], np.ones(n)]) * w[:, None]
        sol, *_ = np.linalg.lstsq(a, t * w, rcond=None)
        if np.any(sol[:-1] < 0) or not np.all(np.isfinite(sol)):
            continue
        err = float(np.sum((a @ sol - t * w) ** 2))
        if err < best_err:
            beta = np.zeros(k)
            beta[cols] = sol[:-1]
            best, best_err = beta, err
    return best / scale
