"""The sites the recognisers (:mod:`treefx.compiler.find`) find in a graph and the lowerings
(:mod:`treefx.compiler.lower`) rewrite for the tree: plain records of graph nodes, one type per
kind of computation along the sequence. A site knows no backend and no mode (whole tree or
part)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

__all__ = ["AttentionSite", "ConvSite", "KeySelectionSite", "LogprobsSite", "LossSite",
           "PathSumSite", "RecurrenceSite", "ScoreChain"]


@dataclass
class AttentionSite:
    """One attention to rewrite: ``out`` is replaced by attention(q, k, v) with the tree."""

    out: fx.Node
    anchor: fx.Node  # the node that names the site in reports (sdpa call or softmax)
    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: fx.Node | None  # model mask, boolean or additive
    scale: float | None
    enable_gqa: bool
    kind: str
    scored: ScoreChain | None = None  # scores the model transforms itself (softcap, sink, ...)


@dataclass
class ScoreChain:
    """What a model does to its scores between ``q @ k^T`` and the softmax, and around it.

    ``chain``: the elementwise ops from the matmul ``scores`` to the softmax input, in order,
    each reading the previous one and ``sides`` (masks, biases: tensors that do not depend on
    the scores). ``sink``: a [B, H, N, 1] logit concatenated as one more key and dropped
    after the softmax. ``lse``: the model's own ``logsumexp`` over the same scores (a sink
    applied as ``sigmoid(lse - sink)``)."""

    scores: fx.Node
    chain: list[fx.Node]
    sink: fx.Node | None
    lse: list[fx.Node]


@dataclass
class RecurrenceSite:
    """A registered recurrent kernel's marker call ``node`` (:mod:`treefx.compiler.
    recurrences`): becomes a tree recurrence, each tree node's initial state its parent
    node's final state."""

    node: fx.Node
    rec: object  # the Recurrence


@dataclass
class PathSumSite:
    """A ``cumsum`` along the tokens (dim ``dim``; positions the model counts itself):
    becomes a sum along each token's path."""

    node: fx.Node
    dim: int


@dataclass
class ConvSite:
    """A causal depthwise ``conv1d(x, weight, bias, padding=K-1, groups=C)`` and the slice
    ``cut`` that cuts its output back to the N tokens: becomes a convolution over each token's
    tree predecessors."""

    conv: fx.Node
    cut: fx.Node
    x: fx.Node
    weight: fx.Node
    bias: fx.Node | None


@dataclass
class KeySelectionSite:
    """A top-k over the keys of a [.., N, N] score row (``topk``) whose input ``x`` masks the
    scores with the model's ``mask`` (``how``: "allowed", "blocked" or "additive"): the tree
    mask goes into that mask."""

    topk: fx.Node
    x: fx.Node
    how: str
    mask: fx.Node


@dataclass
class LossSite:
    """A cross-entropy ``ce`` of shifted logits and labels in a training step (``reduction``
    "sum" or "mean"); ``proj``: (h, weight, bias) when the logits are a projection that feeds
    only this loss (fused, the logits never built), else None."""

    ce: fx.Node
    reduction: str
    logits: fx.Node
    proj: tuple | None


@dataclass
class LogprobsSite:
    """The marker ``node`` where a model asked for log-probabilities only reads them from its
    ``logits`` (``ids``, ``parent``: the predicted tokens and their predecessors); ``proj``
    as for :class:`LossSite`."""

    node: fx.Node
    logits: fx.Node
    ids: fx.Node
    parent: fx.Node
    proj: tuple | None
    weights: fx.Node | None = None  # a loss site (token_loss_site): the tokens' loss weights
