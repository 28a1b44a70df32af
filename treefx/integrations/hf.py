"""Hugging Face's Trainer on prefix trees, with the loss it would compute on the rows.

A collator merges a micro-batch's rows into one prefix tree, and a trainer computes the loss on
it, normalized the way ``Trainer`` normalizes.

    from treefx.integrations.hf import TreeTrainer

    trainer = TreeTrainer(model=model, args=TrainingArguments(...), train_dataset=rows)
    trainer.train()

``rows``: a dataset whose rows hold ``input_ids`` (with ``labels`` -100 where a token is not
trained, or a ``completion_mask`` / ``assistant_masks``; without either every token is
trained), or a model call of :mod:`treefx.data` (a :class:`treefx.data.Call`, or its
``prompt_ids`` and ``completion_ids``, with its ``loss_mask`` or trained on the completion), or
a :class:`treefx.Tree` under ``"tree"`` (or its record :meth:`treefx.Tree.to_dict`, as a
mapping or JSON, as a ``datasets.Dataset`` holds it). The rows of one micro-batch that share a
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

**What it counts.** ``include_num_input_tokens_seen`` counts what ``Trainer`` counts on the
rows padded into a batch by its padding collators (the tree has no ``input_ids`` row to count):
``"all"`` (or True) the rows times the longest row of each micro-batch, ``"non_padding"`` the
tokens the rows attend to (:func:`input_tokens_seen`); equal to ``Trainer``'s on the same rows
(``tests/test_integration_hf.py``). A collator that pads further (``pad_to_multiple_of``) counts
more in ``Trainer``; ``TreeSFTTrainer`` rounds up as ``SFTConfig.pad_to_multiple_of`` says.

Not covered: label smoothing and ``compute_loss_func`` (refused: both need logits and labels
in a row layout); labels other than the input shifted by one (refused when found);
``nn.DataParallel`` (``n_gpu > 1``) and tensor / context / sequence parallelism (refused).
Evaluation reports the same loss (``prediction_step``), no logits.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from transformers import Trainer

from .. import layout
from ..data import Call
from ..run.model import TreeModel, tree_loss
from ..run.model import compile as tree_compile
from ..tree import Tree

__all__ = ["TreeCollator", "TreeTrainer", "TreeTrainerMixin", "input_tokens_seen",
           "rows_to_tree"]

IGNORE_INDEX = -100
_MASK_KEYS = ("completion_mask", "assistant_masks")


def _ints(x, name: str, i: int) -> np.ndarray:
    a = np.asarray(x.tolist() if isinstance(x, torch.Tensor) else x)
    if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise TypeError(f"row {i}: {name} must be a 1-D sequence of integers, got "
                        f"shape {a.shape} ({a.dtype})")
    return a.astype(np.int64)


def _call_row(row, i: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A model call (:class:`treefx.data.Call`, or a mapping with its ``prompt_ids`` and
    ``completion_ids`` and no ``input_ids``): its tokens and loss mask (the call's
    ``loss_mask``, or its completion); None for any other row."""
    if isinstance(row, Call):
        call = row
    elif (isinstance(row, Mapping) and "input_ids" not in row
          and "prompt_ids" in row and "completion_ids" in row):
        fields = {k: row[k] for k in ("prompt_ids", "completion_ids", "loss_mask")
                  if row.get(k) is not None}
        try:
            call = Call(**fields)
        except (TypeError, ValueError) as e:
            raise type(e)(f"row {i}: {e}") from None
    else:
        return None
    return np.asarray(call.ids, dtype=np.int64), np.asarray(call.mask(), dtype=bool)


def _row(row, i: int) -> tuple[np.ndarray, np.ndarray, int]:
    """A row's tokens, the mask of the tokens it trains (HF's convention: token j is
    trained when ``labels[j] != -100``, predicted from the tokens before it), and the length
    of its ``input_ids`` as given (with any columns its ``attention_mask`` drops)."""
    call = _call_row(row, i)
    if call is not None:
        return (*call, len(call[0]))
    if not isinstance(row, Mapping) or "input_ids" not in row:
        raise TypeError(f"row {i}: expected a mapping with 'input_ids' (or a model call's "
                        "'prompt_ids' and 'completion_ids', or a treefx.Tree under 'tree'), "
                        f"got {type(row).__name__}"
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
    given = len(ids)
    ids, mask = ids[keep], mask[keep]
    if len(ids) == 0:
        raise ValueError(f"row {i} has no tokens")
    return ids, mask, given


def _as_tree(value, i: int) -> Tree | None:
    """A row's ``"tree"``: a :class:`treefx.Tree`, or its record (:meth:`treefx.Tree.to_dict`,
    as a mapping or a JSON string: what a ``datasets.Dataset`` column holds, keys it lacks in
    a row as None); None when there is none."""
    if value is None or isinstance(value, Tree):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"row {i}: 'tree' is a string but not a JSON tree record: {e}") \
                from None
    if not isinstance(value, Mapping):
        raise TypeError(f"row {i}: 'tree' must be a treefx.Tree or its record "
                        f"(Tree.to_dict(), or that as JSON), got {type(value).__name__}")
    try:
        return Tree.from_dict({k: v for k, v in value.items() if v is not None})
    except (TypeError, ValueError) as e:
        raise type(e)(f"row {i}: 'tree': {e}") from None


def rows_to_tree(rows: Sequence) -> tuple[list[Tree], int]:
    """A micro-batch's rows as prefix trees, and their trained tokens as ``Trainer`` counts them.

    The trees (rows given as token ids merged into one tree) and the number of trained tokens
    as ``Trainer`` counts them over the rows (``labels[..., 1:] != -100``: a row's first token
    is never predicted). A row is ``input_ids`` (with ``labels``, or a mask), a model call
    (:class:`treefx.data.Call`, or its ``prompt_ids`` and ``completion_ids``, trained on its
    ``loss_mask`` or its completion), or a tree. Rows that are :class:`treefx.Tree` (or hold
    one under ``"tree"``, or its record :meth:`treefx.Tree.to_dict`, as a mapping or JSON) are
    kept as they are, counted by their sequences' loss masks."""
    trees, items, _ = _rows_to_tree(rows)
    return trees, items


def _rows_to_tree(rows: Sequence) -> tuple[list[Tree], int, list[tuple[int, int]]]:
    """:func:`rows_to_tree`, and per row (per sequence of a tree row) the length of its
    ``input_ids`` as given and the number of tokens it attends to (what ``Trainer`` counts
    for ``include_num_input_tokens_seen``)."""
    seqs, masks, trees, items, lengths = [], [], [], 0, []
    for i, row in enumerate(rows):
        tree = row if isinstance(row, Tree) else (
            _as_tree(row.get("tree"), i) if isinstance(row, Mapping) else None)
        if isinstance(tree, Tree):
            trees.append(tree)
            for p in range(tree.num_sequences):
                items += int(np.asarray(tree.loss_mask(p))[1:].sum())
                n = int(tree.sequence_lengths[p])
                lengths.append((n, n))
            continue
        ids, mask, given = _row(row, i)
        seqs.append(ids.tolist())
        masks.append(mask.astype(np.int64).tolist())
        items += int(mask[1:].sum())
        lengths.append((given, len(ids)))
    if seqs:
        trees.append(Tree.from_sequences(seqs, loss_masks=masks))
    if not trees:
        raise ValueError("an empty batch: no rows")
    return trees, items, lengths


class TreeCollator:
    """Collate a micro-batch's rows into ``{"tree_batch": TreeBatch, "num_items": int, ...}``.

    The rows (see the module docstring) are merged into one prefix tree and packed with
    :func:`treefx.pack` (``reduction="sum"``, every loss weight the number of rows that train
    the token), so :func:`treefx.tree_loss` on the model's output is the sum of the rows' token
    losses; ``num_items`` is the rows' trained-token count. ``"input_lengths"``: per row (per
    sequence of a tree row), the length of its ``input_ids`` as given and the tokens it
    attends to, from which the trainer counts ``include_num_input_tokens_seen`` as
    ``Trainer`` does on the rows padded into a batch. ``pack_kwargs`` go to
    :func:`treefx.pack` (``pad_to_multiple`` say)."""

    def __init__(self, **pack_kwargs):
        bad = set(pack_kwargs) & {"reduction", "num_sequences", "loss_scale"}
        if bad:
            raise ValueError(f"TreeCollator sets {sorted(bad)} itself (the loss is a sum over "
                             "rows, normalized by the trainer)")
        self.pack_kwargs = pack_kwargs

    def __call__(self, rows: Sequence) -> dict:
        trees, items, lengths = _rows_to_tree(rows)
        p = sum(t.num_sequences for t in trees)
        batch = layout.pack(trees, reduction="sum", loss_scale=float(p), **self.pack_kwargs)
        return {"tree_batch": batch, "num_items": items, "input_lengths": lengths}


def input_tokens_seen(lengths: Sequence[tuple[int, int]], mode: str,
                      pad_to_multiple_of: int | None = None) -> int:
    """The input tokens ``Trainer`` counts for ``include_num_input_tokens_seen``.

    On a micro-batch whose rows have these ``(given, attended)`` lengths (``"input_lengths"``
    of :class:`TreeCollator`), padded into a batch as its collators pad by default
    (``DataCollatorWithPadding``, ``DataCollatorForSeq2Seq``, TRL's SFT collator: to the
    longest row, or a multiple of ``pad_to_multiple_of``).

    ``"all"``: ``input_ids.numel()`` of the padded batch, the rows times the longest row
    (rounded up to ``pad_to_multiple_of``); ``"non_padding"``: ``attention_mask.sum()``, the
    tokens the rows attend to; ``"no"``: 0."""
    if mode == "no" or not lengths:
        return 0
    if mode == "non_padding":
        return sum(a for _, a in lengths)
    if mode != "all":
        raise ValueError(f"include_num_input_tokens_seen={mode!r}: expected 'all', "
                         "'non_padding' or 'no'")
    longest = max(g for g, _ in lengths)
    if pad_to_multiple_of:
        longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    return len(lengths) * longest


class TreeTrainerMixin:
    """What the tree trainers share, mixed in before a ``transformers.Trainer`` class.

    :class:`TreeTrainer` mixes it into ``Trainer``,
    :class:`treefx.integrations.trl_sft.TreeSFTTrainer` into TRL's ``SFTTrainer``. It holds
    the collator (:class:`TreeCollator` by default), the trained-token count the trainer
    normalizes by (``_get_num_items_in_batch``: the rows' own, summed over ranks with
    ``average_tokens_across_devices``), the model compiled once per model (``tree_compile``:
    arguments of :func:`treefx.compile`), the tree's run (:meth:`_run_tree`) and the
    normalization (:meth:`_normalize`), the refusals (``compute_loss_func``, label smoothing,
    ``nn.DataParallel``, tensor / context / sequence parallelism), and evaluation's
    ``prediction_step`` (the loss, no logits), and ``include_num_input_tokens_seen`` counted
    on the rows as ``Trainer`` counts it (``_track_num_input_tokens``, :func:`input_tokens_seen`).
    ``tree_stats`` counts the tokens the trees ran (``"tree_tokens"``) against the rows' own
    (``"sequence_tokens"``)."""

    _tree_trainer = "TreeTrainer"  # the name errors give

    def __init__(self, *args, tree_compile: dict | None = None, **kwargs):
        if kwargs.get("data_collator") is None:
            kwargs["data_collator"] = TreeCollator()
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError(f"{self._tree_trainer} computes the loss on the tree; "
                             "compute_loss_func (which takes logits and labels in a row "
                             "layout) is not supported")
        self._tree_compile = dict(tree_compile or {})
        self._tree_models: dict[int, TreeModel] = {}
        #: Token counts of every tree run so far: the trees' and the rows' own (no padding).
        self.tree_stats: dict[str, int] = {"tree_tokens": 0, "sequence_tokens": 0}
        super().__init__(*args, **kwargs)
        if self.args.label_smoothing_factor:
            raise ValueError(f"{self._tree_trainer}: label_smoothing_factor is not supported "
                             "(the loss is computed from the tokens' log-probabilities)")
        # our compute_loss divides by num_items_in_batch itself, so Trainer must not
        # divide by the accumulation steps again
        self.model_accepts_loss_kwargs = True

    def _remove_unused_columns(self, dataset, description=None):
        return dataset  # the collator reads "tree" and the masks

    def _check_parallelism(self):
        name = self._tree_trainer
        if self.args.n_gpu > 1:
            raise ValueError(f"{name} does not support nn.DataParallel (n_gpu > 1): "
                             "launch one process per GPU (torchrun) for DDP or FSDP")
        for fn in ("get_tp_size", "get_cp_size", "get_sp_size"):
            size = getattr(self, fn, lambda: 1)()
            if size != 1:
                raise ValueError(f"{name}: {fn[4:6]} parallelism (size {size}) is "
                                 "not supported")

    def _get_num_items_in_batch(self, batch_samples, device):
        self._check_parallelism()
        if not batch_samples or "num_items" not in batch_samples[0]:
            raise ValueError(f"{self._tree_trainer} needs batches from TreeCollator (a dict "
                             "with 'tree_batch' and 'num_items'); got keys "
                             f"{sorted(batch_samples[0]) if batch_samples else []}")
        n = torch.tensor(sum(int(b["num_items"]) for b in batch_samples), device=device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            n = self.accelerator.gather(n).sum()
        return n

    def _input_pad_to_multiple_of(self) -> int | None:
        """What the stock trainer's collator rounds a batch's length up to (None: none)."""
        return None

    def _track_num_input_tokens(self, inputs):
        """``state.num_input_tokens_seen`` as ``Trainer`` counts it on the rows padded into a
        batch (:func:`input_tokens_seen`), not on the tree (which has no ``input_ids`` row
        of its own: ``Trainer``'s count found none and stayed 0)."""
        mode = self.args.include_num_input_tokens_seen
        if mode == "no":
            return
        lengths = inputs.get("input_lengths") if isinstance(inputs, Mapping) else None
        if lengths is None:
            raise ValueError(f"{self._tree_trainer}: include_num_input_tokens_seen={mode!r} "
                             "counts the rows' tokens from the 'input_lengths' TreeCollator "
                             "returns; this batch has keys "
                             f"{sorted(inputs) if isinstance(inputs, Mapping) else type(inputs)}")
        n = input_tokens_seen(lengths, mode, self._input_pad_to_multiple_of())
        n = torch.as_tensor(n, device=self.args.device, dtype=torch.int64)
        self.state.num_input_tokens_seen += self.accelerator.gather(n).sum().item()

    def _tree_model(self, model) -> TreeModel:
        tm = self._tree_models.get(id(model))
        if tm is None:
            tm = self._tree_models[id(model)] = tree_compile(model, **self._tree_compile)
        return tm

    def _run_tree(self, model, inputs):
        """The micro-batch's :class:`treefx.TreeBatch` (on the device) and the compiled
        model's :class:`treefx.TreeOutput` on it."""
        if "tree_batch" not in inputs:
            raise ValueError(f"{self._tree_trainer} needs batches from TreeCollator (a dict "
                             f"with 'tree_batch'); got keys {sorted(inputs)}")
        batch = inputs["tree_batch"].to(self.args.device)
        out = self._tree_model(model)(batch)
        self.tree_stats["tree_tokens"] += batch.num_real_tokens
        self.tree_stats["sequence_tokens"] += batch.num_baseline_tokens
        return batch, out

    def _normalize(self, loss, inputs, num_items_in_batch, *, at_least_one: bool = False):
        """``loss`` (a sum over the micro-batch's rows) divided by the accumulated step's
        trained-token count, or the micro-batch's own without one (evaluation), times the
        process count where ``Trainer`` does that; ``at_least_one``: a count of 0 divides by
        1 (a batch without trained tokens has loss 0)."""
        if num_items_in_batch is None:  # a lone micro-batch (evaluation): its token mean
            num_items_in_batch = inputs["num_items"]
        elif self.args.average_tokens_across_devices and self.args.world_size > 1:
            loss = loss * self.accelerator.num_processes  # as Trainer.compute_loss does
        n = torch.as_tensor(num_items_in_batch, device=loss.device)
        return loss / (n.clamp(min=1) if at_least_one else n)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The micro-batch's loss on its tree: the rows' token losses summed, divided by the
        accumulated step's trained-token count (``num_items_in_batch``), as ``Trainer`` does
        for a causal LM; ``return_outputs`` adds the :class:`treefx.TreeOutput`."""
        batch, out = self._run_tree(model, inputs)
        loss = self._normalize(tree_loss(out, batch), inputs, num_items_in_batch)
        return (loss, out) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation: the micro-batch's token-mean loss, no logits or labels."""
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None


class TreeTrainer(TreeTrainerMixin, Trainer):
    """A ``transformers.Trainer`` that trains on prefix trees of the micro-batches' rows.

    Takes ``Trainer``'s arguments; ``data_collator`` defaults to :class:`TreeCollator`
    (a custom one must return what it returns), and ``tree_compile`` (a dict) goes to
    :func:`treefx.compile` (``backend=`` say). Columns the model's forward does not take are
    kept (``"tree"``, the masks). Loss, gradient accumulation and the count ``Trainer``
    normalizes by: see the module docstring. ``tree_stats``: the tokens the trees ran against
    the rows' own."""
