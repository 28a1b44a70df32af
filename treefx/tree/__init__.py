"""Prefix trees of token sequences.

A :class:`Tree` holds the model calls of one task (one token list each) merged into a prefix
tree whose nodes are maximal shared segments. Every input sequence stays its own path, even when
it is a prefix of, or equal to, another one, and keeps its own weight and per-token loss mask.

Nodes are stored parents-first (``parents[i] < i``); the depth-first layout is made by
:func:`treefx.pack`.

A tree may carry **metadata** (``Tree.metadata``, a read-only mapping): what a trainer knows
about its sequences besides the tokens. Keys treefx knows, each checked when the tree is built:

- ``"task"``: the task (GRPO group) id, a string or an integer;
- ``"rollouts"``: per sequence, the rollout (agent trajectory) it is a model call of;
- ``"rewards"``: per sequence, a finite number (a rollout's reward, on each of its calls);
- ``"advantages"``: per sequence a finite number, or per token (``len(sequence) − 1`` values,
  entry k for token k + 1, as :mod:`treefx.rl` takes them);
- ``"logprobs"``: per sequence, the sampling log-probabilities of its tokens
  (``len(sequence) − 1`` values, entry k for token k + 1; NaN, or ``null`` in JSON, where there
  is none, such as prompt tokens), or None for a sequence without any.

Any other key is kept as given (JSON-like values: numbers, strings, lists, objects; lists
become tuples and objects read-only mappings, so the tree stays unchanged). :meth:`Tree.subtree`
keeps the per-sequence keys above for the sequences it takes and every other key as it is.
:func:`read_jsonl` / :func:`write_jsonl` write metadata beside ``"sequences"`` in each record.

One concept a module:

- :mod:`.core`: :class:`Tree` itself (built, viewed, cut into subtrees, as a record), :func:`por`
  and :func:`bound`;
- :mod:`.inputs`: what a tree is built from, checked (token lists, masks, weights);
- :mod:`.nodes`: the trie of token lists, and the checks of nodes given explicitly;
- :mod:`.metadata`: the metadata keys, checked, frozen and thawed;
- :mod:`.records`: trees in JSON Lines files.
"""

from __future__ import annotations

from .core import Tree, bound, por, rebuild_tree
from .inputs import as_token_array  # noqa: F401  (imported from here: treefx.data)
from .metadata import NODE_KEYS, SEQUENCE_KEYS, STRUCTURE_KEYS, values_equal  # noqa: F401
from .records import read_jsonl, write_jsonl

__all__ = ["Tree", "por", "bound", "read_jsonl", "write_jsonl"]

# Trees pickled before the package was split name this function by its old place.
_rebuild_tree = rebuild_tree
