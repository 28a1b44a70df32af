"""The functions a part captures: the model on a part's tokens in *part mode* (its queries
attend over its context's keys and values and its own), handing out its own columns and exit
states for the parts after it (:func:`treefx.compiler.lower.parts.part_outputs`)."""

from __future__ import annotations

import torch

from ...compiler.lower.parts import part_outputs
from ...ops.logprobs import register_site, token_logprobs_site, token_loss_site
from ..model import model_logits
from ..step import step_batch

__all__ = ["part_forward", "part_step_function", "register"]

_REGISTERED = False


def register() -> None:
    """The part graph's custom pieces made known to Dynamo, once per process."""
    global _REGISTERED
    if not _REGISTERED:
        register_site()
        torch._dynamo.allow_in_graph(part_outputs)
        _REGISTERED = True


def _check_part_shapes(input_ids, tree_info, part_info, ctx_tok, state_entry, labels,
                       weights=None) -> None:
    """The sizes a part graph's inputs share (told to Dynamo: the token count, the context's,
    the labels')."""
    torch._check(tree_info.shape[1] == input_ids.shape[1])
    torch._check(state_entry.shape[0] == input_ids.shape[1])
    torch._check(ctx_tok.shape[0] == part_info.shape[1])
    if weights is not None:
        torch._check(weights.shape[1] == labels.shape[1])


def part_forward(opts: dict, loss: bool = False):
    """The function a compiled model's part captures: the model on the part's tokens, their
    log-probabilities at their predecessors, and the part's own columns and exit states (the
    marker the passes replace, :func:`treefx.compiler.lower.parts.part_outputs`). ``loss``:
    the part's tree loss made in the graph from its tokens' weights (``loss_weights`` [1, m],
    an input after ``labels``; not named ``tree_weights``, which marks a step's graph),
    returned first, the log-probabilities last and detached
    (:func:`treefx.ops.logprobs.token_loss_site`: the output projection's gradients made in
    the forward, one product fewer than differentiating the log-probabilities)."""
    if loss:
        def tree_part_loss(model, input_ids, tree_info, part_info, ctx_tok, ctx_state,
                           state_entry, state_exit, labels, loss_weights, emb_sink, grads):
            _check_part_shapes(input_ids, tree_info, part_info, ctx_tok, state_entry, labels,
                               loss_weights)
            logits = model_logits(model, opts, input_ids, tree_info)
            total, lp = token_loss_site(logits, labels[1], labels[0], loss_weights[0])
            own, exits = part_outputs(input_ids, ctx_tok, ctx_state, state_exit, part_info,
                                      state_entry, tree_info, emb_sink, grads)
            return total, own, exits, lp

        return tree_part_loss

    def tree_part(model, input_ids, tree_info, part_info, ctx_tok, ctx_state, state_entry,
                  state_exit, labels, emb_sink, grads):
        _check_part_shapes(input_ids, tree_info, part_info, ctx_tok, state_entry, labels)
        logits = model_logits(model, opts, input_ids, tree_info)
        lp = token_logprobs_site(logits, labels[1], labels[0])
        own, exits = part_outputs(input_ids, ctx_tok, ctx_state, state_exit, part_info,
                                  state_entry, tree_info, emb_sink, grads)
        return lp, own, exits

    return tree_part


def part_step_function(user_fn):
    """The function a ``@treefx.step``'s part captures. The loss pass reads the part's
    predicted tokens from ``labels`` and their weights from ``tree_weights`` [2, m] ("sum",
    "mean"); the labels the step sees only mark the tokens with a predecessor (the pass
    checks the cross-entropy's shape, not their values)."""
    def tree_part_step(model, input_ids, tree_info, part_info, ctx_tok, ctx_state,
                       state_entry, state_exit, labels, tree_weights, emb_sink, grads):
        _check_part_shapes(input_ids, tree_info, part_info, ctx_tok, state_entry, labels,
                           tree_weights)
        result = user_fn(model, step_batch(input_ids, tree_info, tree_info[1] >= 0))
        own, exits = part_outputs(input_ids, ctx_tok, ctx_state, state_exit, part_info,
                                  state_entry, tree_info, emb_sink, grads)
        # Small views of the label inputs keep them graph inputs whatever the step reads.
        return result, own, exits, labels[:, :1], tree_weights[:, :1]

    return tree_part_step
