"""The e2e methods, one module each. A method is ``make(env, model, parts, args)`` returning
``prepare(tree) -> step``; ``step()`` runs one timed training step (layout, mask, forward,
loss, backward) and returns the loss. ``parts`` holds what methods share on one model (the
compiled body, treefx models, masks)."""

from __future__ import annotations

from . import packed, packed_reset, tree, tree_step

# hand and one_by_one were retired in issue 67: git show cdfeaf0:benchmarks/e2e/methods/NAME.py
# treefx_regional and treefx_keep_states too: git show fae64e5:benchmarks/e2e/methods/tree.py
METHODS = ("treefx", "packed")
# opt-in with --methods (the treefx_* variants: methods/tree.py)
EXTRA_METHODS = ("treefx_step", "packed_reset", *tree.VARIANTS)
# --arch qwen3_next / qwen3_5 by default (plain packing would carry the state across sequences)
HYBRID_METHODS = ("treefx", "packed_reset")

MAKERS = {
    "treefx": tree.make,
    **{name: make for name, (make, _) in tree.VARIANTS.items()},
    "treefx_step": tree_step.make,
    "packed": packed.make,
    "packed_reset": packed_reset.make,
}

# The parts entry holding each treefx method's compiled object (its num_compilations).
TREEFX_OBJECTS = {"treefx": "treefx_model", "treefx_step": "treefx_step_fn",
                  **{name: key for name, (_, key) in tree.VARIANTS.items()}}
