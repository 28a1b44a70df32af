"""TRL's ``SFTTrainer`` on prefix trees, with the loss and the metrics it computes on the rows.

    from treefx.integrations.trl_sft import TreeSFTTrainer

    trainer = TreeSFTTrainer(model=model, args=SFTConfig(...), train_dataset=dataset)
    trainer.train()

``dataset``: what ``SFTTrainer`` takes (conversations, prompt-completion pairs, text, or
pre-tokenized ``input_ids`` with ``labels`` or ``completion_mask`` / ``assistant_masks``), which
TRL prepares as it does for ``SFTTrainer`` (chat template, ``completion_only_loss``,
``assistant_only_loss``, truncation to ``max_length``) into ``input_ids`` and ``labels``; or
rows already in treefx's terms, which TRL's preparation leaves alone: model calls of
:mod:`treefx.data` (``prompt_ids`` and ``completion_ids``, with a ``loss_mask`` or trained on
the completion) or trees (``"tree"``: a :meth:`treefx.Tree.to_dict` record, as a mapping or a
JSON string). Each micro-batch's rows are merged into one prefix tree
(:class:`treefx.integrations.hf.TreeCollator`) and the model, compiled by
:func:`treefx.compile`, runs once over it.

**The loss is TRL's.** ``SFTTrainer`` sums the per-token losses of the trained tokens
(``labels != -100`` after the shift) of every micro-batch of an optimizer step and divides by
``num_items_in_batch``, their count over the step (over the ranks with
``average_tokens_across_devices``; at least 1). A tree token trained by k rows counts k times
in that sum (its loss weight, :func:`treefx.pack` with ``reduction="sum"``) and k times in the
count (counted on the rows, as in :class:`treefx.integrations.hf.TreeTrainer`). ``loss_type``
``"nll"`` (the negative log-likelihood) and ``"dft"`` (each token's loss times its detached
probability) are both per-token, so both are exact on the tree.

**The metrics are TRL's.** ``entropy`` and ``mean_token_accuracy`` of a micro-batch are, in
``SFTTrainer``, sums over its trained tokens (the entropy of the predicted distribution; whether
the label is its argmax) divided by their count, gathered over the processes, averaged over the
micro-batches since the last log. On the tree each trained token's value is weighted by its
loss weight (the rows that train it) and divided by the same count, from the logits at its tree
predecessor: the same numbers. ``num_tokens`` counts the rows' tokens as TRL does (what the rows
hold, not what the tree ran); ``num_tree_tokens`` beside it, the tokens the trees ran. The
metrics need the ``[1, N, vocab]`` logits the compiled model returns by default (TRL's fused LM
head never builds them): ``tree_compile={"logits": False}`` saves that memory and turns them
off.

Refused (an error names the option): ``packing`` and ``eval_packing`` (a tree merges the rows
itself), ``padding_free`` (a tree has no padding), ``use_liger_kernel``, label smoothing and
``compute_loss_func`` (they need logits and labels in a row layout), the MoE load-balancing loss
(``router_aux_loss_coef`` != 0 on a model that returns router logits), datasets of images,
``nn.DataParallel`` and tensor / context / sequence parallelism; a row given as a call or a tree
that is longer than ``max_length`` (TRL truncates the rows it prepares; treefx does not cut
trees). Evaluation reports the loss and the metrics, no logits. TRL ``SUPPORTED_TRL_VERSIONS``
only (``treefx.integrations.trl``), as the override depends on ``SFTTrainer`` internals
(``_prepare_dataset``, ``_metrics``, ``_total_train_tokens``).
"""

from __future__ import annotations

import logging

import torch

from ..ops.cross_entropy.reference import weighted_logprob_loss
from .hf import TreeTrainerMixin
from .trl import check_trl_version

check_trl_version()

import trl  # noqa: E402
from trl.data_utils import get_dataset_column_names  # noqa: E402

__all__ = ["TreeSFTTrainer", "tree_token_metrics"]

log = logging.getLogger("treefx")

_CALL_COLUMNS = {"prompt_ids", "completion_ids"}


@torch.no_grad()
def tree_token_metrics(out, batch, *, chunk_elements: int = 1 << 26
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``SFTTrainer``'s per-token metrics summed over a tree's trained tokens, each token
    weighted by its loss weight (the rows that train it, with ``reduction="sum"`` and
    ``loss_scale`` = the sequence count, as :class:`treefx.integrations.hf.TreeCollator`
    packs): ``(entropy_sum, correct, count)``, float64 scalars. Entropy: of the softmax of
    the logits at the token's tree predecessor; correct: the token is that distribution's
    argmax (the first index among equal maxima, as TRL's fused head decides). In float32, a
    bounded number of logit rows at a time (``chunk_elements`` entries)."""
    if out.logits is None:
        raise ValueError("the metrics need the logits: compile the model with logits=True "
                         "(treefx.compile's default)")
    device = out.logits.device
    w = batch.loss_weights.to(device)
    idx = torch.nonzero(w).squeeze(1)
    unique, inverse = torch.unique(batch.parent_token.to(device)[idx], return_inverse=True)
    entropy = torch.empty(len(unique), dtype=torch.float32, device=device)
    top = torch.empty(len(unique), dtype=torch.long, device=device)
    step = max(1, chunk_elements // out.logits.shape[-1])
    for s in range(0, len(unique), step):
        logits = out.logits[0, unique[s:s + step]].float()
        logp = torch.log_softmax(logits, dim=-1)
        entropy[s:s + step] = -(logp.exp() * logp).sum(-1)
        top[s:s + step] = logits.argmax(-1)
    correct = top[inverse] == batch.input_ids[0].to(device)[idx]
    wt = w[idx].double()
    return (wt * entropy[inverse].double()).sum(), (wt * correct.double()).sum(), wt.sum()


class TreeSFTTrainer(TreeTrainerMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` that trains on prefix trees of the micro-batches' rows.

    Takes ``SFTTrainer``'s arguments, and ``tree_compile`` (a dict of :func:`treefx.compile`'s
    arguments: ``backend``, ``verify``, ...). ``data_collator`` defaults to
    :class:`treefx.integrations.hf.TreeCollator`. Loss, metrics, what is refused: see the module
    docstring. ``tree_stats``: the tokens the trees ran against the rows' own."""

    _tree_trainer = "TreeSFTTrainer"

    def __init__(self, *args, tree_compile: dict | None = None, **kwargs):
        config = kwargs.get("args", args[1] if len(args) > 1 else None)
        if config is not None:
            self._refuse(config)
        self._metrics_warned = False
        super().__init__(*args, tree_compile=tree_compile, **kwargs)
        self._refuse(self.args)
        if self._is_vision_dataset:
            raise ValueError("TreeSFTTrainer trains text-only rows; this dataset has images")
        if self.aux_loss_enabled:
            raise ValueError(
                f"TreeSFTTrainer: router_aux_loss_coef={self.router_aux_loss_coef}: the MoE "
                "load-balancing loss is a mean over the rows' tokens, which a tree holds once "
                "each; set router_aux_loss_coef=0.0")
        self._total_tree_tokens = 0

    @staticmethod
    def _refuse(args) -> None:
        """An error naming the first option of ``args`` a tree cannot honour."""
        why = {
            "packing": "a tree merges the micro-batch's rows itself; set packing=False",
            "eval_packing": "a tree merges the micro-batch's rows itself; set "
                            "eval_packing=False",
            "padding_free": "a tree is already one row without padding; set "
                            "padding_free=False",
            "use_liger_kernel": "Liger's kernels replace the model's layers, which treefx "
                                "has not been checked with; set use_liger_kernel=False",
        }
        for name, reason in why.items():
            if getattr(args, name, False):
                raise ValueError(f"TreeSFTTrainer: {name}=True is not supported: {reason}")
        loss_type = getattr(args, "loss_type", "nll")
        if loss_type not in ("nll", "dft"):
            raise ValueError(f"TreeSFTTrainer: loss_type={loss_type!r} is not supported "
                             "(nll and dft are)")

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func,
                         dataset_name):
        columns = set(get_dataset_column_names(dataset) or ())
        if "input_ids" in columns or not ("tree" in columns or _CALL_COLUMNS <= columns):
            return super()._prepare_dataset(dataset, processing_class, args, packing,
                                            formatting_func, dataset_name)
        # Model calls and trees: treefx's own rows, which the collator reads as they are.
        if formatting_func is not None:
            raise ValueError(f"TreeSFTTrainer: the {dataset_name} dataset holds model calls or "
                             "trees, which a formatting_func cannot apply to")
        if args.shuffle_dataset:
            dataset = dataset.shuffle(seed=args.seed)
        return dataset

    def _input_pad_to_multiple_of(self) -> int | None:
        return self.args.pad_to_multiple_of  # what SFTTrainer's collator pads to

    def _check_lengths(self, batch) -> None:
        limit = self.args.max_length
        if limit is None:
            return
        longest = max(int(t.sequence_lengths.max()) for t in batch.trees)
        if longest > limit:
            raise ValueError(
                f"TreeSFTTrainer: a sequence of {longest} tokens is longer than "
                f"max_length={limit}. TRL truncates the rows it prepares; rows given as model "
                "calls or trees are not cut: set max_length=None or shorten them")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The micro-batch's loss on its tree, normalized as ``SFTTrainer`` normalizes
        (``loss_type`` nll or dft), and its metrics (entropy, mean token accuracy, token
        counts) recorded as ``SFTTrainer`` records them."""
        mode = "train" if self.model.training else "eval"
        if "tree_batch" in inputs:
            self._check_lengths(inputs["tree_batch"])
        batch, out = self._run_tree(model, inputs)
        logps = out.token_logprobs
        if self.args.loss_type == "dft":  # DFT: each token's loss times its probability
            logps = logps * logps.detach().exp()
        loss = weighted_logprob_loss(logps, batch.loss_weights)
        loss = self._normalize(loss, inputs, num_items_in_batch, at_least_one=True)
        self._record_metrics(mode, out, batch)
        return (loss, out) if return_outputs else loss

    def _record_metrics(self, mode: str, out, batch) -> None:
        gather = self.accelerator.gather_for_metrics
        device = out.token_logprobs.device
        metrics = self._metrics[mode]
        if out.logits is not None:
            entropy, correct, count = (x.float() for x in tree_token_metrics(out, batch))
            count = gather(count).sum()
            entropy, correct = gather(entropy).sum(), gather(correct).sum()
            metrics["entropy"].append((entropy / count).item() if count > 0 else 0.0)
            metrics["mean_token_accuracy"].append(
                (correct / count).item() if count > 0 else 0.0)
        elif not self._metrics_warned:
            self._metrics_warned = True
            log.warning("TreeSFTTrainer: the model is compiled with logits=False, so entropy "
                        "and mean_token_accuracy are not logged")
        if mode == "train":
            counts = torch.tensor([batch.num_baseline_tokens, batch.num_real_tokens],
                                  device=device)
            rows, tree = (int(x) for x in gather(counts[None]).sum(0))
            self._total_train_tokens += rows
            self._total_tree_tokens += tree
        metrics["num_tokens"] = [self._total_train_tokens]
        metrics["num_tree_tokens"] = [self._total_tree_tokens]
