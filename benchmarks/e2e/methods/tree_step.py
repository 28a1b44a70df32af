"""treefx_step (opt-in): the same step written as an ordinary HF training step under
``@treefx.step`` (the loss pass: output projection fused with the tree cross-entropy in
chunks; the logits are never built)."""

from __future__ import annotations

import torch.nn.functional as F

import treefx

from .tree import tree_step


def hf_train_step(model, batch):
    """An ordinary HF-style step (per-sequence mean CE of shifted labels), for @treefx.step."""
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    logits = out.logits[:, :-1].flatten(0, 1).float()
    return F.cross_entropy(logits, batch["labels"][:, 1:].flatten())


def make(env, model, parts, args=None):
    train_step = treefx.step(hf_train_step, backend=env.tree_backend)
    parts["treefx_step_fn"] = train_step
    return lambda tree: tree_step(env, model, None, tree, lambda b: train_step(model, b))
