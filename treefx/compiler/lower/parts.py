"""Lowering for a part of a tree (:mod:`treefx.parts`, run by :func:`treefx.backward`): the
part's graph reads its context from earlier parts and hands its own on. Every part-mode
lowering of the compiler is here, with the part's inputs and outputs (:class:`PartSites`,
:func:`finish`).

The captured function of a part takes, besides the part's tokens, its context row's tree
tensors (``part_info``), one buffer ``ctx_tok`` [A, W] with every site's keys, values and conv
inputs of the context tokens side by side, and ``ctx_state`` [E, S] with every recurrence's
state after each entry's predecessor; it ends in one marker call
(:func:`part_outputs`) whose results are the part's own [n, W] and its exit states [X, S]. The
attention and SSM lowerings below give each site its columns (:meth:`PartSites.context`,
:meth:`PartSites.state`); :func:`finish` replaces the marker by the concatenation of what the
sites produce. The widths and dtypes are known only once the passes ran: a first capture
(``Plan.find_layout``) with empty buffers only finds them (:class:`treefx.plan.PartFindings`,
returned by :func:`finish`), and the caller captures again with buffers of those widths; a
graph whose sites then need other widths is an error (:class:`PartLayoutMismatch`).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ...ops.attention import (
    TreePartAttention,
    TreePartFlexAttention,
    intervals,
    ones_for_positions,
)
from ...ops.conv import tree_causal_conv1d_context
from ...ops.embedding import part_embedding
from ...ops.grad_into import linear_grad_into
from ...ops.logprobs import fused_linear_tree_logprobs
from ...ops.part_context import columns_to_heads, heads_to_columns
from ...ops.recurrence import TracedTreeRecurrencePart, tree_recurrence_part
from ...plan import PartFindings, PartLayout
from ..graph import (
    GraphContext,
    TreeCompileError,
    arg,
    attention_error,
    describe,
    example,
    is_call,
    same_size,
    selection_error,
    set_example,
    state_error,
)
from ..mask_lift import MaskLiftError, implied_by_tree, is_all_ones_input, lift_mask
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
    INTERVAL_NOTE,
    emit_logprobs,
    emit_loss,
    input_embedding,
    kv_for_flex,
    mask_value,
    check_mask_sources,
    replace_conv,
    replace_recurrence,
    rewrite_scored,
    score_mods,
    traced_site,
    trainable_parameter,
    trunk_split,
    window_note,
)

__all__ = ["PartLayoutMismatch", "PartSites", "TreeRecurrencePartCall", "attention", "conv",
           "finish", "has_grad_hooks", "key_selection", "logprobs", "loss", "lower",
           "part_outputs", "path_sum", "recurrence"]


def part_outputs(input_ids, ctx_tok, ctx_state, state_exit, part_info, state_entry,
                 tree_info, emb_sink, grads):
    """Marker of a part's captured function (one graph node, replaced by :func:`finish`):
    the part's own [n, W] and exit states [X, S]. It takes every part input, so that Dynamo
    makes each a graph input (``grads``: the ``.grad`` of the parameters the part may add
    their gradients into directly, see :func:`route_gradients`)."""
    n = input_ids.shape[-1]
    return (ctx_tok.new_zeros(n, ctx_tok.shape[1]),
            ctx_state.new_zeros(state_exit.shape[0], ctx_state.shape[1]))


class PartLayoutMismatch(TreeCompileError):
    """A part's graph, captured for context buffers of one layout, needs another (or adds into
    other ``.grad`` buffers than it was given): the model's code took another branch for this
    part. ``found``: the :class:`~treefx.plan.PartFindings` of this graph."""

    def __init__(self, found: PartFindings):
        super().__init__(f"part context layout: {found.layout.describe()}, gradient buffers "
                         f"{list(found.grads_used)}")
        self.found = found


class PartSites:
    """The part-mode nodes of a captured graph and the columns given out so far."""

    def __init__(self, marker: fx.Node):
        self.marker = marker
        (_, self.ctx_tok, self.ctx_state, self.state_exit, self.part_info,
         self.state_entry, _, self.emb_sink, grads) = marker.args
        self.grads: list[fx.Node] = list(grads)
        self.tok: list[tuple[fx.Node, int, torch.dtype]] = []  # own value [n, w], width, dtype
        self.state: list[tuple[fx.Node, int, torch.dtype]] = []

    # ------------------------------------------------------------------ layout

    def _buffer_dtype(self, entries, default):
        dtypes = [d for _, _, d in entries]
        out = dtypes[0] if dtypes else default
        for d in dtypes[1:]:
            out = torch.promote_types(out, d)
        return out

    def layout(self) -> PartLayout:
        tok_dtype = self._buffer_dtype(self.tok, example(self.ctx_tok).dtype)
        state_dtype = self._buffer_dtype(self.state, example(self.ctx_state).dtype)
        return PartLayout(sum(w for _, w, _ in self.tok), tok_dtype,
                          sum(w for _, w, _ in self.state), state_dtype)

    # ------------------------------------------------------------------ nodes

    def _read(self, ctx: GraphContext, fn, args: tuple, wide: bool) -> fx.Node:
        """``fn(*args)`` on one of the part's buffers, built once in the root graph (where the
        buffers are) and imported into ``ctx``'s graph (as an operand of the body it runs in,
        an activation-checkpointed layer). ``wide``: the buffer holds the columns read (not
        so on the first capture, before the widths are known: no example value then)."""
        return ctx.shared(("part_read", fn, args), lambda c: c.graph.call_function(fn, args),
                          example=wide)

    def ext(self, ctx: GraphContext, key: str) -> fx.Node:
        """Shared [A + n] node of the extended row: ``"positions"``, ``"parent"`` or
        ``"subtree_end"`` (rows 0, 1, 2 of ``part_info`` then ``tree_info``)."""
        row = {"positions": 0, "parent": 1, "subtree_end": 2}[key]

        def make(c: GraphContext):
            g = c.graph
            a = g.call_function(operator.getitem, (self.part_info, row))
            b = g.call_function(operator.getitem, (c.tree_info, row))
            for x in (a, b):
                set_example(x)
            return g.call_function(_extended_row, (a, b))

        return ctx.shared(("part_ext", key), make)

    def parent_local(self, ctx: GraphContext) -> fx.Node:
        """[n] predecessors inside the part, -1 where it is in an earlier part (or none)."""
        def make(c: GraphContext):
            g = c.graph
            par = c.parent_token()
            a = g.call_function(_context_length, (self.part_info,))
            return g.call_function(_local_parent, (par, a))

        return ctx.shared("part_parent_local", make)

    def context(self, ctx: GraphContext, own: fx.Node, heads: int, dim: int) -> fx.Node:
        """Register ``own`` [1, heads, n, dim] (keys or values of one site) as the part's
        columns and return the context tokens' share [1, heads, A, dim] in ``own``'s dtype.
        Insert where ``own`` is defined and before its reader. Inside a body (an
        activation-checkpointed layer) the columns leave it as an extra output and the
        context enters it as an extra operand."""
        return self._columns(ctx, own, heads_to_columns, columns_to_heads, (heads, dim),
                             heads * dim)

    def channels(self, ctx: GraphContext, own: fx.Node, channels: int) -> fx.Node:
        """``own`` [1, C, n] (a conv's inputs) as the part's columns; returns the context
        tokens' [1, C, A] in its dtype."""
        return self._columns(ctx, own, _channels_to_columns, _columns_to_channels, (channels,),
                             channels)

    def _columns(self, ctx: GraphContext, own: fx.Node, to_columns, from_columns,
                 sizes: tuple, width: int) -> fx.Node:
        """``own`` as ``width`` columns of the part's own [n, W] (handed out of a body through
        :meth:`GraphContext.export`), and the context's share read back from ``ctx_tok`` by
        ``from_columns(buf, offset, *sizes, dtype)``."""
        dtype = example(own).dtype
        offset = sum(w for _, w, _ in self.tok)
        cols = ctx.graph.call_function(to_columns, (own,))
        self.tok.append((cols, width, dtype))
        wide = self._wide()
        ctxv = self._read(ctx, from_columns, (self.ctx_tok, offset, *sizes, dtype), wide)
        if wide:
            set_example(cols)
        self.tok[-1] = (ctx.export(cols), width, dtype)
        return ctxv

    def _wide(self) -> bool:
        # Before the capture with the right widths (see finish), the buffer is too narrow to
        # read a site's columns from: no example values then (nothing is compiled).
        return example(self.ctx_tok).shape[1] >= sum(w for _, w, _ in self.tok)

    def state_in(self, ctx: GraphContext, shape: tuple, dtype) -> fx.Node:
        """The entries' states of one recurrence site, [E, *shape] in ``dtype``."""
        offset = sum(w for _, w, _ in self.state)
        width = 1
        for s in shape:
            width *= int(s)
        self._pending_state = (width, dtype)
        fits = example(self.ctx_state).shape[1] >= offset + width
        return self._read(ctx, _columns_to_state,
                          (self.ctx_state, offset, tuple(int(s) for s in shape), dtype), fits)

    def state_out(self, ctx: GraphContext, exits: fx.Node) -> None:
        """Register a recurrence site's exit states [X, *shape] (after :meth:`state_in`)."""
        width, dtype = self._pending_state
        cols = ctx.graph.call_function(_state_to_columns, (exits,))
        rows = example(self.state_exit)
        mode = getattr(rows, "fake_mode", None)
        if mode is not None:
            # [X, width]: the op's own example would run the recurrence on fake tensors (in a
            # body, and in regional execution's pieces)
            with mode:
                cols.meta["example_value"] = torch.empty(rows.shape[0], width, dtype=dtype,
                                                         device=rows.device)
        self.state.append((ctx.export(cols), width, dtype))


def _extended_row(context: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    return torch.cat([context, own])


def _context_length(part_info: torch.Tensor) -> int:
    return part_info.shape[1]


def _local_parent(parent_ext: torch.Tensor, a) -> torch.Tensor:
    return torch.where(parent_ext >= a, parent_ext - a, torch.full_like(parent_ext, -1))


def _channels_to_columns(x: torch.Tensor) -> torch.Tensor:
    return x[0].transpose(0, 1)


def _columns_to_channels(buf, offset: int, channels: int, dtype) -> torch.Tensor:
    return buf[:, offset:offset + channels].to(dtype).transpose(0, 1).unsqueeze(0)


def _columns_to_state(buf, offset: int, shape: tuple, dtype) -> torch.Tensor:
    width = 1
    for s in shape:
        width *= s
    return buf[:, offset:offset + width].to(dtype).reshape(buf.shape[0], *shape)


def _state_to_columns(states: torch.Tensor) -> torch.Tensor:
    return states.reshape(states.shape[0], -1)


def route_embedding(ctx: GraphContext) -> None:
    """The lookup of the part's ids in the model's input embedding
    (:func:`.shared.input_embedding`) becomes :func:`~treefx.ops.embedding.part_embedding`:
    its gradient goes to the part's ``emb_sink`` rows, which the driver adds into the
    parameter's ``.grad`` at the part's ids, instead of a dense [vocab, D] gradient per part
    (and an ``AccumulateGrad`` pass over it). Returns (the parameter, padding_idx or -1), or
    None where anything else is left as it is."""
    part = ctx.part
    found = input_embedding(ctx)
    if found is None:
        return None
    node, weight, real, pad = found
    w, sink = example(weight), example(part.emb_sink)
    if has_grad_hooks(real) or sink.shape[1] != w.shape[1] or sink.dtype != w.dtype:
        return None
    with ctx.graph.inserting_before(node):
        new = ctx.graph.call_function(part_embedding, (node.args[0], weight, part.emb_sink, pad))
    new.meta.update(node.meta)
    ctx.record("parts", node, describe(new), note="the gradient to the part's rows only")
    node.replace_all_uses_with(new)
    ctx.graph.erase_node(node)
    return real, pad


def finish(ctx: GraphContext) -> PartFindings:
    """Replace the marker by the part's own columns and exit states, then
    :func:`route_embedding` and :func:`route_gradients`; returns what was found (the layout
    the sites need, the gradient buffers added into, the embedding routed). A capture that
    only finds the layout (``Plan.find_layout``) returns it before rewriting. A graph captured
    for its real buffers (not ``Plan.find_layout``) whose buffers have other widths or dtypes
    than its sites need, or ``.grad`` buffers it would not add into, is a
    :class:`PartLayoutMismatch`."""
    part = ctx.part
    layout = part.layout()
    have_tok, have_st = example(part.ctx_tok), example(part.ctx_state)
    routes = _gradient_routes(ctx)
    used = tuple(sorted({k for _, _, k in routes}))
    given = PartLayout(have_tok.shape[1], have_tok.dtype, have_st.shape[1], have_st.dtype)
    plan = ctx.root.plan
    if plan is not None and plan.find_layout:
        return PartFindings(layout, used)  # the graph is never run: nothing to rewrite
    if given != layout or used != tuple(range(len(part.grads))):
        raise PartLayoutMismatch(PartFindings(layout, used))
    g = ctx.graph
    marker = part.marker
    with g.inserting_before(marker):
        ids = marker.args[0]
        own = g.call_function(_concat_columns, ([c for c, _, _ in part.tok], ids,
                                                layout.tok_width, layout.tok_dtype))
        exits = g.call_function(_concat_columns, ([c for c, _, _ in part.state],
                                                  part.state_exit, layout.state_width,
                                                  layout.state_dtype))
    for user in list(marker.users):
        if not (user.op == "call_function" and user.target is operator.getitem):
            raise TreeCompileError("part mode: the marker's results are read other than by "
                                   "index")
        user.replace_all_uses_with(own if user.args[1] == 0 else exits)
        g.erase_node(user)
    g.erase_node(marker)
    embedding = route_embedding(ctx) if plan is None or plan.route_embedding else None
    route_gradients(ctx, routes)
    return PartFindings(layout, used, embedding)


def has_grad_hooks(p: torch.Tensor) -> bool:
    """Whether ``p`` has a gradient hook (``register_hook``, ``register_post_accumulate_grad_
    hook``): its gradient must then reach it through autograd, never be added into ``.grad``
    by treefx."""
    return bool(getattr(p, "_backward_hooks", None)) or \
        bool(getattr(p, "_post_accumulate_grad_hooks", None))


def _gradient_routes(ctx: GraphContext) -> list[tuple[GraphContext, fx.Node, int]]:
    """(graph, node, k): each linear layer (``F.linear``) and fused log-probability site whose
    weight is a trainable parameter given as ``grad_params[k]``, whose ``.grad`` the part was
    called with (the marker's ``grads[k]``), of that weight's shape and dtype, with the input
    in that dtype. None under autocast, or in a graph with an autocast region (a custom op
    runs outside it)."""
    part = ctx.part
    params = list(ctx.grad_params)
    if not part.grads or len(params) != len(part.grads):
        return []
    scopes = list(ctx.scopes())
    if _autocast_on() or any("autocast" in str(n.target).lower() for c in scopes
                             for n in c.graph.nodes if n.op == "call_function"):
        return []
    if ctx.backend not in ("inductor", "aot-eager"):
        # run eagerly, an activation-checkpointed body checks that its operands (a .grad
        # among them) are unchanged when it recomputes; AOTAutograd inlines it
        scopes = [ctx]
    routes = []
    for c in scopes:
        for node in c.graph.nodes:
            if is_call(node, torch.nn.functional.linear, torch._C._nn.linear):
                x, weight = arg(node, 0, "input"), arg(node, 1, "weight")
            elif is_call(node, fused_linear_tree_logprobs) and \
                    node.kwargs.get("grad_into") is None:
                x, weight = arg(node, 0, "h"), arg(node, 1, "weight")
            else:
                continue
            p = trainable_parameter(ctx, c.resolve(weight))
            k = next((i for i, q in enumerate(params) if q is p), None) if p is not None \
                else None
            if k is None:
                continue
            w, xv, buf = example(weight), example(x), example(part.grads[k])
            if w is None or xv is None or buf is None or w.dim() != 2 or \
                    tuple(buf.shape) != tuple(w.shape) or buf.dtype != w.dtype or \
                    xv.dtype != w.dtype:
                continue
            routes.append((c, node, k))
    return routes


def _autocast_on() -> bool:
    """Whether the capture runs under autocast (the caller's ``torch.autocast``): its linear
    layers then compute in the autocast dtype, which a custom op would not."""
    return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))


def route_gradients(ctx: GraphContext, routes) -> None:
    """Each linear layer and fused log-probability site of ``routes``
    (:func:`_gradient_routes`) adds its weight's gradient straight into the parameter's
    ``.grad`` (:mod:`treefx.ops.grad_into`): a part's backward then hands autograd no [out,
    in] gradient per weight for ``AccumulateGrad`` to add (a pass over every weight's gradient
    per part). Uses of the weight by other ops keep autograd's way; both add into the same
    ``.grad``."""
    part = ctx.part
    for c, node, k in routes:
        acc = c.local(part.grads[k])
        g = c.graph
        if node.target is fused_linear_tree_logprobs:
            node.kwargs = {**node.kwargs, "grad_into": acc}
            ctx.record("parts", node, describe(node), note="the weight's gradient into .grad")
            continue
        x, weight = arg(node, 0, "input"), arg(node, 1, "weight")
        bias = arg(node, 2, "bias", None)
        with g.inserting_before(node):
            new = g.call_function(linear_grad_into, (x, weight, bias, acc))
        new.meta.update(node.meta)
        ctx.record("parts", node, describe(new), note="the weight's gradient into .grad")
        node.replace_all_uses_with(new)
        g.erase_node(node)


def _concat_columns(columns: list, like: torch.Tensor, width: int, dtype) -> torch.Tensor:
    """The columns side by side in ``dtype``; [rows of ``like``'s last dim, 0] without any."""
    if not columns:
        return torch.zeros(like.shape[-1], 0, dtype=dtype, device=like.device)
    return torch.cat([c.to(dtype) for c in columns], dim=1)


# ============================================================================ the lowerings

_fail = attention_error


def attention(ctx: GraphContext, site: AttentionSite) -> fx.Node:
    """A site's queries attend over the context's keys and values (from earlier parts) and
    its own; its own are handed on (the general form with the model's score ops)."""
    if site.scored is not None:
        return rewrite_scored(ctx, site, _scored_part)
    return _attention(ctx, site)


def _attention(ctx: GraphContext, site: AttentionSite) -> fx.Node:
    """A site in a part's graph (:func:`treefx.backward`): its queries attend over the
    context's keys and values (from earlier parts) and its own; its own are handed on. The
    model's mask, if any, is lifted and evaluated at the extended row's positions."""
    g = ctx.graph
    part = ctx.part
    with g.inserting_before(site.out):
        k = site.k
        if site.kind == "eager-kT":
            k = g.call_method("transpose", (k, -2, -1))
        mask = mask_value(ctx, site) if site.mask is not None else None
        note = site.kind + ", keys and values of earlier parts' context"
        lifted, bufs = None, ()
        if mask is not None:
            check_mask_sources(ctx, site, mask)
            try:
                lifted, bufs = lift_mask(ctx, mask)
            except MaskLiftError as e:
                raise _fail(site.anchor, "in parts (treefx.backward) the model's own mask is "
                                         "evaluated for keys of earlier parts, and this one "
                                         f"cannot be ({e})") from None
            if implied_by_tree(lifted, bufs):
                lifted, bufs = None, ()
                note += ", model mask implied by the tree"
            else:
                note += ", model mask kept (evaluated at path positions)"
                bufs = _part_buffers(ctx, bufs)
        k, v, shared_kv = kv_for_flex(site, k)
        ck, cv = _part_context(ctx, site, k, v)
        if ctx.backend != "eager" and lifted is None and intervals.wanted(
                example(site.q), example(k), example(v), ctx.options):
            intervals.warm_up(example(site.q), example(k), example(v), ctx.options)
            new = g.call_function(intervals.tree_part_interval_attention,
                                  (site.q, k, v, ck, cv, ctx.parent_token(), site.scale))
            return _replace_site(ctx, site, new, note + INTERVAL_NOTE)
        se, pos = part.ext(ctx, "subtree_end"), part.ext(ctx, "positions")
        if ctx.backend == "eager":
            fn = TreePartAttention(scale=site.scale, enable_gqa=site.enable_gqa or shared_kv,
                                   model_mask=lifted,
                                   name=f"tree_part_attention_{site.anchor.name}")
        else:
            window, more = window_note(lifted)
            note += more
            fn = TreePartFlexAttention(scale=site.scale, block_size=ctx.block_size,
                                       model_mask=lifted, kernel_options=ctx.kernel_options,
                                       interleave_heads=ctx.interleave_heads, window=window,
                                       name=f"tree_part_flex_attention_{site.anchor.name}")
        split = None
        if ctx.backend != "eager" and lifted is None:
            split = trunk_split(ctx, site.q, k, v, offset=lambda c: c.graph.call_function(
                _context_length, (part.part_info,)))
        new = g.call_function(fn, (site.q, k, v, ck, cv, se, pos, *bufs),
                              {} if split is None else {"skip_blocks": split.skip})
        if split is not None:
            new = split.add(ctx, new, site.q, k, v, site.scale)
            note += split.note
    return _replace_site(ctx, site, new, note)


def _replace_site(ctx: GraphContext, site: AttentionSite, new: fx.Node, note: str) -> fx.Node:
    new.meta.update({k_: v_ for k_, v_ in site.out.meta.items()
                     if k_ in ("nn_module_stack", "stack_trace", "example_value")})
    ctx.record("attention", site.anchor, describe(new), note=note)
    site.out.replace_all_uses_with(new)
    return new


def _scored_part(ctx: GraphContext, site: AttentionSite):
    """The general form in a part's graph (:func:`treefx.backward`): FlexAttention over
    ``[context; part]`` keys (its dense eager form on the eager backend), the score ops as a
    ``score_mod`` and a final mask as the ``mask_mod``, both evaluated at the extended row's
    path positions, so a softcap, a bias or a window reads the context's keys as the
    sequence would."""
    g = ctx.graph
    part = ctx.part
    mods = score_mods(ctx, site, in_part=True)
    k = site.k
    if site.kind.endswith("-kT"):
        k = g.call_method("transpose", (k, -2, -1))
    k, v, shared_kv = kv_for_flex(site, k)
    ck, cv = _part_context(ctx, site, k, v)
    se, pos = part.ext(ctx, "subtree_end"), part.ext(ctx, "positions")
    fn = TreePartFlexAttention(scale=mods.scale, block_size=ctx.block_size,
                               model_mask=mods.mask, kernel_options=ctx.kernel_options,
                               score_mod=mods.score_mod, mask_buffers=len(mods.mask_bufs),
                               return_lse=True,
                               interleave_heads=ctx.interleave_heads, window=mods.window,
                               name=f"tree_part_flex_attention_{site.anchor.name}")
    bufs = _part_buffers(ctx, (*mods.mask_bufs, *mods.score_bufs))
    note = mods.note + ", keys and values of earlier parts' context"
    return g.call_function(fn, (site.q, k, v, ck, cv, se, pos, *bufs)), note


def _part_context(ctx: GraphContext, site: AttentionSite, k: fx.Node, v: fx.Node):
    """The context's keys and values of a part's site [1, heads, A, dim] (``k`` and ``v``
    the part's own, registered to be handed on)."""
    kv, vv = example(k), example(v)
    if kv is None or vv is None or kv.dim() != 4 or not same_size(kv.shape[0], 1):
        raise _fail(site.anchor, "in parts (treefx.backward) keys must be [1, heads, "
                                 "tokens, dim]")
    hk, dk, dv = int(kv.shape[1]), int(kv.shape[3]), int(vv.shape[3])
    return ctx.part.context(ctx, k, hk, dk), ctx.part.context(ctx, v, hk, dv)


def _part_buffers(ctx: GraphContext, bufs) -> tuple:
    """A part's mask and score buffers in ``ctx``'s graph. The all-ones padding mask treefx
    gives the model is read at positions of the extended row, which may pass the part's own
    length: it becomes all ones of that length."""
    pos = ctx.part.ext(ctx, "positions")
    return tuple(ctx.graph.call_function(ones_for_positions, (pos, ctx.local(b)))
                 if is_all_ones_input(b) else ctx.local(b) for b in bufs)


# ---------------------------------------------------------------------------- state

class TreeRecurrencePartCall:
    """A registered kernel over one part of a tree (eager backend): returns (what the kernel
    returns, the exit states)."""

    def __init__(self, rec):
        self.rec = rec
        self.__name__ = f"tree_recurrence_part_{rec.name}"

    def __call__(self, parent_local, state_entry, state_exit, context_states, *args, **kwargs):
        return tree_recurrence_part(self.rec, parent_local, state_entry, state_exit,
                                    context_states, args, kwargs)

    def __repr__(self):
        return self.__name__


def _state_spec(rec, node: fx.Node):
    """(shape, dtype) of one node's state for the kernel at ``node``, from a run of the
    kernel on meta tensors of two tokens."""
    bound = rec.bind(fx.map_arg(node.args, example), fx.map_arg(node.kwargs, example))

    def meta(name, v):
        if not isinstance(v, torch.Tensor):
            return v
        shape = [s if isinstance(s, int) else (s.node.hint or 2) for s in v.shape]
        if name in rec.seq_args:
            shape[rec.seq_args[name]] = 2
        return torch.empty(shape, dtype=v.dtype, device="meta")

    args = {k: meta(k, v) for k, v in bound.items()
            if k not in (rec.initial_state, rec.output_final_state)}
    try:
        _, fin = rec.run(**args, **{rec.initial_state: None, rec.output_final_state: True})
    except Exception as e:  # noqa: BLE001
        raise state_error(node, f"in parts (treefx.backward) the state's shape is read from a run "
                               f"of the kernel on meta tensors, which failed ({type(e).__name__}: "
                               f"{e})") from None
    return tuple(int(x) for x in fin.shape[1:]), fin.dtype


def _rewrite_part_recurrence(ctx: GraphContext, node: fx.Node, rec) -> fx.Node:
    part = ctx.part
    g = ctx.graph
    shape, dtype = _state_spec(rec, node)
    with g.inserting_before(node):
        init = part.state_in(ctx, shape, dtype)
        parent = part.parent_local(ctx)
        head = (parent, ctx.local(part.state_entry), ctx.local(part.state_exit), init)
        if ctx.backend == "eager":
            pair = g.call_function(TreeRecurrencePartCall(rec), (*head, *node.args),
                                   node.kwargs)
        else:  # one opaque op under AOTAutograd, as for whole trees
            key, tensors = traced_site(rec, node)
            pair = g.call_function(TracedTreeRecurrencePart(key), (*head, *tensors))
        new = g.call_function(operator.getitem, (pair, 0))
        exits = g.call_function(operator.getitem, (pair, 1))
        _example_outputs(node, new, exits, part.state_exit, shape, dtype)
        part.state_out(ctx, exits)
    return new


def _example_outputs(node, new, exits, state_exit, shape, dtype) -> None:
    """Example values of a part recurrence's outputs (what the kernel returned; the exit
    states [X, *shape]), so that regional execution reads them instead of running the
    recurrence on fake tensors (an eager one reads the tree on the host)."""
    rows = example(state_exit)
    mode = getattr(rows, "fake_mode", None)
    value = node.meta.get("example_value")
    if mode is None or value is None:
        return
    with mode:
        states = torch.empty(rows.shape[0], *shape, dtype=dtype, device=rows.device)
    new.meta["example_value"] = value
    exits.meta["example_value"] = states


def recurrence(ctx: GraphContext, site: RecurrenceSite) -> fx.Node:
    """A registered kernel over the part: each entry's state from the context, the exit
    states handed on."""
    ctx.parent_token()  # (the shared node every recurrence site of the graph reads)
    with ctx.graph.inserting_before(site.node):
        new = _rewrite_part_recurrence(ctx, site.node, site.rec)
    return replace_recurrence(ctx, site, new)


def path_sum(ctx: GraphContext, site: PathSumSite):
    """Not supported in parts: an error naming the node."""
    raise state_error(site.node, "in parts (treefx.backward) a cumulative sum along the "
                                 "tokens (positions the model counts itself) is not "
                                 "supported yet; pass position ids (pass_position_ids=True)")


def conv(ctx: GraphContext, site: ConvSite) -> fx.Node:
    """A causal conv1d over the context's inputs (from earlier parts) and the part's own."""
    g = ctx.graph
    x, node = site.x, site.conv
    ctx.parent_token()  # (as for a whole tree)
    with g.inserting_before(site.cut):
        xv = example(x)
        if xv.dim() != 3 or not same_size(xv.shape[0], 1):
            raise state_error(node, "in parts (treefx.backward) a conv's input must be "
                                    "[1, channels, tokens]")
        cx = ctx.part.channels(ctx, x, int(xv.shape[1]))
        new = g.call_function(tree_causal_conv1d_context,
                              (cx, x, site.weight, site.bias, ctx.part.ext(ctx, "parent")))
    return replace_conv(ctx, site, new)


# ---------------------------------------------------------------------------- key selection

def key_selection(ctx: GraphContext, site: KeySelectionSite):
    """Not supported in parts: an error naming the top-k."""
    raise selection_error(site.topk, "is not supported in parts (treefx.backward with "
                                     "max_tokens): the selection would need the earlier "
                                     "parts' index keys; train this model on whole batches")


# ---------------------------------------------------------------------------- loss

def loss(ctx: GraphContext, site: LossSite) -> fx.Node:
    """A part predicts the tokens whose predecessor it holds: label row, token id and weight
    for each (its own tokens and the first ones of later parts)."""
    parent, ids = (ctx.shared(("part_label", i), lambda c, i=i: c.graph.call_function(
        operator.getitem, (c.part_labels, i))) for i in (0, 1))
    return emit_loss(ctx, site, parent, ids)


def logprobs(ctx: GraphContext, site: LogprobsSite) -> fx.Node:
    """The part's log-probabilities (a part's labels are mostly trained tokens)."""
    return emit_logprobs(ctx, site, in_part=True)


_LOWERINGS = {AttentionSite: attention, RecurrenceSite: recurrence, PathSumSite: path_sum,
              ConvSite: conv, KeySelectionSite: key_selection, LossSite: loss,
              LogprobsSite: logprobs}


def lower(ctx: GraphContext, site) -> None:
    """Lower one site of any kind for a part of a tree."""
    _LOWERINGS[type(site)](ctx, site)
