"""Per-sequence data on the tree: summed over the sequences through each token
(:func:`token_sums`), or one value per token where the sequences through it agree
(:func:`to_tree`: old or reference log-probabilities), checked finite."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np
import torch

from ..layout import TreeBatch, TreeOutput
from .incidence import PathIncidence, path_incidence

__all__ = ["DEFAULT_ATOL", "DEFAULT_RTOL", "to_tree", "token_sums"]

# Old/reference log-probabilities of one context, given once per sequence, may come from
# separate calls of a rollout engine (bf16, other batch shapes): they agree to about this much.
# Pass them through to_tree with your own tolerance to be stricter or looser.
DEFAULT_ATOL = 1e-3
DEFAULT_RTOL = 1e-3


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


def flat_values(inc: PathIncidence, values, name: str, dtype, device, *,
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


def scatter(inc: PathIncidence, flat: torch.Tensor) -> torch.Tensor:
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
        flat = flat_values(inc, values, "values", dtype, batch.device)
    if weighted:
        flat = flat * inc.coef.to(device=flat.device, dtype=dtype)
    return scatter(inc, flat)


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
    flat = flat_values(inc, values, name, dtype, batch.device, finite=False)
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


def logprobs_on_tree(inc: PathIncidence, values, name: str, like: torch.Tensor) -> torch.Tensor:
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
    flat = flat_values(inc, values, name, like.dtype, like.device, scalars=False,
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
