"""TRL's ``GRPOTrainer`` with every model call on prefix trees.

Every model call of TRL's GRPO (the old policy's log-probs, the reference model's, the current
policy's log-probs and entropies in the loss) goes through one method,
``GRPOTrainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask,
logits_to_keep, batch_size, compute_entropy, ...)``: rows of a left-padded prompt followed by a
right-padded completion, the log-prob of each of the last ``logits_to_keep`` columns given the
columns before it (0 at padding), in a ``(B, logits_to_keep)`` tensor. :class:`TreeGRPOTrainer`
overrides that method: the rows of a chunk become one :class:`treefx.Tree` (a trie: the G
completions of one prompt share the prompt's nodes, completions that share more, a multi-turn
rollout's earlier turns, share those too), the model compiled by :func:`treefx.compile` runs
once over its depth-first layout, and the log-probs and entropies are gathered back into TRL's
``(B, logits_to_keep)`` layout, differentiably. TRL's own loss, clipping, KL penalty,
importance sampling and normalisation run unchanged on them.

Micro-batches: the same training as ``GRPOTrainer``. TRL generates a *generation batch*
(``per_device_train_batch_size × steps_per_generation`` rows, the G rows of each prompt next to
each other), shuffles its rows (``shuffle_sequence_dict``, one ``torch.randperm``) and cuts it
into ``steps_per_generation`` micro-batches, one per ``training_step``; the old and reference
log-probs are computed before the shuffle, on the generation batch in chunks of
``per_device_train_batch_size`` rows. By default :class:`TreeGRPOTrainer` keeps all of that:
its micro-batches hold the rows stock TRL's hold, and each micro-batch's rows (each chunk's, for
the old and reference log-probs) become one tree of whatever prefixes they share; a group split
across micro-batches just shares less. So every option of ``GRPOConfig`` the tree path
supports trains what ``GRPOTrainer`` trains, to float32 rounding: every ``loss_type``,
``top_entropy_quantile``, the entropy bonus, ``steps_per_generation`` and ``num_iterations``, a
reference model (``tests/test_integration_trl.py``).

``keep_groups_together=True`` (opt-in) shuffles whole groups instead (blocks of
``num_generations`` rows, in the order their rows first appear in TRL's own ``randperm`` draw,
so the random stream after it is TRL's), so each micro-batch holds whole groups when
``per_device_train_batch_size`` is a multiple of ``num_generations``: more sharing per tree.
The micro-batches then hold other rows than TRL's, and from TRL 1.16's ``_compute_loss`` the
update is still the same only where it does not depend on which rows share a micro-batch:

- each optimizer step must take whole generation batches, i.e. ``gradient_accumulation_steps``
  a multiple of ``steps_per_generation`` (their default: equal). With ``steps_per_generation``
  greater, one generation batch's micro-batches go to different optimizer steps, taken at
  different parameters, and which rows land in which step is the shuffle's choice.
- within a step the loss summed over the micro-batches must not depend on their composition.
  It does not for ``grpo``, ``sapo``, ``luspo`` (a mean over each micro-batch's rows: every
  micro-batch has ``per_device_train_batch_size`` rows, so the step's sum is the mean over all
  its rows), ``dr_grpo`` (a constant ``B × max_completion_length``), ``dapo``, ``cispo`` and
  ``vespo`` (``num_items_in_batch``, the generation batch's token count), nor for the KL term,
  importance sampling (token or sequence), ``off_policy_mask_threshold``,
  ``mask_truncated_completions`` and the rewards and advantages (computed before the shuffle).
  It does for ``loss_type="bnpo"`` (divided by the micro-batch's own token count),
  ``top_entropy_quantile < 1`` (the entropy threshold is a quantile over the micro-batch's
  tokens), the entropy bonus (``entropy_coef != 0`` or ``use_adaptive_entropy``: a token mean
  per micro-batch) and the MoE auxiliary loss (a load-balancing loss over the micro-batch's
  tokens).

Those are refused with ``keep_groups_together=True`` (a ``ValueError`` naming the option);
otherwise the parameters after every optimizer step are stock TRL's (float32 rounding: the
gradient is summed in another order). What still differs is what TRL logs per micro-batch and
averages over them: ``kl``, ``entropy``, ``clip_ratio/*``, ``cispo_clip_ratio``,
``vespo/phi_seq_mean`` (means over other sets of rows); the loss logged per step, the rewards
and every statistic of the generation batch are the same.

Only TRL ``SUPPORTED_TRL_VERSIONS`` are accepted: the override depends on internals of
``GRPOTrainer`` that change between releases, and importing this module with another version
raises an ``ImportError`` naming the versions that work.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import torch

import treefx
from treefx.families.hf_hooks import checkpointing_restored, checkpointing_state
from treefx.integrations.vocab import logits_row_statistics
from treefx.run.model import twin

__all__ = ["SUPPORTED_TRL_VERSIONS", "TreeGRPOTrainer", "check_trl_version",
           "composition_dependent_options", "shuffle_groups", "tree_logps_and_entropies"]

log = logging.getLogger("treefx")

#: The TRL releases this integration is tested with (``pip install "treefx[trl]"`` pins them).
SUPPORTED_TRL_VERSIONS = ("1.16.0",)


def check_trl_version(version: str | None = None) -> str:
    """The installed TRL version (or ``version``), or an ``ImportError`` naming the versions
    this integration supports when it is not one of them."""
    if version is None:
        try:
            import trl
        except ImportError as e:
            raise ImportError(
                "treefx.integrations.trl needs TRL: pip install \"treefx[trl]\" "
                f"(trl=={SUPPORTED_TRL_VERSIONS[-1]})"
            ) from e
        version = trl.__version__
    if version not in SUPPORTED_TRL_VERSIONS:
        raise ImportError(
            f"treefx.integrations.trl supports trl {' or '.join(SUPPORTED_TRL_VERSIONS)}, the "
            f"versions it is tested with; trl {version} is installed. It overrides internals of "
            "GRPOTrainer (_get_per_token_logps_and_entropies, _prepare_inputs) and SFTTrainer "
            "(_prepare_dataset, _metrics) that change between releases: pip install "
            f"\"trl=={SUPPORTED_TRL_VERSIONS[-1]}\""
        )
    return version


check_trl_version()

import trl  # noqa: E402
from trl.trainer.utils import (  # noqa: E402
    split_pixel_values_by_grid,
    split_tensor_dict,
    unsplit_pixel_values_by_grid,
)

# Arguments of _get_per_token_logps_and_entropies the tree path does not take (images, token
# types): a text-only integration.
_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
               "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids",
               "mm_token_type_ids", "image_position_ids")


def _rows(input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """Each row's first attended column and its attended length; an error unless each row's
    attended columns are contiguous (a left-padded prompt then a right-padded completion)."""
    am = attention_mask.bool()
    lengths = am.sum(1)
    cols = torch.arange(am.shape[1], device=am.device).expand_as(am)
    first = torch.where(am, cols, am.shape[1]).amin(1)
    last = torch.where(am, cols, -1).amax(1)
    holes = (lengths > 0) & (last - first + 1 != lengths)
    if bool(holes.any()):
        b = int(holes.nonzero()[0, 0])
        raise ValueError(
            f"row {b} of the batch attends to columns that are not contiguous: the tree path "
            "needs each row's tokens in one run (a left-padded prompt followed by a "
            "right-padded completion, as GRPOTrainer lays them out)"
        )
    return first.tolist(), lengths.tolist()


def tree_logps_and_entropies(tree_model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             logits_to_keep: int, *, temperature: float = 1.0,
                             compute_entropy: bool = False, stats: dict | None = None):
    """TRL's per-token log-probs (and entropies) of the last ``logits_to_keep`` columns of
    ``input_ids`` [B, L], from one run of ``tree_model`` (:func:`treefx.compile`) over the
    prefix tree of the rows.

    Row b's sequence is its attended tokens (``attention_mask`` 1). Entry ``[b, j]`` of the
    result is log softmax(logits / temperature) of the token in column ``L - logits_to_keep + j``
    given the sequence before it, and the entropy of that distribution: as
    ``GRPOTrainer._get_per_token_logps_and_entropies`` computes them, 0 at padding and at a
    sequence's first token. Returns ``(logps, entropies)``, ``entropies`` None unless
    ``compute_entropy``; both carry gradients to the model's parameters when the call does.
    ``stats``: a dict to add the token counts to: ``"tree_tokens"`` (the tree's, run once) and
    ``"sequence_tokens"`` (the rows' own, without padding, what running them alone costs).
    """
    B, L = input_ids.shape
    C = int(logits_to_keep)
    device = input_ids.device
    first, lengths = _rows(input_ids, attention_mask)
    rows = [b for b in range(B) if lengths[b] > 0]
    ids = input_ids.tolist()
    seqs = [ids[b][first[b]:first[b] + lengths[b]] for b in rows]
    tree = treefx.Tree.from_sequences(seqs)
    batch = treefx.pack(tree).to(device)
    out = tree_model(batch)
    if stats is not None:
        stats["tree_tokens"] = stats.get("tree_tokens", 0) + tree.num_tokens
        stats["sequence_tokens"] = stats.get("sequence_tokens", 0) + sum(lengths)

    # For each kept column holding a token with a predecessor: its DFS row and its parent's.
    bi, ji, tok_row, prev_row, tokens = [], [], [], [], []
    for p, b in enumerate(rows):
        index = batch.sequence_index(p).tolist()
        start = max(L - C, first[b] + 1)  # a sequence's first token has no log-prob
        for t in range(start, first[b] + lengths[b]):
            k = t - first[b]
            bi.append(b)
            ji.append(t - (L - C))
            tok_row.append(index[k])
            prev_row.append(index[k - 1])
            tokens.append(ids[b][t])
    as_index = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    bi, ji = as_index(bi), as_index(ji)
    entropies = None
    if temperature == 1.0 and not compute_entropy:
        values = out.token_logprobs[as_index(tok_row)]
    else:
        if out.logits is None:
            raise ValueError("temperature != 1 and entropies need the logits: compile the model "
                             "with logits=True (treefx.compile's default)")
        unique, inverse = torch.unique(as_index(prev_row), return_inverse=True)
        lse, ent, _ = logits_row_statistics(out.logits[0], unique, temperature,
                                           entropy=compute_entropy)
        values = out.logits[0, as_index(prev_row), as_index(tokens)].float() / temperature \
            - lse[inverse]
        if compute_entropy:
            ent = ent[inverse]
            entropies = ent.new_zeros(B, C).index_put((bi, ji), ent)
    logps = values.new_zeros(B, C).index_put((bi, ji), values)
    return logps, entropies


def shuffle_groups(batch: dict, group_size: int) -> dict:
    """TRL's ``shuffle_sequence_dict`` at the granularity of groups: permute the blocks of
    ``group_size`` consecutive rows (one prompt's completions, as GRPOTrainer generates them),
    keeping each block's rows together and in order.

    The permutation is drawn as TRL draws its row permutation (one ``torch.randperm`` over the
    rows, so the global random stream after it, which TRL's sampling reads, is the one stock
    TRL leaves), and the blocks are ordered by where their first row falls in it (a uniformly
    random order of the blocks). Falls back to that very row permutation, TRL's shuffle, with
    a warning, when the rows do not come in such blocks."""
    n = len(next(v for v in batch.values() if v is not None))
    rows = torch.randperm(n)  # the draw shuffle_sequence_dict makes
    reason = None
    if n % group_size:
        reason = f"{n} rows are not a whole number of groups of {group_size}"
    else:
        pid, pm = batch.get("prompt_ids"), batch.get("prompt_mask")
        if pid is not None and pm is not None:
            blocks = (pid * pm).view(n // group_size, group_size, -1)
            if not bool((blocks == blocks[:, :1]).all()):
                reason = f"the blocks of {group_size} rows do not each share one prompt"
    if reason is not None:
        warnings.warn(f"treefx.integrations.trl: {reason}; shuffling rows as TRL does, so a "
                      "group's rows may run in different micro-batches (exact, less shared)",
                      stacklevel=2)
        perm = rows
    else:
        order = torch.tensor(list(dict.fromkeys((rows // group_size).tolist())))
        perm = (order[:, None] * group_size + torch.arange(group_size)).reshape(-1)

    def permute(v):
        if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0):
            return v
        if isinstance(v, torch.Tensor):
            return v[perm.to(v.device)]
        return [v[i] for i in perm.tolist()]

    return {k: permute(v) for k, v in batch.items()}


def composition_dependent_options(args, *, aux_loss: bool = False) -> list[str]:
    """The options of a ``GRPOConfig`` under which TRL 1.16's update depends on which rows of
    a generation batch share a micro-batch (see the module docstring), each as
    ``"name=value: why"``; empty when any shuffle of the generation batch's rows trains the
    same parameters. ``aux_loss``: the trainer adds the MoE load-balancing loss."""
    found = []
    spg, gas = args.steps_per_generation, args.gradient_accumulation_steps
    if gas % spg:
        found.append(
            f"steps_per_generation={spg} with gradient_accumulation_steps={gas}: an optimizer "
            "step takes part of a generation batch, so which rows it takes is the shuffle's "
            "choice (gradient_accumulation_steps must be a multiple of steps_per_generation)")
    if args.loss_type == "bnpo":
        found.append("loss_type='bnpo': each micro-batch's loss is divided by its own token "
                     "count")
    if args.top_entropy_quantile < 1.0:
        found.append(f"top_entropy_quantile={args.top_entropy_quantile}: the entropy "
                     "threshold is a quantile over the micro-batch's tokens")
    if args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        name = ("use_adaptive_entropy=True" if args.use_adaptive_entropy
                else f"entropy_coef={args.entropy_coef}")
        found.append(f"{name}: the entropy bonus is a token mean per micro-batch")
    if aux_loss:
        found.append("router_aux_loss_coef != 0: the MoE load-balancing loss is computed over "
                     "the micro-batch's tokens")
    return found


_UNSET = object()


def _registered(handle) -> bool:
    hooks = handle.hooks_dict_ref()
    return hooks is not None and handle.id in hooks


@contextlib.contextmanager
def _keep_input_grad_hooks(model: torch.nn.Module):
    """Undo the forward hooks that transformers' ``gradient_checkpointing_enable`` adds to the
    input embeddings inside this block, when the ones from before are still there.

    TRL computes the old and reference log-probs inside ``disable_gradient_checkpointing``,
    which turns checkpointing off and on again; each ``gradient_checkpointing_enable`` calls
    ``enable_input_require_grads``, which registers one more ``make_inputs_require_grads``
    hook on the embeddings, and ``gradient_checkpointing_disable`` removes it only for PEFT
    models. So a plain model gains a hook per generation batch. Harmless in eager mode; but a
    tree-compiled model's graph is guarded on the embeddings' hooks, so every generation batch
    would recompile it and, past Dynamo's recompile limit, stop (``TreeCompileError``). The
    added hooks duplicate the one kept, so removing them changes no value or gradient. Where
    the earlier hooks were removed in the block (PEFT), nothing is undone."""
    owners = [m for m in model.modules() if hasattr(m, "enable_input_require_grads")]
    saved = [(m, m.__dict__.get("_require_grads_hooks", _UNSET),
              m.__dict__.get("_require_grads_hook", _UNSET)) for m in owners]
    try:
        yield
    finally:
        for m, hooks, hook in saved:
            now = m.__dict__.get("_require_grads_hooks", _UNSET)
            if now is hooks or not isinstance(hooks, list) or not isinstance(now, list):
                continue
            if not all(_registered(h) for h in hooks):
                continue
            for h in now:
                if all(h is not k for k in hooks):
                    h.remove()
            m._require_grads_hooks = hooks
            if hook is _UNSET:
                m.__dict__.pop("_require_grads_hook", None)
            else:
                m._require_grads_hook = hook


class TreeGRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` whose model calls run on prefix trees (see the module's docstring).

    Takes GRPOTrainer's arguments, and:

    ``keep_groups_together``: False (the default) keeps TRL's row shuffle, so the
    micro-batches hold the rows stock ``GRPOTrainer``'s hold (each one tree of the prefixes its
    rows share) and every option trains what ``GRPOTrainer`` trains. True shuffles the
    generation batch group by group, so that each micro-batch holds whole groups (more
    sharing); it trains the same parameters only where the update does not depend on which
    rows share a micro-batch, and the options under which it does (``loss_type="bnpo"``,
    ``top_entropy_quantile < 1``, the entropy bonus, the MoE auxiliary loss,
    ``gradient_accumulation_steps`` not a multiple of ``steps_per_generation``) are refused with
    a ``ValueError`` naming the option (:func:`composition_dependent_options`; see the module
    docstring). ``trees``: False runs TRL's own log-prob path (with the same shuffling): the
    baseline to compare with. ``compile_options``: keyword arguments for
    :func:`treefx.compile` (``backend``, ``verify``, ...).

    Text-only models; each model (policy, reference) is compiled once, on its first call. Not
    supported (an error says so): images and token types, the MoE auxiliary loss
    (``compute_aux_loss``), and a PEFT policy with ``beta != 0`` (TRL takes the reference by
    switching the adapters off around the call).
    """

    def __init__(self, *args, keep_groups_together: bool = False, trees: bool = True,
                 compile_options: dict | None = None, **kwargs):
        self.keep_groups_together = keep_groups_together
        self.trees = trees
        self.compile_options = dict(compile_options or {})
        self._tree_models: dict[int, tuple[torch.nn.Module, object]] = {}
        # the policy's activation checkpointing as training runs it, while TRL turns it off
        # around its no-grad calls (see _get_per_token_logps_and_entropies)
        self._policy_checkpointing: list | None = None
        #: Token counts of every tree call so far: the trees' and the rows' own (no padding).
        self.tree_stats: dict[str, int] = {"tree_tokens": 0, "sequence_tokens": 0}
        super().__init__(*args, **kwargs)
        if trees and self.beta != 0.0 and self.ref_model is None:
            raise ValueError(
                "TreeGRPOTrainer: a PEFT policy with beta != 0 takes its reference log-probs by "
                "switching the adapters off around the model call, which a tree-compiled model "
                "does not see; use beta=0 or a separate reference model"
            )
        if keep_groups_together:
            found = composition_dependent_options(self.args, aux_loss=self.aux_loss_enabled)
            if found:
                raise ValueError(
                    f"TreeGRPOTrainer(keep_groups_together=True) does not train what "
                    f"GRPOTrainer trains with {found[0]}; keep_groups_together=False (the "
                    "default) keeps TRL's micro-batches")
            g, per_device = self.num_generations, self.args.per_device_train_batch_size
            if per_device % g:
                warnings.warn(
                    f"TreeGRPOTrainer: per_device_train_batch_size={per_device} is not a "
                    f"multiple of num_generations={g}, so some groups are cut between "
                    "micro-batches: each part is its own tree (exact, the prefix shared across "
                    "the cut is computed twice)",
                    stacklevel=2,
                )

    def tree_model(self, model):
        """The :func:`treefx.compile` of ``model``, compiled on first use.

        A model of the same architecture as one compiled before (the reference model beside
        the policy: same class, config, parameter names, shapes and dtypes) runs that one's
        graph without gradients (the policy's training graph, which its old log-probs run too)
        instead of capturing and compiling its own, where its first-call check
        (on by default) finds the graph exact for it (:func:`treefx.run.model.twin`)."""
        entry = self._tree_models.get(id(model))
        if entry is None or entry[0] is not model:
            tm = None
            for other, other_tm in list(self._tree_models.values()):
                if other is not model:
                    tm = twin(other_tm, model)
                    if tm is not None:
                        break
            entry = (model, tm or treefx.compile(model, **self.compile_options))
            self._tree_models[id(model)] = entry
            log.info("treefx.integrations.trl: compiled %s for trees%s", type(model).__name__,
                     " (running a twin's graph without gradients)" if tm is not None else "")
        return entry[1]

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask,
                                           logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False,
                                           **multimodal):
        if not self.trees:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
        given = sorted(k for k, v in multimodal.items() if v is not None)
        unknown = sorted(set(multimodal) - set(_MULTIMODAL))
        if given or unknown:
            raise ValueError(f"TreeGRPOTrainer runs text-only models on trees; got {given + unknown}")
        if compute_aux_loss:
            raise NotImplementedError("TreeGRPOTrainer: the MoE load-balancing loss "
                                      "(compute_aux_loss) is not computed on trees")
        tree_model = self.tree_model(model)
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        # TRL runs the policy's no-grad calls with checkpointing off (an eager-mode warning);
        # the tree call runs with it as training has it, so that the graph captured for
        # training serves the no-grad call too (one capture, TreeEngine.captures_training).
        # Without gradients checkpointing changes no value.
        policy = self.accelerator.unwrap_model(model) is \
            self.accelerator.unwrap_model(self.model)
        restore = policy and self._policy_checkpointing and not torch.is_grad_enabled()
        for start in range(0, input_ids.size(0), batch_size):
            end = min(start + batch_size, input_ids.size(0))
            with self.accelerator.autocast(), \
                    checkpointing_restored(self._policy_checkpointing) if restore \
                    else contextlib.nullcontext():
                lp, ent = tree_logps_and_entropies(
                    tree_model, input_ids[start:end], attention_mask[start:end], logits_to_keep,
                    temperature=self.temperature, compute_entropy=compute_entropy,
                    stats=self.tree_stats)
            logps.append(lp)
            entropies.append(ent)
        return (torch.cat(logps, 0), torch.cat(entropies, 0) if compute_entropy else None, None)

    def _generate_and_score_completions(self, inputs):
        if not self.trees:
            return super()._generate_and_score_completions(inputs)
        policy = self.accelerator.unwrap_model(self.model)
        self._policy_checkpointing = checkpointing_state(policy)
        try:
            with _keep_input_grad_hooks(policy):
                return super()._generate_and_score_completions(inputs)
        finally:
            self._policy_checkpointing = None

    def _prepare_inputs(self, generation_batch):
        # GRPOTrainer._prepare_inputs (TRL 1.16) with the row shuffle made a group shuffle.
        if not (self.keep_groups_together and self.model.training):
            return super()._prepare_inputs(generation_batch)
        spg = self.args.steps_per_generation
        generate_every = spg * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            batch = split_pixel_values_by_grid(batch)
            batch = shuffle_groups(batch, self.num_generations)
            self._buffered_inputs = [unsplit_pixel_values_by_grid(b)
                                     for b in split_tensor_dict(batch, spg)]
        return self._buffered_inputs[self._step % spg]
