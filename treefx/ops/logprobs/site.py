"""Where a compiled model asked for log-probabilities only (``logits=False``): one node in the
captured graph (:func:`token_logprobs_site`), which the logprobs pass replaces by the fused op
(:mod:`.fast`) or the plain one on the logits."""

from __future__ import annotations

import torch

from ..cross_entropy.reference import tree_cross_entropy_and_logprobs, tree_token_logprobs

__all__ = ["register_site", "token_logprobs_site", "token_loss_site"]


def token_logprobs_site(logits: torch.Tensor, input_ids: torch.Tensor,
                        parent_token: torch.Tensor) -> torch.Tensor:
    """Where a compiled model asked for log-probabilities only reads them from its logits: one
    node in the captured graph (Dynamo does not trace into it), which the logprobs pass
    (:mod:`treefx.compiler.find.logprobs`) replaces by :func:`.fast.fused_linear_tree_logprobs` when the
    logits are the output projection and feed nothing else, else by
    :func:`tree_token_logprobs` on the logits."""
    return tree_token_logprobs(logits, input_ids, parent_token)


def token_loss_site(logits: torch.Tensor, input_ids: torch.Tensor, parent_token: torch.Tensor,
                    weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a part graph of :func:`treefx.backward` makes its own loss, the weighted tree loss
    ``-Σ_t weights[t] · lp_t``, beside the log-probabilities (detached): one node, which the
    logprobs pass replaces by :func:`treefx.ops.cross_entropy.fused_linear_tree_loss_and_logprobs`
    when the logits are the output projection and feed nothing else (the loss's gradients
    made in the forward: three products with the output weight, not the four the
    log-probabilities' own backward needs), else by its plain form on the logits."""
    return tree_cross_entropy_and_logprobs(logits, input_ids, parent_token, weights)


_registered = False


def register_site() -> None:
    """Let Dynamo put :func:`token_logprobs_site` in the graph as one node. Called when a model
    is compiled with ``logits=False``, not at import: ``torch._dynamo`` costs ~2 s to import,
    which ``import treefx`` (stats, synth, draw) does not pay."""
    global _registered
    if not _registered:
        torch._dynamo.allow_in_graph(token_logprobs_site)
        torch._dynamo.allow_in_graph(token_loss_site)
        _registered = True
