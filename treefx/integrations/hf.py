"""Hugging Face's Trainer on prefix trees, with the loss it would compute on the rows.

A collator merges a micro-batch's rows into one prefix tree, and a trainer computes the loss on
it, normalized the way ``Trainer`` normalizes.

    from treefx.integrations.hf import TreeTrainer

    trainer = TreeTrainer(model=model, args=TrainingArguments(...), train_dataset=rows)
    trainer.train()

``rows``: a dataset whose rows hold ``input_ids`` (with ``labels`` -100 where a token is not
trained, or a ``completion_mask`` / ``assistant_masks``; without either every token is
trained), or a :class:`treefx.Tree` under ``"tree"``. The rows of one micro-batch that share a
prefix (the calls of one agent task, several answers to one prompt, the turns of one
conversation) are merged into a prefix tree (:class:`TreeCollator`), and the model runs once on
its depth-first row (:func:`treefx.compile`): every shared prefix computed once.

**What the loss is.** ``Trainer``'s own path for a causal LM is the token mean over the
accumulated step: the sum of the token losses of every row of every micro-batch in one
optimizer step, divided by ``num_items_in_batch``, the number of trained tokens it counts over
``labels[..., 1:]`` (summed over the ranks when ``average_tokens_across_devices``). Counting
``labels`` on a tree's row would count a shared token once instead of once per row that
trains it, so this trainer counts the rows' trained tokens as the rows have them
(``_get_num_items_in_batch``), and its loss is the tree's sum over rows (each token's loss
times the number of rows that train it: :func:`treefx.pack` with ``reduction="sum"``) divided
by that count. Loss, gradients and the optimizer's next parameters equal ``Trainer`` on the
rows padded into a batch (``tests/test_integration_hf.py``).

Not covered: label smoothing and ``compute_loss_func`` (refused: both need logits and labels
in a row layout); labels other than the input shifted by one (refused when found);
``nn.DataParallel`` (``n_gpu > 1``) and tensor / context / sequence parallelism (refused).
Evaluation reports the same loss (``prediction_step``), no logits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from transformers import Trainer

from .. import layout
from ..run.model import TreeModel, tree_loss
from ..run.model import compile as tree_compile
from ..tree import Tree

__all__ = ["TreeCollator", "TreeTrainer", "rows_to_tree"]

IGNORE_INDEX = -100
_MASK_KEYS = ("completion_mask", "assistant_masks")


def _ints(x, name: str, i: int) -> np.ndarray:
    a = np.asarray(x.tolist() if isinstance(x, torch.Tensor) else x)
    if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise TypeError(f"row {i}: {name} must be a 1-D sequence of integers, got "
                        f"shape {a.shape} ({a.dtype})")
    return a.astype(np.int64)


def _row(row, i: int) -> tuple[np.ndarray, np.ndarray]:
    """A row's tokens and the mask of the tokens it trains (HF's convention: token j is
    trained when ``labels[j] != -100``, predicted from the tokens before it)."""
    if not isinstance(row, Mapping) or "input_ids" not in row:
        raise TypeError(f"row {i}: expected a mapping with 'input_ids' (or a treefx.Tree under "
                        f"'tree'), got {type(row).__name__}"
                        + (f" with keys {sorted(row)}" if isinstance(row, Mapping) else ""))
    ids = _ints(row["input_ids"], "input_ids", i)
    keep = np.ones(len(ids), bool)
    if row.get("attention_mask") is not None:
        keep = _ints(row["attention_mask"], "attention_mask", i) != 0
        if len(keep) != len(ids):
            raise ValueError(f"row {i}: attention_mask has {len(keep)} entries, input_ids "
                             f"{len(ids)}")
    if row.get("labels") is not None:
        labels = _ints(row["labels"], "labels", i)
        if len(labels) != len(ids):
            raise ValueError(f"row {i}: labels has {len(labels)} entries, input_ids {len(ids)}")
        mask = labels != IGNORE_INDEX
        off = mask & (labels != ids)
        if off.any():
            j = int(np.flatnonzero(off)[0])
            raise ValueError(
                f"row {i}: labels[{j}] = {int(labels[j])} but input_ids[{j}] = {int(ids[j])}: "
                "a tree trains each token as the next token of its row, so labels must be "
                "input_ids (the model shifts them) or -100")
    else:
        key = next((k for k in _MASK_KEYS if row.get(k) is not None), None)
        mask = np.ones(len(ids), bool) if key is None else _ints(row[key], key, i) != 0
        if len(mask) != len(ids):
            raise ValueError(f"row {i}: {key} has {len(mask)} entries, input_ids {len(ids)}")
    ids, mask = ids[keep], mask[keep]
    if len(ids) == 0:
        raise ValueError(f"row {i} has no tokens")
    return ids, mask


def rows_to_tree(rows: Sequence) -> tuple[list[Tree], int]:
    """A micro-batch's rows as prefix trees, and their trained tokens as ``Trainer`` counts them.

    The trees (rows given as token ids merged into one tree) and the number of trained tokens
    as ``Trainer`` counts them over the rows (``labels[..., 1:] != -100``: a row's first token
    is never predicted). Rows that are
    :class:`treefx.Tree` (or hold one under ``"tree"``) are kept as they are, counted by their
    sequences' loss masks."""
    seqs, masks, trees, items = [], [], [], 0
    for i, row in enumerate(rows):
        tree = row if isinstance(row, Tree) else (
            row.get("tree") if isinstance(row, Mapping) else None)
        if isinstance(tree, Tree):
            trees.append(tree)
            for p in range(tree.num_sequences):
                items += int(np.asarray(tree.loss_mask(p))[1:].sum())
            continue
        ids, mask = _row(row, i)
        seqs.append(ids.tolist())
        masks.append(mask.astype(np.int64).tolist())
        items += int(mask[1:].sum())
    if seqs:
        trees.append(Tree.from_sequences(seqs, loss_masks=masks))
    if not trees:
        raise ValueError("an empty batch: no rows")
    return trees, items


class TreeCollator:
    """Collate a micro-batch's rows into ``{"tree_batch": TreeBatch, "num_items": int}``.

    The rows (see the module docstring) are merged into one prefix tree and packed with
    :func:`treefx.pack` (``reduction="sum"``, every loss weight the number of rows that train
    the token), so :func:`treefx.tree_loss` on the model's output is the sum of the rows' token
    losses; ``num_items`` is the rows' trained-token count. ``pack_kwargs`` go to
    :func:`treefx.pack` (``pad_to_multiple`` say)."""

    def __init__(self, **pack_kwargs):
        bad = set(pack_kwargs) & {"reduction", "num_sequences", "loss_scale"}
        if bad:
            raise ValueError(f"TreeCollator sets {sorted(bad)} itself (the loss is a sum over "
                             "rows, normalized by the trainer)")
        self.pack_kwargs = pack_kwargs

    def __call__(self, rows: Sequence) -> dict:
        trees, items = rows_to_tree(rows)
        p = sum(t.num_sequences for t in trees)
        batch = layout.pack(trees, reduction="sum", loss_scale=float(p), **self.pack_kwargs)
        return {"tree_batch": batch, "num_items": items}


class TreeTrainer(Trainer):
    """A ``transformers.Trainer`` that trains on prefix trees of the micro-batches' rows.

    Takes ``Trainer``'s arguments; ``data_collator`` defaults to :class:`TreeCollator`
    (a custom one must return what it returns), and ``tree_compile`` (a dict) goes to
    :func:`treefx.compile` (``backend=`` say). Columns the model's forward does not take are
    kept (``"tree"``, the masks). Loss, gradient accumulation and the count ``Trainer``
    normalizes by: see the module docstring."""

    def __init__(self, *args, tree_compile: dict | None = None, **kwargs):
        kwargs.setdefault("data_collator", TreeCollator())
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("TreeTrainer computes the loss on the tree; compute_loss_func "
                             "(which takes logits and labels in a row layout) is not "
                             "supported")
        super().__init__(*args, **kwargs)
        if self.args.label_smoothing_factor:
            raise ValueError("TreeTrainer: label_smoothing_factor is not supported (the "
                             "loss is computed from the tokens' log-probabilities)")
        # our compute_loss divides by num_items_in_batch itself, so Trainer must not
        # divide by the accumulation steps again
        self.model_accepts_loss_kwargs = True
        self._tree_compile = dict(tree_compile or {})
        self._tree_models: dict[int, TreeModel] = {}

    def _remove_unused_columns(self, dataset, description=None):
        return dataset  # the collator reads "tree" and the masks

    def _check_parallelism(self):
        if self.args.n_gpu > 1:
            raise ValueError("TreeTrainer does not support nn.DataParallel (n_gpu > 1): "
                             "launch one process per GPU (torchrun) for DDP or FSDP")
        for name in ("get_tp_size", "get_cp_size", "get_sp_size"):
            size = getattr(self, name, lambda: 1)()
            if size != 1:
                raise ValueError(f"TreeTrainer: {name[4:6]} parallelism (size {size}) is "
                                 "not supported")

    def _get_num_items_in_batch(self, batch_samples, device):
        self._check_parallelism()
        if not batch_samples or "num_items" not in batch_samples[0]:
            raise ValueError("TreeTrainer needs batches from TreeCollator (a dict with "
                             f"'tree_batch' and 'num_items'); got keys "
                             f"{sorted(batch_samples[0]) if batch_samples else []}")
        n = torch.tensor(sum(int(b["num_items"]) for b in batch_samples), device=device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            n = self.accelerator.gather(n).sum()
        return n

    def _tree_model(self, model) -> TreeModel:
        tm = self._tree_models.get(id(model))
        if tm is None:
            tm = self._tree_models[id(model)] = tree_compile(model, **self._tree_compile)
        return tm

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The micro-batch's loss on its tree: the rows' token losses summed, divided by the
        accumulated step's trained-token count (``num_items_in_batch``), as ``Trainer`` does
        for a causal LM; ``return_outputs`` adds the :class:`treefx.TreeOutput`."""
        if "tree_batch" not in inputs:
            raise ValueError("TreeTrainer needs batches from TreeCollator (a dict with "
                             f"'tree_batch'); got keys {sorted(inputs)}")
        batch = inputs["tree_batch"].to(self.args.device)
        out = self._tree_model(model)(batch)
        loss = tree_loss(out, batch)  # Σ over rows of their token losses
        if num_items_in_batch is None:  # a lone micro-batch (evaluation): its token mean
            num_items_in_batch = inputs["num_items"]
        elif self.args.average_tokens_across_devices and self.args.world_size > 1:
            loss = loss * self.accelerator.num_processes  # as Trainer.compute_loss does
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
        return (loss, out) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation: the micro-batch's token-mean loss, no logits or labels."""
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None
