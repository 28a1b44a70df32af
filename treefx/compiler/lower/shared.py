"""What the whole-tree and the part lowerings share: the model's mask and score ops of an
attention site evaluated for the tree, the general (scored) rewrite around a mode's kernel,
and the pieces of the SSM, loss and log-probability lowerings that do not depend on the
mode."""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ...ops.attention import sink_rescale
from ...ops.attention import intervals, trunk
from ...ops.cross_entropy import (
    fused_linear_tree_cross_entropy,
    fused_linear_tree_loss_and_logprobs,
    tree_cross_entropy,
    tree_cross_entropy_and_logprobs,
    tree_token_logprobs,
)
from ...ops.logprobs import fused_linear_tree_logprobs, fused_linear_tree_loss_and_logprobs_late
from ...ops.recurrence import register_site
from ..graph import (
    KEY_SELECTION,
    GraphContext,
    arg,
    attention_error,
    describe,
    example,
    is_call,
    same_size,
    set_example,
)
from ..mask_lift import (
    LiftedScore,
    MaskLiftError,
    dense_side,
    implied_by_tree,
    lift_mask,
    lift_value,
    mask_applications,
    sees_later_keys,
    window_of,
)
from ..patterns import (
    CASTS,
    MATMUL,
    OUT_OF_PLACE,
    SCALINGS,
    apply_scale,
    repeated_heads_source,
    same_shape_view,
    scale_step,
)
from ..find.logprobs import why_not_fused
from ..sites import AttentionSite, LogprobsSite, LossSite

__all__ = ["INTERVAL_NOTE", "ScoreMods", "TrunkSplit", "add_bias", "chain_module",
           "check_mask_sources", "constant_scale", "emit_logprobs", "emit_loss", "input_embedding",
           "interval_site",
           "kv_for_flex", "mask_value", "peel_mask", "replace_conv", "replace_recurrence",
           "rewrite_scored", "score_mods", "score_sides", "side_for_flex", "traced_site",
           "trainable_parameter", "trunk_split", "window_note"]

log = logging.getLogger("treefx")

_fail = attention_error


# ---------------------------------------------------------------------------- embedding

_EMBEDDINGS = (torch.nn.functional.embedding, torch.embedding)


def trainable_parameter(ctx: GraphContext, node) -> torch.nn.Parameter | None:
    """The trainable parameter a root placeholder stands for (among the capture's real
    inputs, which the engine keeps for parameters only), else None."""
    if not (isinstance(node, fx.Node) and node.op == "placeholder"):
        return None
    inputs = ctx.root.real_inputs
    i = ctx.root.input_position(node)
    real = inputs[i] if i is not None and i < len(inputs) else None
    return real if isinstance(real, torch.nn.Parameter) and real.requires_grad else None


def input_embedding(ctx: GraphContext):
    """(node, weight node, its parameter, padding_idx or -1): the one lookup of the tree's
    ``input_ids`` in a trainable parameter (``F.embedding`` in the root graph, without
    ``max_norm``, ``scale_grad_by_freq`` or ``sparse``); None where there is not exactly one
    such lookup or it is anything else."""
    ids = [n for n in ctx.graph.nodes if is_call(n, *_EMBEDDINGS)
           and ctx.is_tree_input(arg(n, 0, "input", None), "input_ids")]
    if len(ids) != 1:
        return None
    node = ids[0]
    weight = arg(node, 1, "weight", None)
    pad = arg(node, 2, "padding_idx", None)
    if arg(node, 3, "max_norm", None) is not None or arg(node, 5, "scale_grad_by_freq", False) \
            or arg(node, 6, "sparse", False) or not isinstance(pad, (int, type(None))):
        return None
    real, w = trainable_parameter(ctx, weight), example(weight)
    if real is None or w is None or w.dim() != 2:
        return None
    if pad is not None and pad < 0:
        pad += w.shape[0]
    return node, weight, real, -1 if pad is None else int(pad)


# ---------------------------------------------------------------------------- attention

def mask_value(ctx: GraphContext, site: AttentionSite):
    """The model mask as a node: boolean (True = may attend) or additive float."""
    m = site.mask
    if isinstance(m, tuple):
        how, cond = m
        if how == "not":
            with ctx.graph.inserting_before(site.out):
                return ctx.graph.call_function(torch.logical_not, (cond,))
        return cond
    return m


def check_mask_sources(ctx: GraphContext, site: AttentionSite, mask: fx.Node,
                       allowed: bool = True) -> None:
    """A model mask may see the tree only through the positions pass's grids.

    A mask computed from ``position_ids`` some other way (Hugging Face infers packed documents
    from jumps in them) would, on the DFS row, cut a child node off from its parent's tokens.
    With ``allowed`` (``mask`` is True where a query may attend, as :func:`mask_value` and
    :func:`peel_mask` give it; not a score op's side, whose sense the chain decides), a mask
    that lets a query see a later key is refused too.
    """
    stack, seen = [ctx.resolve(mask)], set()
    while stack:
        n = stack.pop()
        if n in seen or ctx.is_tree_input(n, "positions") or n.meta.get(KEY_SELECTION):
            continue  # (a key selection: the keys an indexer picked, per sequence)
        seen.add(n)
        if ctx.is_tree_input(n, "tree_info") or ctx.is_tree_input(n, "tree_weights"):
            from ..taint import DATA, Taint

            if DATA in Taint(ctx).of(mask):
                raise _fail(site.anchor, "its attention mask is computed from the tokens' hidden "
                                         "states (a learned or sparse-attention mask: keys chosen "
                                         "by top-k of an indexer's scores, a dynamic mask), which "
                                         "treefx cannot evaluate per sequence yet")
            raise _fail(site.anchor, "its attention mask is computed from the positions in a way "
                                     "other than index grids (packed-sequence detection from "
                                     "position_ids?), which cannot be evaluated per sequence; "
                                     "pass attention_mask to the model")
        stack.extend(ctx.resolve(a) for a in n.all_input_nodes)
    try:
        later = sees_later_keys(*lift_mask(ctx, mask)) if allowed else None
    except MaskLiftError:
        later = None  # (the callers lift it themselves, or refuse)
    if later is not None:
        raise _fail(site.anchor, f"its attention mask lets a query see a later key (position "
                                 f"{later[0]} sees {later[1]}: a bidirectional span, a "
                                 "prefix-LM prefix?); on a tree each sequence has later tokens "
                                 "of its own, so this attention has no tree form")


def kv_for_flex(site: AttentionSite, k: fx.Node):
    """The key and value FlexAttention reads: the model's own KV heads when it repeated them
    for its query heads (FlexAttention shares a KV head between its query heads itself: no
    repeat copies, and dK/dV come out per KV head instead of being summed over copies)."""
    if k is not site.k:  # a transpose inserted by the pass
        return k, site.v, False
    k0, v0 = repeated_heads_source(k), repeated_heads_source(site.v)
    if k0 is None or v0 is None:
        return k, site.v, False
    if not same_size(example(k0).shape[1], example(v0).shape[1]):
        return k, site.v, False
    return k0, v0, True


def rewrite_scored(ctx: GraphContext, site: AttentionSite, build) -> fx.Node:
    """The general form: the model's own score ops replayed, the tree mask applied to the
    softmax input, a sink or the model's log-sum-exp from the attention's log-sum-exp.
    ``build(ctx, site)``: the mode's (attention, log-sum-exp) pair node and what it adds to
    the note."""
    g = ctx.graph
    sc = site.scored
    note = site.kind + ", the model's score ops replayed"
    # Before the first reader: the model's log-sum-exp may be read before its attention.
    order = {n: i for i, n in enumerate(g.nodes)}
    first = min([site.out, *sc.lse], key=order.__getitem__)
    late = [a for a in (sc.scores, site.v, sc.sink) if a is not None and order[a] > order[first]]
    if late:
        raise _fail(site.anchor, f"its log-sum-exp is read before `{late[0].name}` is computed")
    with g.inserting_before(first):
        pair, more = build(ctx, site)
        note += more
        out = g.call_function(operator.getitem, (pair, 0))
        lse = g.call_function(operator.getitem, (pair, 1))
        if sc.sink is not None:
            out = g.call_function(sink_rescale, (out, lse, sc.sink))
            note += ", sink from the log-sum-exp"
        for n in sc.lse:
            n.replace_all_uses_with(g.call_method("to", (lse, example(n).dtype)))
            note += ", the model's log-sum-exp from the attention's"
    out.meta.update({k_: v_ for k_, v_ in site.out.meta.items()
                     if k_ in ("nn_module_stack", "stack_trace", "example_value")})
    ctx.record("attention", site.anchor, describe(pair), note=note)
    site.out.replace_all_uses_with(out)
    return out


@dataclass
class ScoreMods:
    """A scored site's FlexAttention pieces: the scale, the mask_mod and score_mod (lifted
    to path positions) and the buffers each reads; the mask's window, if it has one."""

    scale: float
    mask: object
    mask_bufs: tuple
    score_mod: object
    score_bufs: tuple
    note: str
    window: int | None = None  # the mask's window (:func:`window_of`)


def score_mods(ctx: GraphContext, site: AttentionSite, in_part: bool = False) -> ScoreMods:
    sc = site.scored
    chain, mask = peel_mask(ctx, sc.chain)
    note = ""
    lifted, mask_bufs = None, ()
    if mask is not None:
        check_mask_sources(ctx, site, mask)
        try:
            lifted, mask_bufs = lift_mask(ctx, mask)
        except MaskLiftError:
            chain, lifted = sc.chain, None  # a bias, not a mask: it stays a score op
        if lifted is not None and implied_by_tree(lifted, mask_bufs):
            lifted, mask_bufs = None, ()
            note += ", model mask implied by the tree"
        elif lifted is not None:
            note += ", model mask kept (evaluated at path positions)"
    scale, rest = constant_scale(chain)
    if not rest:  # only a constant scale is left: FlexAttention's own, no score_mod
        chain = []
        note += ", scores scaled by FlexAttention"
    sides = score_sides(chain, sc.scores)
    lifted_sides, score_bufs = [], []
    for side in sides:
        check_mask_sources(ctx, site, side, allowed=False)
        try:
            # in parts, a function of positions only: read where the model computed it, a
            # side has no entries for the context's keys
            one, bufs = side_for_flex(ctx, side, dense=not in_part)
        except MaskLiftError as e:
            where = ("in parts (treefx.backward) at the positions of earlier parts' keys"
                     if in_part else "per query and key position")
            raise _fail(site.anchor, f"its scores read `{describe(side)}`, which cannot be "
                                     f"evaluated {where} ({e}); use "
                                     + ("whole batches" if in_part else "backend='eager'")
                                     + " for this model") from None
        lifted_sides.append((one, len(bufs)))
        score_bufs.extend(bufs)
    score_mod = LiftedScore(chain_module(chain, sc.scores, sides), lifted_sides) \
        if chain else None
    if score_mod is not None:
        note += ", score ops as the score_mod"
    window, more = window_note(lifted)
    return ScoreMods(scale if chain == [] else 1.0, lifted, tuple(mask_bufs), score_mod,
                      tuple(score_bufs), note + more, window)


def window_note(lifted) -> tuple[int | None, str]:
    """The lifted mask's window (:func:`window_of`: key blocks beyond it are left out) and
    the note that says so."""
    window = window_of(lifted)
    return window, "" if window is None else f", key blocks beyond its window ({window}) left out"


@dataclass
class TrunkSplit:
    """A FlexAttention site's leading chain on a dense causal kernel
    (:mod:`treefx.ops.attention.trunk`): ``skip`` (the query blocks the site skips, a 0-d
    tensor node) for the site's ``skip_blocks``, then :meth:`add` the trunk's rows to its
    output."""

    skip: fx.Node
    parent: fx.Node
    offset: object  # 0, or the part's context length (a node)
    note: str = ", the leading chain's rows on a dense causal kernel (cuDNN's on the GPU)"

    def add(self, ctx: GraphContext, flex_out: fx.Node, q: fx.Node, k: fx.Node, v: fx.Node,
            scale) -> fx.Node:
        g = ctx.graph
        rows = g.call_function(trunk.trunk_attention,
                               (q, k, v, self.parent, self.offset, scale, ctx.block_size))
        return g.call_function(operator.add, (flex_out, rows))


INTERVAL_NOTE = ", on cuDNN's interval-mask attention (each row's keys as intervals of the row)"


def interval_site(ctx: GraphContext, site, k: fx.Node) -> tuple[fx.Node, str] | None:
    """A plain whole-tree site on cuDNN's interval-mask attention
    (:mod:`treefx.ops.attention.intervals`), where :func:`~treefx.ops.attention.intervals.wanted`
    takes its q, k, v (the model's KV heads, its repeat undone): (the output node, the note);
    else None (FlexAttention)."""
    k, v, shared_kv = kv_for_flex(site, k)
    if not intervals.wanted(example(site.q), example(k), example(v), ctx.options):
        return None
    intervals.warm_up(example(site.q), example(k), example(v), ctx.options)
    out = ctx.graph.call_function(intervals.tree_interval_attention,
                                  (site.q, k, v, ctx.parent_token(), site.scale))
    note = INTERVAL_NOTE
    if shared_kv:
        note += ", KV heads shared (the model's repeat undone)"
    return out, note


def trunk_split(ctx: GraphContext, q: fx.Node, k: fx.Node, v: fx.Node,
                offset=None) -> TrunkSplit | None:
    """The split for a plain FlexAttention site (no model mask, score_mod or log-sum-exp
    out) where :func:`treefx.ops.attention.trunk.wanted` takes its q, k, v; else None.
    ``offset``: None over the whole tree; in a part, ``offset(root_context)`` builds the
    node of the context's padded length (the part's rows start there in the predecessor
    row). A part's chain is split off only where its first row is a root: one that sees
    context rows (the op can take them, as a second piece) made parts slower on the GPU
    (the SWE trees in parts; BENCHMARKS.md, "Real agent trajectories: SWE-bench runs against
    per-call packing"), so those parts run on FlexAttention alone."""
    if not trunk.wanted(example(q), example(k), example(v), ctx.options):
        return None

    def start(c: GraphContext):  # where the rows start in the predecessor row
        return 0 if offset is None else c.shared("trunk offset", offset)

    skip = ctx.shared("trunk blocks", lambda c: c.graph.call_function(
        trunk.trunk_blocks, (c.parent_token(), start(c), c.block_size)))
    return TrunkSplit(skip, ctx.parent_token(), start(ctx))


def constant_scale(chain: list[fx.Node]) -> tuple[float, list[fx.Node]]:
    """(scale, remaining ops) when the chain starts with multiplications or divisions of the
    scores by constants (and casts): their product, and the ops after them."""
    scale, i = 1.0, 0
    for n in chain:  # each op reads the one before it (a chain has one score input per op)
        if not is_call(n, methods=CASTS):
            step = scale_step(n) if is_call(n, *SCALINGS, methods=("mul", "div")) else None
            if step is None:
                break
            scale = apply_scale(scale, step)
        i += 1
    return scale, chain[i:]


def score_sides(chain: list[fx.Node], scores: fx.Node) -> list[fx.Node]:
    """The tensors the chain reads besides the scores, in first-use order."""
    on = {scores, *chain}
    out: list[fx.Node] = []
    for n in chain:
        if not same_shape_view(n):  # its sizes are not tensors the chain reads
            out.extend(a for a in n.all_input_nodes if a not in on and a not in out)
    return out


def chain_module(chain: list[fx.Node], scores: fx.Node, sides: list[fx.Node]):
    """The chain as a function ``(scores, *sides) -> softmax input``, the model's own ops."""
    g = fx.Graph()
    env = {scores: g.placeholder("scores")}
    for i, side in enumerate(sides):
        env[side] = g.placeholder(f"side_{i}")
    for n in chain:
        env[n] = env[n.args[0]] if same_shape_view(n) else g.node_copy(n, lambda a: env[a])
        if env[n].op == "call_function" and env[n].target in OUT_OF_PLACE:
            env[n].target = OUT_OF_PLACE[env[n].target]
    g.output(env[chain[-1]] if chain else env[scores])
    return fx.GraphModule(torch.nn.Module(), g, class_name="ScoreChain")


def peel_mask(ctx: GraphContext, chain: list[fx.Node]):
    """(chain without its last op, boolean mask node) when the last op masks the scores
    (``+ where(allowed, 0, -inf)``, ``masked_fill(blocked, -inf)``, ``where(allowed, s,
    -inf)``: :func:`mask_applications`), which a FlexAttention ``mask_mod`` does with block
    sparsity; else (chain, None)."""
    if not chain:
        return chain, None
    last, prev = chain[-1], (chain[-2] if len(chain) > 1 else None)

    def is_prev(a):
        return a is prev if prev is not None else (
            isinstance(a, fx.Node) and is_call(a, *MATMUL, methods=("matmul",)))

    for scores, how, mask in mask_applications(ctx, last):
        if not is_prev(scores) or how == "additive" and not isinstance(mask, fx.Node):
            continue
        if how == "blocked":
            with ctx.graph.inserting_before(last):
                return chain[:-1], ctx.graph.call_function(torch.logical_not, (mask,))
        return chain[:-1], mask
    return chain, None


def side_for_flex(ctx: GraphContext, node: fx.Node, dense: bool = True):
    """A tensor the scores read, for a score_mod: evaluated per query and key position when
    it is a function of index grids (:func:`lift_value`), else (with ``dense``) read from the
    model's own tensor at the query's and key's rows (:class:`DenseSide`)."""
    try:
        one, bufs = lift_value(ctx, node)
        _try_scalar(one, bufs)
        return one, bufs
    except MaskLiftError as first:
        if not dense:
            raise
        try:
            side = dense_side(ctx, node)
        except MaskLiftError:
            raise first from None
        # Padded along its token axes like the positions: FlexAttention's kernel may read
        # past N in the row's last block (masked out after the score_mod).
        dims = [d - 4 for d in (2, 3) if not side.broadcast[d]]
        padded = ctx.graph.call_function(torch.ops.treefx.pad_rows_to_block.default,
                                         (ctx.local(node), ctx.block_size, dims))
        set_example(padded)
        return side, (padded,)


def _try_scalar(lifted, bufs) -> None:
    """Evaluate a lifted value once for one (b, h, q, kv) on the example values: MaskLiftError
    when it does not give one scalar (an axis it cannot assign to b, h, q or kv)."""
    def meta(v):  # the example value's shape, on the meta device (no data, no guards)
        if not isinstance(v, torch.Tensor):
            return v
        shape = [s if isinstance(s, int) else (s.node.hint or 2) for s in v.shape]
        return torch.empty(shape, dtype=v.dtype, device="meta")

    try:
        vals = [meta(example(b)) for b in bufs]
        zero = torch.zeros(1, dtype=torch.int64, device="meta")  # one (b, h, q, kv) pair
        out = lifted.evaluate(zero, zero, zero, zero, *vals)
    except MaskLiftError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure means: not evaluable per index
        raise MaskLiftError(f"{type(e).__name__}: {e}") from None
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        raise MaskLiftError("it does not give one value per query and key")


def add_bias(score, bias):
    if bias.dtype == torch.bool:  # a boolean mask the lifter could not evaluate per index
        return torch.where(bias, score, float("-inf"))
    return score + bias


# ---------------------------------------------------------------------------- state

def traced_site(rec, node: fx.Node):
    """(site key, the tensor arguments in order) for the custom op that runs a registered
    kernel under AOTAutograd: the non-tensor arguments and the output's dtype are kept with
    the key (:func:`treefx.ops.recurrence.register_site`)."""
    bound = rec.bind(node.args, node.kwargs)
    names = [k for k, v in bound.items() if isinstance(v, fx.Node)]
    static = {k: v for k, v in bound.items() if not isinstance(v, fx.Node)}
    out = example(node)
    out = out[0] if isinstance(out, (tuple, list)) else out
    key = register_site(rec, names, static, out.dtype if isinstance(out, torch.Tensor) else None)
    return key, [bound[k] for k in names]


def replace_recurrence(ctx: GraphContext, site, new: fx.Node) -> fx.Node:
    """``new`` in place of a recurrence site's marker call."""
    node = site.node
    new.meta.update(node.meta)
    ctx.record("ssm", node, describe(new), note=f"recurrence {site.rec.name}")
    node.replace_all_uses_with(new)
    ctx.graph.erase_node(node)
    return new


def replace_conv(ctx: GraphContext, site, new: fx.Node) -> fx.Node:
    """``new`` in place of a conv site's cut output (the conv and its cut erased)."""
    g = ctx.graph
    new.meta.update(site.cut.meta)
    ctx.record("ssm", site.conv, describe(new), note="causal conv1d")
    site.cut.replace_all_uses_with(new)
    g.erase_node(site.cut)
    g.erase_node(site.conv)
    return new


# ---------------------------------------------------------------------------- loss

def emit_loss(ctx: GraphContext, site: LossSite, parent: fx.Node, ids: fx.Node) -> fx.Node:
    """The weighted tree loss of ``site`` gathered at ``parent`` (labels ``ids``), fused with
    the output projection when the logits exist only for this loss."""
    g = ctx.graph
    ce, red, proj = site.ce, site.reduction, site.proj
    with g.inserting_before(ce):
        weights = ctx.shared(("weights", red), lambda c: c.graph.call_function(
            operator.getitem, (c.tree_weights, 0 if red == "sum" else 1)))
        if proj is not None:
            # The logits exist only for this loss: fuse the projection, never build them.
            h, weight, bias = proj
            new = g.call_function(fused_linear_tree_cross_entropy,
                                  (h, weight, bias, ids, parent, weights))
        else:
            new = g.call_function(tree_cross_entropy, (site.logits, ids, parent, weights))
    new.meta["example_value"] = ce.meta.get("example_value")
    ctx.record("loss", ce, describe(new), note=f"reduction={red}" + (
        ", fused with the output projection" if proj is not None else ""))
    ce.replace_all_uses_with(new)
    g.erase_node(ce)
    ctx.note_loss_site()
    return new


def emit_logprobs(ctx: GraphContext, site: LogprobsSite, in_part: bool) -> fx.Node:
    """The log-probabilities of ``site`` (a loss site: the weighted loss and the
    log-probabilities): fused with the output projection when the logits feed nothing else
    (``in_part``: a part's labels are mostly trained tokens, so its backward takes every row,
    without a host synchronization), else from the logits with a warning."""
    g = ctx.graph
    node, logits, ids, parent = site.node, site.logits, site.ids, site.parent
    loss = site.weights is not None
    with g.inserting_before(node):
        if site.proj is not None:
            h, weight, bias = site.proj
            if loss:  # the loss's gradients made in its forward: no second pass (in a part,
                # with TREEFX_PART_LOSS_GRAD_LATE, in its backward: no held [V, D] gradient)
                fused = fused_linear_tree_loss_and_logprobs_late if (
                    in_part and ctx.options.part_loss_grad_late) else \
                    fused_linear_tree_loss_and_logprobs
                new = g.call_function(fused, (h, weight, bias, ids, parent, site.weights))
            else:
                new = g.call_function(fused_linear_tree_logprobs,
                                      (h, weight, bias, ids, parent, in_part))
            note = "fused with the output projection: the logits are not built"
        else:
            if loss:
                new = g.call_function(tree_cross_entropy_and_logprobs,
                                      (logits, ids, parent, site.weights))
            else:
                new = g.call_function(tree_token_logprobs, (logits, ids, parent))
            note = f"the logits are built: {why_not_fused(logits)}"
            log.warning("treefx.compile(logits=False): %s", note)
    new.meta["example_value"] = node.meta.get("example_value")
    ctx.record("logprobs", node, describe(new), note=("the loss, " if loss else "") + note)
    node.replace_all_uses_with(new)
    g.erase_node(node)
    return new
