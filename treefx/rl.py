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

from __future__ import annotations

import numbers
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from .layout import TreeBatch
from .tree import Tree
from .layout import TreeOutput

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

KL_ESTIMATORS = ("k1", "k2", "k3")

# Old/reference log-probabilities of one context, given once per sequence, may come from
# separate calls of a rollout engine (bf16, other batch shapes): they agree to about this much.
# Pass them through to_tree with your own tolerance to be stricter or looser.
DEFAULT_ATOL = 1e-3
DEFAULT_RTOL = 1e-3


# ---------------------------------------------------------------------- incidence


@dataclass(frozen=True, eq=False)
class PathIncidence:
    """Where each predicted token of each sequence lies in the tree, over all sequences.

    Every sequence's path through the tree, flattened: one entry per predicted baseline
    token (sequence p, position j ≥ 1), ordered by sequence, then position. T entries in all
    (the batch's baseline tokens minus one per sequence).

    - ``token`` [T]: the token's index in the DFS row.
    - ``sequence`` [T]: p, numbered over the forest as in :meth:`TreeBatch.sequence_index`.
    - ``position`` [T]: j, the token's offset in its sequence (≥ 1).
    - ``coef`` [T] float64: c_p(j) = ω_p · r_p · m_p(j) · s / P (P =
      ``batch.num_sequences_normalizer``, s = ``batch.loss_scale``); ``token_sums`` of it is
      ``batch.loss_weights``.
    - ``sequence_lengths`` [P]: tokens per sequence (L_p; each has L_p − 1 entries here).
    - ``first`` / ``first_trained`` [N]: per token, the first entry through it (among entries
      with ``coef > 0`` for the latter), −1 where there is none.
    - ``sequence_names``: how errors name sequence p ("sequence 7 (tree 1, its sequence 2)").
    """

    token: torch.Tensor
    sequence: torch.Tensor
    position: torch.Tensor
    coef: torch.Tensor
    sequence_lengths: torch.Tensor
    first: torch.Tensor
    first_trained: torch.Tensor
    num_tokens: int
    sequence_names: tuple[str, ...]

    @property
    def num_sequences(self) -> int:
        return int(self.sequence_lengths.numel())

    @property
    def trained(self) -> torch.Tensor:
        """[N] bool: tokens that some sequence trains on (some ``coef > 0`` through them)."""
        return self.first_trained >= 0


# Keyed by the batch object: a batch is immutable by convention, and `batch.to(device)` makes a
# new one (which gets its own incidence on its own device).
_INCIDENCE: weakref.WeakKeyDictionary[TreeBatch, PathIncidence] = weakref.WeakKeyDictionary()


def path_incidence(batch: TreeBatch) -> PathIncidence:
    """Build where each sequence's predicted tokens lie in the tree, once per batch.

    The flat incidence of all sequences' paths (see :class:`PathIncidence`), built once per
    batch (a loop over sequences walking node paths, the rest vectorized) and cached."""
    if not isinstance(batch, TreeBatch):
        raise TypeError(f"expected a treefx.TreeBatch (see treefx.pack), got "
                        f"{type(batch).__name__}")
    inc = _INCIDENCE.get(batch)
    if inc is None:
        inc = _build_incidence(batch)
        _INCIDENCE[batch] = inc
    return inc


def restricted_incidence(batch: TreeBatch, inc: PathIncidence,
                         mask: torch.Tensor) -> TreeBatch:
    """Give a batch the path incidence of another, restricted to the tokens of one part.

    ``batch``'s path incidence becomes ``inc`` with its coefficients zero outside ``mask``
    [N] (the tokens one part of a tree predicts, :func:`treefx.backward`): what
    :func:`path_incidence` returns for that batch from then on. ``batch`` must be a new batch
    (one made by ``dataclasses.replace``), not yet given an incidence."""
    if batch in _INCIDENCE:
        raise ValueError("restricted_incidence: the batch already has its path incidence")
    keep = mask[inc.token.to(mask.device)].to(inc.coef.device)
    coef = torch.where(keep, inc.coef, torch.zeros_like(inc.coef))
    token = inc.token.cpu().numpy()
    first_trained = _first_entry(token, (coef > 0).cpu().numpy(), inc.num_tokens)
    _INCIDENCE[batch] = replace(inc, coef=coef, first_trained=torch.as_tensor(
        first_trained, device=inc.first_trained.device))
    return batch


def _build_incidence(batch: TreeBatch) -> PathIncidence:
    node_parent = batch.node_parent.tolist()
    node_offset = batch.node_offset.cpu().numpy()
    node_length = batch.node_length.cpu().numpy()
    path_nodes: list[int] = []
    path_sizes: list[int] = []
    for end in batch.sequence_node_ends.tolist():
        path = []
        while end >= 0:
            path.append(end)
            end = node_parent[end]
        path_nodes.extend(reversed(path))
        path_sizes.append(len(path))
    nodes = np.asarray(path_nodes, dtype=np.int64)
    lengths = node_length[nodes]
    total = int(lengths.sum())
    # Entry e lies in path node n at offset e − (n's first entry): its token is offset[n] + that.
    node_first_entry = np.cumsum(lengths) - lengths
    token = np.repeat(node_offset[nodes] - node_first_entry, lengths) + np.arange(total)
    path_ends = np.cumsum(path_sizes)
    seq_lengths = np.add.reduceat(lengths, path_ends - np.asarray(path_sizes))
    num_seq = len(path_sizes)
    sequence = np.repeat(np.arange(num_seq), seq_lengths)
    position = np.arange(total) - np.repeat(np.cumsum(seq_lengths) - seq_lengths, seq_lengths)

    trees = batch.trees
    tree_lengths = np.concatenate([t.sequence_lengths for t in trees])
    if not np.array_equal(tree_lengths, seq_lengths):
        raise RuntimeError("the batch's layout does not match its trees' sequences; was the "
                           "batch built by treefx.pack and its trees left unchanged?")
    weights = np.concatenate([np.asarray(t.weights, dtype=np.float64) for t in trees])
    masks = np.concatenate([t.loss_mask(i) for t in trees for i in range(t.num_sequences)])
    predicted = position >= 1  # nothing predicts a sequence's first token
    token, sequence, position, mask = (a[predicted] for a in (token, sequence, position, masks))
    masked_count = np.bincount(sequence, weights=mask, minlength=num_seq)
    if batch.reduction == "sum":
        r = np.ones(num_seq)
    else:  # a sequence with nothing to predict adds nothing
        r = np.divide(1.0, masked_count, out=np.zeros(num_seq), where=masked_count > 0)
    coef = weights[sequence] * r[sequence] / batch.num_sequences_normalizer * batch.loss_scale \
        * mask

    n = batch.num_tokens
    first = _first_entry(token, np.ones(len(token), dtype=bool), n)
    first_trained = _first_entry(token, coef > 0, n)
    names = tuple(
        f"sequence {p}" if len(trees) == 1 else f"sequence {p} (tree {ti}, its sequence {i})"
        for p, (ti, i) in enumerate((ti, i) for ti, t in enumerate(trees)
                                    for i in range(t.num_sequences))
    )

    dev = batch.device

    def tensor(a, dtype=torch.int64):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=dev, dtype=dtype)

    return PathIncidence(
        token=tensor(token), sequence=tensor(sequence), position=tensor(position),
        coef=tensor(coef, torch.float64), sequence_lengths=tensor(seq_lengths),
        first=tensor(first), first_trained=tensor(first_trained), num_tokens=n,
        sequence_names=names,
    )


def _first_entry(token: np.ndarray, selected: np.ndarray, n: int) -> np.ndarray:
    """Per tree token, the index of the first selected entry through it, or −1."""
    out = np.full(n, -1, dtype=np.int64)
    entries = np.flatnonzero(selected)
    uniq, first = np.unique(token[entries], return_index=True)
    out[uniq] = entries[first]
    return out


# ---------------------------------------------------------------------- per-sequence data


def _is_scalar(x) -> bool:
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x.ndim == 0
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _float_dtype(values) -> torch.dtype:
    """The floating dtype data comes in (the default dtype for Python numbers and integers)."""
    items = values if isinstance(values, (list, tuple)) else [values]
    dtypes = [x.dtype for x in items if isinstance(x, torch.Tensor) and x.is_floating_point()]
    dtypes += [torch.from_numpy(np.zeros(0, x.dtype)).dtype for x in items
               if isinstance(x, np.ndarray) and np.issubdtype(x.dtype, np.floating)]
    if not dtypes:
        return torch.get_default_dtype()
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


_NONFINITE_HINT = (
    "; GRPO's (R − mean R) / std R is NaN or infinite for a group whose rewards are all equal "
    "(std 0): add an epsilon to the std, or give such a group advantage 0"
)


def _flat_values(inc: PathIncidence, values, name: str, dtype, device, *,
                 scalars: bool = True, finite: bool = True) -> torch.Tensor:
    """Per-sequence data as one value per incidence entry, [T].

    ``values``: a [P] tensor / list of P numbers (one per sequence, when ``scalars``), or a list
    of P per-token tensors, sequence p's of length L_p − 1 (entry k for token k + 1).
    ``finite``: every value must be finite (advantages, token_sums' values: a coefficient 0
    times NaN or inf is NaN, so none may be). Otherwise the caller checks the entries it reads.
    """
    num_seq = inc.num_sequences
    per_token_hint = (f"a list of {num_seq} per-token tensors (sequence p's of length "
                      f"len(sequence p) − 1, entry k for token k + 1, as "
                      f"treefx.reference.sequence_logprobs gives)")
    expected = (f"one value per sequence (shape [{num_seq}]) or {per_token_hint}" if scalars
                else per_token_hint)
    if isinstance(values, (torch.Tensor, np.ndarray)):
        v = torch.as_tensor(values)
        if scalars and v.ndim == 1 and v.shape[0] == num_seq:
            v = v.to(device=device, dtype=dtype)
            if finite:
                _check_sequence_values(inc, v, name)
            return v[inc.sequence.to(device)]
        raise ValueError(f"{name} has shape {list(v.shape)} but the batch holds {num_seq} "
                         f"sequences; give {expected}")
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise TypeError(f"{name} must be {expected}, got {type(values).__name__}")
    if len(values) != num_seq:
        raise ValueError(f"{name} has {len(values)} entries but the batch holds {num_seq} "
                         f"sequences; give {expected}")
    is_scalar = [_is_scalar(x) for x in values]
    if scalars and num_seq and all(is_scalar):
        v = torch.stack([torch.as_tensor(x, dtype=dtype, device=device) for x in values])
        if finite:
            _check_sequence_values(inc, v, name)
        return v[inc.sequence.to(device)]
    if any(is_scalar):
        p = is_scalar.index(True)
        raise ValueError(f"{name}[{p}] is a single number but other entries are not; give "
                         f"{expected}")
    lengths = inc.sequence_lengths.tolist()
    parts = []
    for p, (x, length) in enumerate(zip(values, lengths)):
        try:
            x = torch.as_tensor(x, dtype=dtype, device=device)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{name}[{p}] ({inc.sequence_names[p]}) is not a list of numbers "
                            f"or a tensor: {type(x).__name__}") from None
        if x.ndim != 1 or x.numel() != length - 1:
            raise ValueError(
                f"{name}[{p}] has shape {list(x.shape)} but {inc.sequence_names[p]} has "
                f"{length} tokens, so {length - 1} predicted tokens; give one value per "
                f"predicted token (tokens 1..{length - 1}), as "
                "treefx.reference.sequence_logprobs does"
            )
        parts.append(x)
    flat = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=device)
    if finite:
        with torch.no_grad():
            bad = ~torch.isfinite(flat)
            if bool(bad.any()):
                k = int(bad.nonzero()[0])
                p, j = int(inc.sequence[k]), int(inc.position[k])
                raise ValueError(
                    f"{name}[{p}] ({inc.sequence_names[p]}), entry {j - 1} (token {j}, tree "
                    f"token {int(inc.token[k])}): value {float(flat[k])} is not finite"
                    + (_NONFINITE_HINT if name == "advantages" else "")
                )
    return flat


def _check_sequence_values(inc: PathIncidence, v: torch.Tensor, name: str) -> None:
    """One value per sequence: all finite, or a ValueError naming the first sequence."""
    with torch.no_grad():
        bad = ~torch.isfinite(v)
        if bool(bad.any()):
            p = int(bad.nonzero()[0])
            raise ValueError(
                f"{name}[{p}] ({inc.sequence_names[p]}) is {float(v[p])}, not finite"
                + (_NONFINITE_HINT if name == "advantages" else "")
            )


def _scatter(inc: PathIncidence, flat: torch.Tensor) -> torch.Tensor:
    """[T] → [N]: per tree token, the sum over the entries through it."""
    out = torch.zeros(inc.num_tokens, dtype=flat.dtype, device=flat.device)
    return out.index_add(0, inc.token.to(flat.device), flat)


def token_sums(batch: TreeBatch, values=None, *, weighted: bool = True,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum per-sequence values over the sequences through each tree token.

    Per tree token t, the sum over the sequences through it:

        out[t] = Σ_{p∋t} c_p(t) · x_p(t)    c_p(j) = ω_p · r_p · m_p(j) · s / P  (1 if not weighted)

    (P = ``batch.num_sequences_normalizer``, s = ``batch.loss_scale``). ``values`` (x): one
    value per sequence ([P] tensor or list of P numbers), or a list of P per-token tensors of
    length len(sequence) − 1 (entry k for token k + 1), all finite; ``None`` means x = 1, so
    ``token_sums(batch)`` is ``batch.loss_weights`` (in float64). Tokens no sequence predicts
    (a root's first token, padding) get 0. Differentiable in ``values``.
    """
    inc = path_incidence(batch)
    if dtype is None:
        dtype = torch.float64 if values is None else _float_dtype(values)
    if values is None:
        flat = torch.ones(inc.token.numel(), dtype=dtype, device=batch.device)
    else:
        flat = _flat_values(inc, values, "values", dtype, batch.device)
    if weighted:
        flat = flat * inc.coef.to(device=flat.device, dtype=dtype)
    return _scatter(inc, flat)


def to_tree(batch: TreeBatch, values, *, fill: float = 0.0, trained_only: bool = True,
            atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL, name: str = "values",
            dtype: torch.dtype | None = None) -> torch.Tensor:
    """Put per-sequence, per-token values (old or reference log-probs) onto the tree's tokens.

    Per-sequence data that is a function of the context (old or reference log-probabilities,
    a value model's outputs) as one [N] tensor on the tree, like ``out.token_logprobs``.

    ``values``: a list of P per-token tensors, sequence p's of length len(sequence p) − 1 (entry
    k for token k + 1: :func:`treefx.reference.sequence_logprobs`'s convention), or one value
    per sequence ([P], broadcast over its predicted tokens). A token shared by several sequences
    has one context, so their values must agree (``|a − b| ≤ atol + rtol·|b|``): a
    ``ValueError`` names the sequences, position and values otherwise, and non-finite values
    raise too. The tree takes the first sequence's value.

    ``trained_only``: look only at entries a sequence trains on (``ω_p r_p m_p(j) > 0``);
    rollout engines often leave placeholders on context tokens, which the loss never reads.
    Tokens without a (trained) entry get ``fill``. Per-sequence quantities that may differ on
    shared tokens, such as advantages, are not for this: see :func:`token_sums`.
    """
    inc = path_incidence(batch)
    dtype = dtype or _float_dtype(values)
    flat = _flat_values(inc, values, name, dtype, batch.device, finite=False)
    return _map_agreeing(inc, flat, name=name, fill=fill, trained_only=trained_only,
                         atol=atol, rtol=rtol)


def _map_agreeing(inc: PathIncidence, flat: torch.Tensor, *, name: str, fill: float,
                  trained_only: bool, atol: float, rtol: float) -> torch.Tensor:
    first = (inc.first_trained if trained_only else inc.first).to(flat.device)
    selected = (inc.coef > 0 if trained_only else torch.ones_like(inc.coef, dtype=torch.bool))
    selected = selected.to(flat.device)
    with torch.no_grad():
        bad = selected & ~torch.isfinite(flat)
        if bool(bad.any()):
            k = int(bad.nonzero()[0])
            raise ValueError(f"{name}: {inc.sequence_names[int(inc.sequence[k])]}, token "
                             f"{int(inc.position[k])}: value {float(flat[k])} is not finite")
        reference = flat[first[inc.token.to(flat.device)].clamp(min=0)]
        off = selected & ((flat - reference).abs() > atol + rtol * reference.abs())
        if bool(off.any()):
            k = int(off.nonzero()[0])
            other = int(first[int(inc.token[k])])
            raise ValueError(
                f"{name} disagree on a shared token: {inc.sequence_names[int(inc.sequence[other])]}"
                f" has {float(flat[other]):.6g} and {inc.sequence_names[int(inc.sequence[k])]} "
                f"has {float(flat[k]):.6g} at token {int(inc.position[k])} (tree token "
                f"{int(inc.token[k])}), beyond atol={atol}, rtol={rtol}. Both sequences reach "
                "that token through the same prefix, so its log-probability is one number; "
                "values that differ mean the data is misaligned or from different policies"
            )
    has = first >= 0
    mapped = flat[first.clamp(min=0)] if flat.numel() else torch.zeros(
        inc.num_tokens, dtype=flat.dtype, device=flat.device)
    return torch.where(has, mapped, torch.full_like(mapped, fill))


def _logprobs_on_tree(inc: PathIncidence, values, name: str, like: torch.Tensor) -> torch.Tensor:
    """Old/reference log-probabilities as a detached [N] tensor in ``like``'s dtype: given on the
    tree already, or per sequence (checked to agree on shared tokens)."""
    if isinstance(values, TreeOutput):
        values = values.token_logprobs
    if isinstance(values, (torch.Tensor, np.ndarray)):
        v = torch.as_tensor(values)
        if v.ndim == 1 and v.shape[0] == inc.num_tokens:
            # Constants of the objective: a graph attached to them (old = current log-probs,
            # say) would turn the ratio's gradient into 0.
            v = v.detach().to(device=like.device, dtype=like.dtype)
            _check_tree_values(inc, v, name)
            return v
        raise ValueError(
            f"{name} has shape {list(v.shape)}; give it on the tree, shape "
            f"[{inc.num_tokens}] (batch.num_tokens) like out.token_logprobs, or as a list of "
            f"{inc.num_sequences} per-sequence tensors of length len(sequence) − 1 (as "
            "treefx.reference.sequence_logprobs gives)"
        )
    flat = _flat_values(inc, values, name, like.dtype, like.device, scalars=False,
                        finite=False).detach()
    return _map_agreeing(inc, flat, name=name, fill=0.0, trained_only=True,
                         atol=DEFAULT_ATOL, rtol=DEFAULT_RTOL)


def _check_tree_values(inc: PathIncidence, v: torch.Tensor, name: str) -> None:
    """Values on the tree [N]: finite on every token some sequence trains on (the objectives
    read no other; placeholders elsewhere, padding say, are left alone), or a ValueError naming
    the token's DFS index and a sequence through it."""
    with torch.no_grad():
        bad = inc.trained.to(v.device) & ~torch.isfinite(v)
        if bool(bad.any()):
            t = int(bad.nonzero()[0])
            e = int(inc.first_trained[t])
            p = int(inc.sequence[e])
            raise ValueError(
                f"{name}: tree token {t} (token {int(inc.position[e])} of "
                f"{inc.sequence_names[p]}, among others through it) is {float(v[t])}, not "
                "finite; a sequence trains on that token, so the loss would be NaN"
            )


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


# ---------------------------------------------------------------------- objectives


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
    adv = _flat_values(inc, advantages, "advantages", lp.dtype, lp.device)
    weight = _scatter(inc, inc.coef.to(device=lp.device, dtype=lp.dtype) * adv)
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
    adv = _flat_values(inc, advantages, "advantages", lp.dtype, lp.device)
    old = _logprobs_on_tree(inc, old_logprobs, "old_logprobs", lp)
    # Tokens no sequence trains on have weight 0; zeroing their log-ratio keeps a placeholder
    # old value there (or padding) from making exp overflow and 0 · inf a NaN.
    log_ratio = torch.where(inc.trained.to(lp.device), lp - old, torch.zeros_like(lp))
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    coef = inc.coef.to(device=lp.device, dtype=lp.dtype)
    positive = _scatter(inc, coef * adv.clamp(min=0))
    negative = _scatter(inc, coef * adv.clamp(max=0))
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
    ref = _logprobs_on_tree(inc, ref_logprobs, "ref_logprobs", lp)
    d = torch.where(inc.trained.to(lp.device), ref - lp, torch.zeros_like(lp))
    if estimator == "k1":
        kl = -d
    elif estimator == "k2":
        kl = 0.5 * d * d
    else:
        kl = torch.expm1(d) - d  # exp(d) − 1 − d without cancellation near d = 0
    weight = _scatter(inc, inc.coef.to(device=lp.device, dtype=lp.dtype))
    return coef * (weight * kl).sum()


# ---------------------------------------------------------------------- metadata

_METADATA_HINTS = {
    "logprobs": "; treefx.data.from_ids records them from calls with logprobs",
    "rewards": "; treefx.data.group(rollouts, rewards=...) records one per rollout",
    "advantages": ("; compute them on the whole group and store them: "
                   "tree.with_metadata(advantages=rl.grpo_advantages(tree).tolist())"),
}


def from_metadata(batch: TreeBatch, key: str):
    """Read per-sequence metadata of a batch's trees (rewards, advantages, log-probs) as tensors.

    Per-sequence metadata of the batch's trees (``tree.metadata[key]``), in the batch's
    sequence order and the forms the objectives take: one number per sequence (rewards,
    GRPO advantages) as a [P] float64 tensor; per-token values (sampling ``"logprobs"``,
    per-token advantages: ``len(sequence) − 1`` each, entry k for token k + 1) as a list of P
    float64 tensors, NaN where a tree has none (the objectives read only trained tokens, and
    check those). Trees that hold one number per sequence beside trees that hold per-token
    values: the numbers are repeated over the tokens. Every tree must have the key.

    ``rl.ppo_clip_loss(lp, batch, advantages, from_metadata(batch, "logprobs"))`` trains
    against the log-probabilities the rollouts were sampled with; a token two calls both
    sampled (GRPO rollouts beginning alike) must have agreeing values, see :func:`to_tree`.
    """
    if not isinstance(batch, TreeBatch):
        raise TypeError(f"expected a treefx.TreeBatch (see treefx.pack), got "
                        f"{type(batch).__name__}")
    values = []
    for ti, tree in enumerate(batch.trees):
        if key not in tree.metadata:
            raise ValueError(f"tree {ti} of the batch has no metadata {key!r} (it has "
                             f"{sorted(tree.metadata)}){_METADATA_HINTS.get(key, '')}")
        v = tree.metadata[key]
        lengths = tree.sequence_lengths.tolist()
        try:
            if isinstance(v, np.ndarray) or all(isinstance(x, numbers.Real) for x in v):
                per_seq = np.asarray(v, dtype=np.float64)
                if per_seq.shape != (tree.num_sequences,):
                    raise ValueError(f"has shape {list(per_seq.shape)}")
                values.append(per_seq)
            else:
                per_tok = [np.asarray(x, dtype=np.float64) for x in v]
                if len(per_tok) != tree.num_sequences or any(
                        x.shape != (n - 1,) for x, n in zip(per_tok, lengths)):
                    raise ValueError("does not hold len(sequence) − 1 values per sequence")
                values.append(per_tok)
        except (TypeError, ValueError) as e:
            raise ValueError(f"tree {ti}: metadata {key!r} is neither one number per "
                             f"sequence nor per-token values of its sequences ({e})") from None
    if all(isinstance(v, np.ndarray) for v in values):
        return torch.from_numpy(np.concatenate(values))
    out = []
    for tree, v in zip(batch.trees, values):
        if isinstance(v, np.ndarray):
            v = [np.full(int(n) - 1, x) for x, n in zip(v.tolist(), tree.sequence_lengths)]
        out.extend(torch.from_numpy(np.array(x)) for x in v)
    return out


def grpo_advantages(trees, *, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """GRPO's group-normalized advantages, one per sequence, from the trees' rewards.

    GRPO's group-normalized advantages from the trees' metadata, one per sequence: for a
    sequence of rollout g, ``A = (R_g − mean R) / (std R + eps)`` over the rollouts of its group
    (``scale=False``: ``R_g − mean R``, Dr. GRPO), as a [P] float64 tensor in the order of the
    trees' sequences.

    ``trees``: a tree, a list of trees or a :class:`TreeBatch`. A group is the trees that share
    a task id (metadata ``"task"``; a tree without one is a group of its own), its rollouts are
    given by ``"rollouts"`` (each sequence its own rollout where a tree has none), and every
    sequence of a rollout must carry the same ``"rewards"`` entry: the rollout's reward, counted
    once however many calls the rollout made. ``std`` is the sample standard deviation (as in
    TRL and verl); a group of one rollout gets advantage 0.

    Compute advantages over whole groups: on a part of a group (a tree split by
    :func:`treefx.partition`) the mean and std would be the part's. Store them on the tree
    first (``tree.with_metadata(advantages=grpo_advantages(tree).tolist())``) and read them per
    part with :func:`from_metadata`.
    """
    if isinstance(trees, TreeBatch):
        trees = trees.trees
    elif isinstance(trees, Tree):
        trees = [trees]
    trees = list(trees)
    if not trees or not all(isinstance(t, Tree) for t in trees):
        raise TypeError("trees must be a treefx.Tree, a list of them or a TreeBatch")
    if not (isinstance(eps, numbers.Real) and np.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite non-negative number, got {eps!r}")
    # (group, rollout) of every sequence, and each rollout's reward
    keys, reward_of = [], {}
    for ti, t in enumerate(trees):
        if "rewards" not in t.metadata:
            raise ValueError(f"tree {ti} has no metadata 'rewards'{_METADATA_HINTS['rewards']}")
        task = t.metadata.get("task")
        group = ("task", task) if task is not None else ("tree", ti)
        rollouts = t.metadata.get("rollouts", range(t.num_sequences))
        for p, (r, reward) in enumerate(zip(rollouts, t.metadata["rewards"].tolist())):
            rollout = (group, ti, r)
            seen = reward_of.setdefault(rollout, (reward, p))
            if seen[0] != reward:
                raise ValueError(
                    f"tree {ti}: sequences {seen[1]} and {p} are calls of one rollout ({r!r}) "
                    f"but carry different rewards ({seen[0]} and {reward}); a rollout has one "
                    "reward")
            keys.append(rollout)
    by_group: dict = {}
    for rollout, (reward, _) in reward_of.items():
        by_group.setdefault(rollout[0], []).append(reward)
    stats = {}
    for group, rewards in by_group.items():
        r = np.asarray(rewards, dtype=np.float64)
        std = float(r.std(ddof=1)) if r.size > 1 else 0.0
        stats[group] = (float(r.mean()), std)
    adv = np.empty(len(keys))
    for k, rollout in enumerate(keys):
        mean, std = stats[rollout[0]]
        a = reward_of[rollout][0] - mean
        adv[k] = a / (std + eps) if scale and std + eps > 0 else a
    return torch.from_numpy(adv)
