"""Cut a packed tree row into parts that fit a token budget, each token computed once.

Redundancy-free parts: a packed tree row cut into parts that fit a token budget, each token
computed once (see :func:`treefx.backward`, which runs them).

A part is a contiguous range ``[start, end)`` of the DFS row; boundaries may fall anywhere,
inside a node too (a sequence longer than the budget becomes a chain of parts). What a part
needs from earlier parts is what its tokens read of their **ancestors** there, and every such
ancestor is an ancestor of the part's first token (a token before ``start`` whose subtree holds
a later token holds ``start`` too): its *context* is the path from the root to ``start``.

- Context tokens: their keys and values (and conv inputs) at every site, read from the parts
  that computed them. They sit before the part's own tokens in an *extended row*
  ``[context (padded to a block multiple); part]`` whose tree tensors (positions, parents,
  subtree ends) are in that row's coordinates, so the tree mask stays the interval test.
- Entries: the part's tokens whose predecessor lies in an earlier part; each starts its node
  from the recurrent state after that predecessor, an *exit* of the earlier part (a token with
  a successor in a later part).
- Labels: the log-probability of token t is read from its predecessor's logits, so it belongs
  to the part of the predecessor: a part predicts every token whose predecessor it holds, its
  own and the first tokens of later parts.

Planning (:func:`plan`): a part of *closed* units (whole subtrees) is finished, forward and
backward, as soon as it ran; a part of an *open* node's own tokens (a node whose subtree does
not fit) is held until the node's subtree is done. The planner bounds the tokens holding
activations at once by ``max_tokens``, whatever the tree's shape (a comb-shaped agent tree,
whose whole trunk is open; a sequence longer than the budget): below *kept* open tokens
``K``, a subtree that fits in the room ``max_tokens - K`` is a closed unit (consecutive ones
share a part while they fit), a larger one is open. An open node keeps as many of its tokens
(held with their activations; its children then plan with them added to ``K``) as leave its
children the room they need, and never so many that the room drops below a quarter of
``max_tokens`` (parts stay large enough to keep a GPU busy) unless each child's subtree fits
in less; its other tokens, first in the
node, are *recompute* parts: their forward keeps no activations, only what later parts read
(their keys, values and conv inputs at every site, their exit states), and their backward
runs the forward again first. A leaf node longer than the room recomputes all but its last
``room`` tokens. How many to keep is exact for the fewest recomputed tokens (without the
quarter's floor and the rounding of chunks: see ``_kept``): a node keeps down to its
children's second largest "breakpoint", so on a comb the trunk keeps what leaves the longest
completion below room, and a chain keeps nothing. Nothing is recomputed while every root-to-leaf
path leaves a quarter of ``max_tokens``.

The keys and values of the *open path* (the context a part reads: the root to its first
token) are kept whatever the budget, since later parts attend to them:
:meth:`PartPlan.peak_context_tokens` is the longest, beside
:meth:`PartPlan.peak_held_tokens` (activations, at most ``max_tokens``) and
:attr:`PartPlan.recompute_tokens`. Bytes per open-path token: attention layers × 2 × KV
heads × head dim × dtype size (and each causal conv's input width × dtype size).
"""

# One concept a module: part_plan (Part, PartPlan and the order parts run in: schedule,
# ready), shape (what planning reads of a batch), units (the row cut into closed and open
# units), merge (parts merged within the bound; what is held at once), planner (plan,
# plan_even), tensors (what a part's graph takes).

from __future__ import annotations

from .part_plan import Part, PartPlan, ready, schedule  # noqa: F401
from .planner import BEYOND, plan, plan_even  # noqa: F401
from .tensors import keep_host_rows, part_tensors  # noqa: F401

__all__ = ["Part", "PartPlan", "plan", "plan_even"]
