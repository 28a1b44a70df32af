"""What the first-call check judges by and reports: its errors, the tolerance per dtype (and
the oracle's floor it may be raised to), and :class:`VerificationReport`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..compiler import TreeCompileError

__all__ = ["FLOOR_FACTOR", "Tolerance", "TreeVerificationError", "VerificationReport",
           "VerificationUnavailable", "tolerance_for"]


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
# embeddings and linear layers perturbed by one rounding of their dtype (:func:`rounding_noise`).
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
