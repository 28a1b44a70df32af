"""Lowering for the whole tree (:func:`treefx.compile`, :func:`treefx.step`): each site
becomes its tree op, eager (dense tree mask, plain torch) or for FlexAttention and
AOTAutograd (block masks, opaque recurrence ops), as the backend asks."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ...mask import dense_tree_mask, tree_block_tensors
from ...ops.attention import TreeFlexAttention, TreeScoredAttention, tree_attention_dense
from ...ops.conv import tree_causal_conv1d, tree_causal_conv1d_fast
from ...ops.embedding import embedding as tree_embedding
from ...ops.recurrence import TracedTreeRecurrence, traced, tree_recurrence
from ...ops.scan import tree_cumsum
from ..graph import GraphContext, arg, attention_error, describe, example, set_example
from ..mask_lift import LiftedMask, LiftedScore, MaskLiftError, implied_by_tree, lift_mask
from ..sites import (
    AttentionSite,
    ConvSite,
    KeySelectionSite,
    LogprobsSite,
    LossSite,
    PathSumSite,
    RecurrenceSite,
)
from .shared import (
    add_bias,
    chain_module,
    check_mask_sources,
    emit_logprobs,
    emit_loss,
    input_embedding,
    interval_site,
    kv_for_flex,
    mask_value,
    replace_conv,
    replace_recurrence,
    rewrite_scored,
    score_mods,
    score_sides,
    side_for_flex,
    traced_site,
    trunk_split,
    window_note,
)

__all__ = ["TreeRecurrenceCall", "attention", "conv", "finish", "key_selection", "logprobs",
           "loss", "lower", "path_sum", "recurrence"]

_fail = attention_error


# ---------------------------------------------------------------------------- attention

def attention(ctx: GraphContext, site: AttentionSite) -> fx.Node:
    """Tree attention over the whole tree: SDPA with the dense tree mask on the eager backend,
    FlexAttention with the tree's block mask otherwise; the model's mask kept (evaluated at
    path positions) or dropped when the tree implies it; the general (scored) form with the
    model's score ops replayed."""
    if site.scored is not None:
        return rewrite_scored(ctx, site, _scored_eager if ctx.backend == "eager"
                              else _scored_flex)
    g = ctx.graph
    k = site.k
    with g.inserting_before(site.out):
        if site.kind == "eager-kT":
            k = g.call_method("transpose", (k, -2, -1))
        mm = _ModelMask.of(ctx, site)
        note = site.kind + mm.note
        if ctx.backend == "eager":
            tree = ctx.shared("dense_tree_mask",
                              lambda c: c.graph.call_function(dense_tree_mask, (c.subtree_end,)))
            new = g.call_function(
                tree_attention_dense, (site.q, k, site.v, tree, mm.mask),
                {"scale": site.scale, "enable_gqa": site.enable_gqa},
            )
        else:
            new, more = _flex_attention(ctx, site, k, mm)
            note += more
    return _record(ctx, site, new, note)


@dataclass(frozen=True)
class _ModelMask:
    """The mask the model built, as the whole tree's attention takes it: ``mask`` (None: no
    mask, or one the tree implies, dropped), ``lifted`` and its buffers ``bufs`` (this graph's
    nodes) where it lifts into a ``mask_mod``, ``lift_error`` where it does not, and what was
    done with it in words (``note``)."""

    mask: fx.Node | None = None
    lifted: LiftedMask | None = None
    bufs: tuple = ()
    lift_error: MaskLiftError | None = None
    note: str = ""

    @classmethod
    def of(cls, ctx: GraphContext, site: AttentionSite) -> _ModelMask:
        mask = mask_value(ctx, site) if site.mask is not None else None
        if mask is None:
            return cls()
        lifted, bufs, lift_error = None, (), None
        check_mask_sources(ctx, site, mask)
        try:
            lifted, bufs = lift_mask(ctx, mask)
        except MaskLiftError as e:
            lift_error = e
        if lifted is not None and implied_by_tree(lifted, bufs):
            # Causal in positions: the tree mask implies it. Dropping it keeps the tree's full
            # blocks (no mask_mod work there) and the dense mask small.
            mask, lifted, bufs = None, None, ()
            note = ", model mask implied by the tree"
        else:
            note = ", model mask kept (evaluated at path positions)"
        return cls(mask, lifted, tuple(ctx.local(b) for b in bufs), lift_error, note)


def _flex_attention(ctx: GraphContext, site: AttentionSite, k: fx.Node,
                    mm: _ModelMask) -> tuple[fx.Node, str]:
    """FlexAttention over the tree's block mask (or the interval kernel, or the trunk split),
    the model's mask as the ``mask_mod`` or, carrying a bias, as a ``score_mod``; the output
    node and what was done in words."""
    g = ctx.graph
    lifted, bufs, note = mm.lifted, mm.bufs, ""
    score_mod, score_bufs = None, ()
    if mm.mask is not None and lifted is None:
        score_mod, score_bufs, note = _bias_score_mod(ctx, site, mm)
    window, more = window_note(lifted)
    note += more
    interval = interval_site(ctx, site, k) if lifted is None and score_mod is None else None
    if interval is not None:
        new, more = interval
        return new, note + more
    blocks = _block_nodes(ctx, full=lifted is None, window=window)
    fn = TreeFlexAttention(scale=site.scale, block_size=ctx.block_size,
                           model_mask=lifted, kernel_options=ctx.kernel_options,
                           interleave_heads=ctx.interleave_heads,
                           score_mod=score_mod, mask_buffers=len(bufs),
                           name=f"tree_flex_attention_{site.anchor.name}")
    k, v, shared_kv = kv_for_flex(site, k)
    if shared_kv:
        note += ", KV heads shared by FlexAttention (the model's repeat undone)"
    kv = example(k)
    if ctx.interleave_heads is not False and (kv is None or kv.shape[1] != 1) and (
            score_mod is None):
        note += (", KV heads interleaved along the row"
                 + (" where gradients are computed" if ctx.interleave_heads is None
                    else ""))
    split = trunk_split(ctx, site.q, k, v) if lifted is None and score_mod is None else None
    new = g.call_function(fn, (site.q, k, v, *blocks, *bufs, *score_bufs),
                          {} if split is None else {"skip_blocks": split.skip})
    if split is not None:
        new = split.add(ctx, new, site.q, k, v, site.scale)
        note += split.note
    return new, note


def _bias_score_mod(ctx: GraphContext, site: AttentionSite,
                    mm: _ModelMask) -> tuple[LiftedScore, tuple, str]:
    """An additive mask that carries a bias (Falcon adds its ALiBi into it): the bias at path
    positions, added to the scores by a score_mod; its buffers (this graph's) and a note."""
    try:
        value, vbufs = side_for_flex(ctx, mm.mask)
    except MaskLiftError as e:
        raise _fail(site.anchor, f"its model-built attention mask cannot be lifted "
                                 f"into a FlexAttention mask_mod ({mm.lift_error}) nor "
                                 f"a score_mod ({e}); use backend='eager' for this "
                                 "model") from None
    score_mod = LiftedScore(add_bias, [(value, len(vbufs))])
    note = (", applied to the scores by the score_mod"
            if example(mm.mask).dtype == torch.bool
            else ", added to the scores by the score_mod")
    return score_mod, tuple(ctx.local(b) for b in vbufs), note


def _record(ctx: GraphContext, site: AttentionSite, new: fx.Node, note: str) -> fx.Node:
    """The site's output replaced by ``new`` (its metadata kept), recorded with ``note``."""
    new.meta.update({k_: v_ for k_, v_ in site.out.meta.items()
                     if k_ in ("nn_module_stack", "stack_trace", "example_value")})
    ctx.record("attention", site.anchor, describe(new), note=note)
    site.out.replace_all_uses_with(new)
    return new


def _scored_eager(ctx: GraphContext, site: AttentionSite):
    """The general form on the eager backend: the model's score ops, then the dense tree
    mask, in one op that returns the attention and its log-sum-exp."""
    g = ctx.graph
    sc = site.scored
    tree = ctx.shared("dense_tree_mask",
                      lambda c: c.graph.call_function(dense_tree_mask, (c.subtree_end,)))
    sides = score_sides(sc.chain, sc.scores)
    fn = TreeScoredAttention(chain_module(sc.chain, sc.scores, sides),
                             name=f"tree_scored_attention_{site.anchor.name}")
    return g.call_function(fn, (sc.scores, site.v, tree, *sides)), ""


def _scored_flex(ctx: GraphContext, site: AttentionSite):
    """FlexAttention for the general form: the score ops as a ``score_mod`` (their masks and
    biases evaluated at path positions), a final mask as the ``mask_mod``."""
    g = ctx.graph
    mods = score_mods(ctx, site)
    k = site.k
    if site.kind.endswith("-kT"):
        k = g.call_method("transpose", (k, -2, -1))
    blocks = _block_nodes(ctx, full=mods.mask is None, window=mods.window)
    fn = TreeFlexAttention(scale=mods.scale, block_size=ctx.block_size,
                           model_mask=mods.mask, score_mod=mods.score_mod,
                           mask_buffers=len(mods.mask_bufs), return_lse=True,
                           kernel_options=ctx.kernel_options,
                           interleave_heads=ctx.interleave_heads if mods.score_mod is None
                           else False,
                           name=f"tree_flex_attention_{site.anchor.name}")
    k, v, shared_kv = kv_for_flex(site, k)
    note = mods.note
    if shared_kv:
        note += ", KV heads shared by FlexAttention (the model's repeat undone)"
    bufs = tuple(ctx.local(b) for b in (*mods.mask_bufs, *mods.score_bufs))
    return g.call_function(fn, (site.q, k, v, *blocks, *bufs)), note


def _block_nodes(ctx: GraphContext, *, full: bool, window: int | None = None):
    """Shared nodes: the tree's block-mask tensors and the padded tree tensors. ``window``:
    the model's mask admits no pair farther apart (:func:`window_of`), so key blocks beyond
    it are left out."""
    def make(c: GraphContext):
        g = c.graph
        kwargs = {"full": full}
        if window is not None:
            kwargs.update(positions=c.positions, window=window)
        t = g.call_function(tree_block_tensors, (c.subtree_end, c.block_size), kwargs)
        parts = [g.call_function(operator.getitem, (t, i)) for i in range(5)]
        # parts[4]: subtree_end padded to the block tensors' blocks; the positions likewise.
        # (torch.ops.treefx.pad_to_block is registered by importing ..mask)
        pos = g.call_function(torch.ops.treefx.pad_to_block.default,
                              (c.positions, c.block_size))
        return (*parts, pos)

    return ctx.shared(("blocks", full, window), make)


# ---------------------------------------------------------------------------- state

class TreeRecurrenceCall:
    """A registered kernel, run over the tree (eager backend)."""

    def __init__(self, rec):
        self.rec = rec
        self.__name__ = f"tree_recurrence_{rec.name}"

    def __call__(self, parent_token, *args, **kwargs):
        return tree_recurrence(self.rec, parent_token, args, kwargs)

    def __repr__(self):
        return self.__name__


def recurrence(ctx: GraphContext, site: RecurrenceSite) -> fx.Node:
    """A registered kernel over the tree: eagerly (:func:`treefx.ops.recurrence.
    tree_recurrence`), or as one opaque op AOTAutograd traces (the tree's structure is
    data)."""
    g = ctx.graph
    node, rec = site.node, site.rec
    parent = ctx.parent_token()
    with g.inserting_before(node):
        if ctx.backend == "eager":
            new = g.call_function(TreeRecurrenceCall(rec), (parent, *node.args), node.kwargs)
        else:
            key, tensors = traced_site(rec, node)
            # a graph traced with gradients on keeps the kernels' graph for its backward
            # (options.keep_recurrence_graph off: the backward recomputes the forward)
            keep = torch.is_grad_enabled() and traced.keeps_forward_graph(ctx.options)
            new = g.call_function(TracedTreeRecurrence(key, keep=keep), (parent, *tensors))
    return replace_recurrence(ctx, site, new)


def path_sum(ctx: GraphContext, site: PathSumSite) -> fx.Node:
    """A cumulative sum along the tokens as a sum along each token's path."""
    g = ctx.graph
    node = site.node
    parent, se = ctx.parent_token(), ctx.subtree_end
    with g.inserting_before(node):
        new = g.call_function(tree_cumsum, (node.args[0], site.dim, parent, se),
                              {"dtype": arg(node, 2, "dtype")})
    new.meta.update(node.meta)
    ctx.record("ssm", node, describe(new), note="cumulative sum along each path")
    node.replace_all_uses_with(new)
    g.erase_node(node)
    return new


def conv(ctx: GraphContext, site: ConvSite) -> fx.Node:
    """A causal conv1d reading each token's tree predecessors: plain torch eagerly, the row's
    conv fixed at node boundaries (one opaque op) in traced graphs."""
    parent = ctx.parent_token()
    with ctx.graph.inserting_before(site.cut):
        if ctx.backend == "eager":
            new = ctx.graph.call_function(tree_causal_conv1d,
                                          (site.x, site.weight, site.bias, parent))
        else:
            out = site.cut.meta.get("example_value")
            new = ctx.graph.call_function(
                tree_causal_conv1d_fast, (site.x, site.weight, site.bias, parent),
                {"dtype": out.dtype if isinstance(out, torch.Tensor) else None})
    return replace_conv(ctx, site, new)


# ---------------------------------------------------------------------------- key selection

def key_selection(ctx: GraphContext, site: KeySelectionSite) -> None:
    """The tree mask ANDed into the mask of the top-k's scores: each query's row holds its
    ancestors only."""
    g = ctx.graph
    x, how, mask = site.x, site.how, site.mask
    with g.inserting_before(x):
        tree = ctx.shared("dense_tree_mask",
                          lambda c: c.graph.call_function(dense_tree_mask, (c.subtree_end,)))
        if how == "allowed":
            new = g.call_function(torch.logical_and, (mask, tree))
        elif how == "blocked":
            new = g.call_function(torch.logical_or,
                                  (mask, g.call_function(torch.logical_not, (tree,))))
        else:
            low = torch.finfo(example(mask).dtype).min
            new = g.call_function(torch.masked_fill,
                                  (mask, g.call_function(torch.logical_not, (tree,)), low))
        set_example(new)
    x.replace_input_with(mask, new)
    ctx.record("selection", site.topk, describe(x),
               note=f"the top-k's {how} mask ANDed with the tree: each query's row holds "
                    "its ancestors only")


# ---------------------------------------------------------------------------- loss

def loss(ctx: GraphContext, site: LossSite) -> fx.Node:
    """The weighted tree loss, gathered at ``parent_token``."""
    return emit_loss(ctx, site, ctx.parent_token(), ctx.input_ids)


def logprobs(ctx: GraphContext, site: LogprobsSite) -> fx.Node:
    """The tree's log-probabilities (fused with the output projection where it can be)."""
    return emit_logprobs(ctx, site, in_part=False)


_LOWERINGS = {AttentionSite: attention, RecurrenceSite: recurrence, PathSumSite: path_sum,
              ConvSite: conv, KeySelectionSite: key_selection, LossSite: loss,
              LogprobsSite: logprobs}


def lower(ctx: GraphContext, site) -> None:
    """Lower one site of any kind for the whole tree."""
    _LOWERINGS[type(site)](ctx, site)


def finish(ctx: GraphContext) -> None:
    """After the sites: on a compiling backend, the lookup of the tree's ids in the model's
    input embedding (:func:`.shared.input_embedding`) becomes
    :func:`treefx.ops.embedding.embedding`, whose weight gradient is ATen's kernel instead
    of Inductor's decomposition over the whole [vocab, D], where that was measured faster
    (``benchmarks.embedding_grad``; BENCHMARKS.md, "Training step against sequence packing",
    [emb-1]; in float32 on CUDA Inductor's is the faster, so not taken): half-precision
    weights on CUDA, and
    float32 / float64 weights on the CPU. The same values: on CUDA both sum each id's rows in
    float32 and round once; on the CPU ATen sums in the weight's dtype (so half precision is
    left to Inductor there)."""
    found = None if ctx.backend == "eager" else input_embedding(ctx)
    if found is None:
        return
    node, weight, _, pad = found
    w = example(weight)
    half, full = (torch.bfloat16, torch.float16), (torch.float32, torch.float64)
    if w.dtype not in (half if w.is_cuda else full):
        return
    with ctx.graph.inserting_before(node):
        new = ctx.graph.call_function(tree_embedding, (node.args[0], weight, pad))
    new.meta.update(node.meta)
    ctx.record("embedding", node, describe(new), note="the weight's gradient by ATen's kernel")
    node.replace_all_uses_with(new)
    ctx.graph.erase_node(node)
