"""``@treefx.step``: an ordinary training step, run exactly on a tree.

The step is written for a Hugging Face-style batch (``batch["input_ids"]``,
``batch["labels"]``, ...) and computes a cross-entropy loss. Called with a :class:`TreeBatch`,
it is captured as one graph together with the model; the passes rewrite its attention and
positions for the tree and its loss into the weighted tree loss, so it returns what per-sequence
training would: the per-sequence loss (its own reduction, its own loss mask) times the sequence
weight, averaged over the batch's sequences (divided by ``batch.num_sequences_normalizer``: the
batch's own count, or the global count given to ``treefx.pack(..., num_sequences=)``), with the
same gradients. Called with anything else it is the plain function.
"""

from __future__ import annotations

import functools

import torch

from .engine import TreeEngine, check_batch, tree_info, unwrap_compiled
from ..layout import TreeBatch
from ..options import Options
from ..plan import Plan
from .regional import unwrap_ddp

__all__ = ["step", "TreeStep", "step_batch", "step_weights"]


def step_function(user_fn):
    """The function a ``@treefx.step`` captures: the user's step on the Hugging Face-style
    batch of the tree row (:func:`step_batch`)."""
    def tree_step(model, input_ids, tree_info, tree_weights, *args, **kwargs):
        torch._check(tree_info.shape[1] == input_ids.shape[1])
        torch._check(tree_weights.shape[1] == input_ids.shape[1])
        batch = step_batch(input_ids, tree_info, (tree_info[1] >= 0) & (tree_weights[0] > 0))
        result = user_fn(model, batch, *args, **kwargs)
        # Small views of the tree inputs keep them graph inputs even when the step reads
        # neither.
        return result, tree_info[:, :1], tree_weights[:, :1]

    return tree_step


def step_batch(input_ids, tree_info, trained) -> dict:
    """The Hugging Face-style batch a step is called with on a tree row: the ids, labels
    (the ids where ``trained``, -100 elsewhere), the positions and an all-ones attention
    mask (without it a model infers packed sequences from the positions)."""
    ids = input_ids[0]
    return {"input_ids": input_ids,
            "labels": torch.where(trained, ids, torch.full_like(ids, -100))[None],
            "position_ids": tree_info[0:1],
            "attention_mask": torch.ones_like(input_ids)}


def step_weights(batch: TreeBatch) -> torch.Tensor:
    """[2, N]: the batch's loss weights for a step whose cross-entropy sums ("sum", row 0)
    or averages ("mean", row 1) each sequence's tokens; at least float32."""
    weights = torch.stack([batch.loss_weights_for("sum"), batch.loss_weights_for("mean")])
    return weights.to(torch.promote_types(weights.dtype, torch.float32))


class TreeStep:
    """A training step compiled for trees (see :func:`step`)."""

    def __init__(self, fn, *, backend: str = "auto", block_size: int = 128,
                 kernel_options: dict | None = None, interleave_heads: bool | None = None,
                 regional: bool | None = None):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.plan = Plan(backend=backend, block_size=block_size,
                         kernel_options=kernel_options, interleave_heads=interleave_heads,
                         regional=regional, mode="step", options=Options.from_env())
        self.engine = TreeEngine(step_function(fn), self.plan)

    @property
    def num_compilations(self) -> int:
        return self.engine.num_compilations

    @property
    def timings(self) -> dict[str, float]:
        """Seconds spent so far in treefx's passes and the backend's compilation
        (:attr:`treefx.TreeModel.timings`)."""
        return dict(self.engine.timings)

    @property
    def contexts(self):
        return self.engine.contexts

    def __call__(self, model: torch.nn.Module, batch, *args, **kwargs):
        if not isinstance(batch, TreeBatch):
            return self.fn(model, batch, *args, **kwargs)
        held = unwrap_compiled(model)
        # Under DDP the step runs on the inner module; the wrapper's call wraps the run.
        model, wrapper = unwrap_ddp(held)
        check_batch(model, batch)
        # the model runs without a cache (its configs' use_cache off: the capture environment)
        result, _, _ = self.engine(batch.device, model, batch.input_ids, tree_info(batch),
                                   step_weights(batch), *args, dynamic=(1, 2, 3),
                                   discover_in=model, root=wrapper or model, **kwargs)
        return result


def step(fn=None, *, backend: str = "auto", block_size: int = 128,
         kernel_options: dict | None = None, interleave_heads: bool | None = None,
         regional: bool | None = None):
    """Make an ordinary training step compute the per-sequence loss on a tree, exactly.

    Decorate a training step ``fn(model, batch, ...) -> loss`` so that
    ``fn(model, tree_batch)`` returns the per-branch baseline loss, exactly, with its gradients.

    The step computes ``F.cross_entropy`` of shifted logits and labels (reduction "mean" or
    "sum"), by hand or through a Hugging Face model called with ``labels=``. In a tree step,
    ``batch["labels"]`` are the tokens (-100 where no sequence trains on a token); which tokens
    count for each sequence comes from the tree's loss masks, and "mean" is over each
    sequence's own masked tokens. The sequences are averaged as :func:`treefx.pack` says
    (``(1/P) Σ_p ω_p · loss_p``, P the batch's sequence count or the global ``num_sequences``
    it was packed with). ``batch["attention_mask"]`` (all ones) may be passed to a Hugging
    Face model or left out, as in a per-sequence step (Hugging Face's packed-sequence inference
    from the positions finds one sequence per path, as each sequence alone does:
    :mod:`treefx.families.hf_packing`). ``model`` may be a PEFT
    model (LoRA, ...); one wrapped in ``torch.compile`` reaches ``fn`` as its original module
    (``model._orig_mod``), which the step's own capture compiles. ``backend`` and
    ``kernel_options``, ``interleave_heads`` and ``regional`` as for :func:`treefx.compile`
    (a model sharded with FSDP2 or wrapped in DDP runs regionally; the step's own code runs
    in the glue around the blocks, inside the root's call). The model runs without a cache:
    its configs' ``use_cache`` is False during the step.
    """
    if fn is None:
        return functools.partial(step, backend=backend, block_size=block_size,
                                 kernel_options=kernel_options,
                                 interleave_heads=interleave_heads, regional=regional)
    return TreeStep(fn, backend=backend, block_size=block_size, kernel_options=kernel_options,
                    interleave_heads=interleave_heads, regional=regional)
