"""``treefx.verify``: the rewritten model against the unmodified one, on a probe forest.

The passes rewrite what they recognise and refuse what they know to be unsafe; a model can
still do something along the tokens that no check foresaw. The probe catches that: it runs the
compiled tree model (the same compiled graph the user trains with) and the unmodified model on
each sequence of a small random forest with every odd shape (branches, a single-token node, a
sequence that is a prefix of another, a duplicate, two trees, more than one attention block on
the GPU), and compares log-probabilities and gradients within a tolerance stated per dtype.

``treefx.compile`` runs it once, on the first call, before the user's batch (``verify=True``,
the default): forward and gradients in a call with autograd on, log-probabilities alone in a
call without. It leaves the model as it found it (gradients in ``.grad``, buffers, random
state) and is skipped, with a warning, when the graph draws random numbers (dropout in
training mode), since two runs could not agree.

The package, one concept a module: :mod:`.check` (:func:`verify_compiled`, the check itself),
:mod:`.probe` (the probe forest and its vocabulary), :mod:`.oracle` (the per-sequence side: the
parameters compared, the model's state kept, gradients), :mod:`.floor` (the oracle's own
floating-point floor and the causal check), :mod:`.compare` (the errors of one side against the
other) and :mod:`.report` (tolerances, :class:`VerificationReport`, the errors raised).
"""

from __future__ import annotations

from .check import graph_draws_random, verify_compiled
from .floor import oracle_floor_gradients, rounding_noise
from .probe import VocabularyUnknown, declared_vocab_sizes, probe_forest, probe_vocab_size
from .report import FLOOR_FACTOR, Tolerance, TreeVerificationError, VerificationReport, \
    VerificationUnavailable, tolerance_for

__all__ = ["TreeVerificationError", "VerificationUnavailable", "VerificationReport", "Tolerance",
           "VocabularyUnknown", "oracle_floor_gradients", "probe_forest", "probe_vocab_size",
           "verify_compiled", "tolerance_for", "FLOOR_FACTOR", "declared_vocab_sizes",
           "graph_draws_random", "rounding_noise"]
