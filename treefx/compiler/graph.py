"""What every pass shares: the graph context, node descriptions, errors, the rewrite log."""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..options import Options
from ..plan import Plan

__all__ = [
    "TreeCompileError",
    "UnmatchedAttentionError",
    "UnmatchedStateError",
    "GraphBreakError",
    "TokenAxisError",
    "SpecializedGraphError",
    "attention_error",
    "state_error",
    "token_axis_error",
    "selection_error",
    "Rewrite",
    "GraphContext",
    "module_path",
    "source_line",
    "describe",
    "example",
    "same_size",
    "is_call",
    "on_sequence",
    "arg",
    "graph_code",
    "set_example",
]


# Marks the nodes of a key selection the selection pass rewrote (a top-k over the keys of a
# score row, the reads of its indices, their scatter into a mask): the token-axis check and
# the attention pass's mask check leave them to that pass (see find/selection.py).
KEY_SELECTION = "treefx_key_selection"


class TreeCompileError(RuntimeError):
    """treefx cannot turn this model into an exact tree computation.

    When one graph node is the cause, ``node`` is its description (``name = target(args)``),
    ``node_name`` its name in the captured graph, ``module`` the path of the module that made
    it and ``source`` the model's source line (``file:line  code``); otherwise all are None.
    """

    def __init__(self, message: str, *, node: fx.Node | None = None):
        super().__init__(message)
        self.node = describe(node) if node is not None else None
        self.node_name = node.name if node is not None else None
        self.module = module_path(node) if node is not None else None
        self.source = (source_line(node) or None) if node is not None else None


class UnmatchedAttentionError(TreeCompileError):
    """An attention- or state-like op that treefx cannot rewrite for the tree.

    An attention- or state-like op that no pass can rewrite: running it over the DFS row
    as it is would silently mix sequences."""


class UnmatchedStateError(UnmatchedAttentionError):
    """An op along the sequence (a conv, a recurrence) that treefx cannot route through the tree.

    A conv, recurrence or other op along the sequence that no pass can route through the
    tree."""


class TokenAxisError(UnmatchedStateError):
    """An op moves data along the tokens in a way no pass rewrote."""


class SpecializedGraphError(TokenAxisError):
    """The graph was specialized to one token count."""

    def __init__(self, ctx: GraphContext):
        super().__init__(
            f"the captured graph is specialized to {int(ctx.seq_len)} tokens: the model's code "
            "reads the token count as a Python number (a Python loop over the sequence, which "
            "Dynamo unrolls, or a shape turned into an int). treefx cannot prove what such a "
            "graph does along the tokens, so compilation stops here."
        )


def attention_error(node: fx.Node, why: str) -> UnmatchedAttentionError:
    """The error for an attention at ``node`` that treefx cannot rewrite, saying ``why``."""
    return UnmatchedAttentionError(
        f"treefx cannot rewrite the attention at {module_path(node)} (graph node "
        f"`{describe(node)}`): {why}. Running it unchanged over the tree's DFS row would mix "
        "sequences, so compilation stops here.",
        node=node,
    )


def state_error(node: fx.Node, why: str) -> UnmatchedStateError:
    """The error for sequence state at ``node`` that treefx cannot route through the tree."""
    return UnmatchedStateError(
        f"treefx cannot route the sequence state at {module_path(node)} (graph node "
        f"`{describe(node)}`) through the tree: {why}. Running it over the DFS row would carry "
        "state from one branch into the next, so compilation stops here.",
        node=node,
    )


def token_axis_error(node: fx.Node, why: str) -> TokenAxisError:
    """The error for an op at ``node`` that moves data along the tokens."""
    return TokenAxisError(
        f"treefx cannot run the op at {module_path(node)} (graph node `{describe(node)}`) on a "
        f"tree: {why}. On the tree's DFS row the neighbouring tokens belong to other "
        "sequences, so compilation stops here.",
        node=node,
    )


def selection_error(node: fx.Node, why: str) -> TokenAxisError:
    """The error for a top-k over the keys of a score row that treefx refuses, saying why."""
    return token_axis_error(node, f"a top-k over the keys of a [.., N, N] score row {why}")


class GraphBreakError(TreeCompileError):
    """The model could not be captured as one graph.

    ``breaks``: Dynamo's reasons, one per
    break, each with its ``file:line`` where known."""

    def __init__(self, message: str, *, breaks: list[str] = ()):
        super().__init__(message)
        self.breaks = list(breaks)


@dataclass
class Rewrite:
    """One node a pass changed (or left alone: ``after`` is empty and ``note`` says why), for
    reports and logs."""

    pass_name: str
    node: str
    before: str
    after: str
    module: str
    source: str
    note: str = ""

    @property
    def kept(self) -> bool:
        return not self.after


_MODULE_PREFIX = re.compile(r"^(?:L|G)\[['\"][^'\"]*['\"]\](?:\.|$)")


def module_path(node: fx.Node) -> str:
    """Path of the innermost module that produced ``node``, relative to the user's model
    (``model.layers.3.self_attn``), or ``<model>`` at the top."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<model>"
    path = list(stack.values())[-1][0]
    # Dynamo names modules by how the traced function reached them: L['model'].layers.0 or
    # G['model']._modules['layers']... Keep the part inside the user's model.
    path = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    path = re.sub(r"\[['\"]?(\w+)['\"]?\]", r".\1", _MODULE_PREFIX.sub("", path))
    return path.strip(".") or "<model>"


def source_line(node: fx.Node) -> str:
    """``file:line code`` of the user code that made ``node`` (last frame of its trace)."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        m = re.match(r'File "([^"]+)", line (\d+)', lines[i])
        if m:
            code = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{m.group(1).rsplit('/', 1)[-1]}:{m.group(2)}  {code}"
    return ""


def _target_name(node: fx.Node) -> str:
    t = node.target
    if node.op == "call_method":
        return f".{t}"
    if node.op == "call_module":
        return f"module {t}"
    if isinstance(t, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return f"torch.ops.{t}"
    name = getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or str(t)
    mod = getattr(t, "__module__", "") or ""
    if mod.startswith("torch"):
        mod = {"torch._C._nn": "torch.nn.functional", "torch._C": "torch"}.get(mod, mod)
        return f"{mod}.{name}" if not name.startswith(mod) else name
    return name


def describe(node: fx.Node) -> str:
    """A short readable form of a node: ``name = target(args...)``."""

    def fmt(a):
        if isinstance(a, fx.Node):
            return a.name
        if isinstance(a, (list, tuple)):
            inner = ", ".join(fmt(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner})"
        if isinstance(a, float):
            return f"{a:.6g}"
        return repr(a)

    args = [fmt(a) for a in node.args] + [f"{k}={fmt(v)}" for k, v in node.kwargs.items()]
    return f"{node.name} = {_target_name(node)}({', '.join(args)})"


def example(node) -> torch.Tensor | None:
    """The example (fake) value Dynamo recorded for a node, if any."""
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def same_size(a, b) -> bool:
    """Whether two (possibly symbolic) sizes are provably equal."""
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a == b))
    return a == b


def arg(node: fx.Node, i: int, name: str, default=None):
    """Argument ``i`` of a call, given positionally or as ``name=``."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def on_sequence(ctx: GraphContext, node, dim: int = -1) -> bool:
    """Whether axis ``dim`` of ``node``'s value is the token axis (its size is N)."""
    val = example(node)
    return val is not None and val.dim() > 0 and same_size(val.shape[dim], ctx.seq_len)


def is_call(node, *targets, methods: tuple[str, ...] = ()) -> bool:
    """``node`` calls one of ``targets`` (functions) or one of ``methods`` (tensor methods)."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return node.target in targets
    if node.op == "call_method":
        return node.target in methods
    return False


class GraphContext:
    """One graph the passes rewrite: the captured graph (the root) or the body of a
    higher-order op inside it (an activation-checkpointed region, a ``wrap``, a ``cond``
    branch; see :mod:`.checks.subgraphs`), with the tree tensors wired into it.

    ``positions``, ``subtree_end``, ``parent_token()``: [N] int64 nodes of *this* graph. In the
    root they are read from the graph input ``tree_info``; in a body they are placeholders that
    the body's callers feed with the root's nodes (added on first use: :meth:`local`).
    ``seq_len``: N as the graph knows it (a SymInt under dynamic shapes; the bodies share the
    root's symbols).
    """

    def __init__(self, gm: fx.GraphModule, backend: str, *, input_ids: fx.Node,
                 tree_info: fx.Node, positions: fx.Node, subtree_end: fx.Node, seq_len,
                 prelude: fx.Node, tree_weights: fx.Node | None = None,
                 part_labels: fx.Node | None = None, code_before: str = "",
                 modules_before: dict | None = None,
                 parent: GraphContext | None = None, name: str = "", plan=None,
                 real_inputs: tuple = (), part_sites=None, body=None):
        self.gm = gm
        # root only: the capture's Plan (treefx.plan; the defaults for a graph built by hand)
        # and its real inputs by position, the parameters among them (None elsewhere); a body
        # reads its root's (block_size, kernel_options, interleave_heads, options)
        self.plan = plan if plan is not None or parent is not None else Plan()
        self.real_inputs = tuple(real_inputs)
        self.backend = backend
        self.seq_len = seq_len
        # The last node of the graph's prelude: treefx's own nodes after the placeholders.
        # Shared nodes go right after it (never "before the model's first node": a pass may
        # erase that node, an arange, and an insertion before an erased node is lost).
        self.prelude = prelude
        self.code_before = code_before  # the captured graph's code before any pass ran
        self.modules_before = dict(modules_before or {})  # node name -> module path, before
        self.done = False  # every pass ran and the graph was handed to the backend
        self.parent = parent
        self.name = name  # the body's attribute path ("" for the root)
        self.children: list[GraphContext] = []
        if parent is not None:
            parent.children.append(self)
        self.log: list[Rewrite] = parent.log if parent is not None else []
        self._root_nodes = {"input_ids": input_ids, "tree_info": tree_info,
                            "positions": positions, "subtree_end": subtree_end,
                            "tree_weights": tree_weights, "part_labels": part_labels}
        self._cache: dict = {}
        # Bodies: how this graph's placeholders map to its callers' operands (a
        # .checks.subgraphs.Body, given by .checks.subgraphs.discover); ``_imports`` maps an
        # outer node to the placeholder made for it.
        self.body = body
        self._imports: dict = {}
        self._loss_sites = 0  # root: the cross-entropies the loss pass rewrote (all graphs)
        self._input_positions: dict | None = None
        self._part = part_sites  # root only: the part-mode sites (.lower.parts), None outside parts

    def note_loss_site(self) -> None:
        """Count one cross-entropy the loss pass rewrote (in this graph or a body)."""
        self.root._loss_sites += 1

    @property
    def loss_sites(self) -> int:
        """How many cross-entropies the loss pass rewrote, over the root and its bodies."""
        return self.root._loss_sites

    def input_position(self, node) -> int | None:
        """The position of placeholder ``node`` among the root graph's inputs (the index of its
        real input, :attr:`real_inputs`), else None."""
        root = self.root
        if root._input_positions is None:  # built once: asked for every linear layer
            root._input_positions = {n: i for i, n in enumerate(
                n for n in root.graph.nodes if n.op == "placeholder")}
        return root._input_positions.get(node)

    @property
    def grad_params(self) -> tuple:
        """The parameters whose ``.grad`` a part's graph is given (the plan's), else ()."""
        return tuple(self.root.plan.grad_params)

    @property
    def block_size(self) -> int:
        """FlexAttention's block size (the plan's)."""
        return self.root.plan.block_size

    @property
    def kernel_options(self) -> dict:
        """FlexAttention's kernel options for every site (the plan's; a copy)."""
        return dict(self.root.plan.kernel_options)

    @property
    def interleave_heads(self) -> bool | None:
        """KV heads along the row (the plan's; None: where gradients are computed)."""
        return self.root.plan.interleave_heads

    @property
    def options(self) -> Options:
        """The capture's ``TREEFX_*`` switches (:class:`treefx.options.Options`, the plan's)."""
        return self.root.plan.options

    @property
    def part(self):
        """The :class:`.lower.parts.PartSites` of a part's graph (:func:`treefx.backward`), else
        None."""
        return self.root._part

    # ------------------------------------------------------------------ scopes

    @property
    def root(self) -> GraphContext:
        return self if self.parent is None else self.parent.root

    def scopes(self):
        """This graph and every body inside it, outer before inner."""
        yield self
        for c in self.children:
            yield from c.scopes()

    def local(self, node):
        """``node`` (of this graph or of an enclosing one) as a node of this graph: a body
        gets a new placeholder, fed by its callers, on first use."""
        if not isinstance(node, fx.Node) or node.graph is self.graph:
            return node
        if self.parent is None:
            raise TreeCompileError(f"node {node.name} belongs to no enclosing graph")
        return self._import_operand(self.parent.local(node))

    def _import_operand(self, outer: fx.Node) -> fx.Node:
        """The placeholder of body ``ctx`` for ``outer`` (a node of the enclosing graph), added
        to every body of its group and passed by every call on first use."""
        if outer in self._imports:
            return self._imports[outer]
        body = self.body
        for member in body.group:
            phs = body.placeholders(member)
            g = member.graph
            with g.inserting_after(phs[-1]):
                ph = g.placeholder(f"treefx_{outer.name}")
            if member.prelude is phs[-1]:
                member.prelude = ph
            value = example(outer)
            if value is not None:
                ph.meta["example_value"] = value
            member._imports[outer] = ph
        for site in body.sites:
            body.kind.set_operands(site, [*body.kind.operands(site), outer])
        return self._imports[outer]

    def export(self, node: fx.Node) -> fx.Node:
        """``node`` (of this graph) as a node of the root graph: in a body, an extra output of
        the body, read from its call (and so on outwards). Only a body with one call site can
        hand a value out (the call must say which run of the body it comes from)."""
        if self.parent is None:
            return node
        body = self.body
        if len(body.sites) != 1 or len(body.group) != 1:
            raise TreeCompileError(
                f"the {body.op} body {self.name} is called {len(body.sites)} time(s) with "
                f"{len(body.group)} branch(es); treefx hands a value out of a body only when "
                "it has one call and one branch", node=node)
        out = next(n for n in reversed(self.graph.nodes) if n.op == "output")
        site = body.sites[0]
        values = out.args[0]
        before = site.meta.get("example_value")
        if not isinstance(values, (tuple, list)) or not isinstance(before, (tuple, list)):
            raise TreeCompileError(
                f"the {body.op} body {self.name} returns no tuple; treefx cannot add an "
                "output to it", node=node)
        with self.graph.inserting_before(out):
            # a fresh tensor: a higher-order op may not return a view of its inputs
            value = self.graph.call_method("clone", (node,))
        set_example(value)
        out.args = (type(values)([*values, value]),)
        site.meta["example_value"] = type(before)([*before, example(value)])
        g = self.parent.graph
        with g.inserting_after(site):
            read = g.call_function(operator.getitem, (site, len(values)))
        set_example(read)
        return self.parent.export(read)

    def resolve(self, node):
        """The node a body placeholder stands for, through every enclosing graph (the
        placeholder itself when its callers do not all pass the same node)."""
        ctx = self
        while ctx is not None and isinstance(node, fx.Node) and node.graph is not ctx.graph:
            ctx = ctx.parent  # a node of an enclosing graph
        while ctx is not None and isinstance(node, fx.Node) and node.op == "placeholder" \
                and ctx.body is not None:
            outer = ctx.body.outer(node)
            if outer is None:
                return node
            node, ctx = outer, ctx.parent
        return node

    def root_node(self, key: str) -> fx.Node | None:
        """The root graph's own node for ``key`` (``input_ids``, ``tree_info``, ``positions``,
        ``subtree_end``, ``tree_weights``, ``part_labels``; None where the graph has none), not
        imported into this graph: the properties of the same names give this graph's."""
        return self.root._root_nodes[key]

    def forget_erased_imports(self) -> None:
        """Forget the placeholders made for outer nodes (:meth:`local`) that are no longer
        nodes of this graph (a body's unused inputs, erased)."""
        self._imports = {k: v for k, v in self._imports.items()
                         if v.graph is self.graph and v in self.graph.nodes}

    def _tree_node(self, key: str):
        node = self.root_node(key)
        return None if node is None else self.local(node)

    @property
    def input_ids(self) -> fx.Node:
        return self._tree_node("input_ids")

    @property
    def tree_info(self) -> fx.Node:
        return self._tree_node("tree_info")

    @property
    def positions(self) -> fx.Node:
        return self._tree_node("positions")

    @property
    def subtree_end(self) -> fx.Node:
        return self._tree_node("subtree_end")

    @property
    def tree_weights(self) -> fx.Node | None:
        return self._tree_node("tree_weights")

    @property
    def part_labels(self) -> fx.Node | None:
        """A part's predicted tokens [2, m] (predecessor row in the part, token id), None
        outside parts (see :func:`treefx.parts.part_tensors`)."""
        return self._tree_node("part_labels")

    @property
    def is_step(self) -> bool:
        """A training step: the graph has loss weights (``tree_weights``) to rewrite into."""
        return self.root_node("tree_weights") is not None

    def is_tree_input(self, node, key: str) -> bool:
        """Whether ``node`` (resolved through body placeholders) is the root's ``key`` node."""
        root = self.root_node(key)
        return root is not None and self.resolve(node) is root

    # ------------------------------------------------------------------ graph

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def record(self, pass_name: str, node: fx.Node, after: str, note: str = "") -> None:
        where = f" (in checkpointed/subgraph body {self.name})" if self.name else ""
        self.log.append(
            Rewrite(pass_name, node.name, describe(node), after, module_path(node),
                    source_line(node), note + where if note or where else note)
        )

    def keep(self, pass_name: str, node: fx.Node, why: str) -> None:
        """Record a node that looks relevant to a pass but is correct as it is."""
        self.record(pass_name, node, "", note=why)

    @property
    def code_after(self) -> str:
        return graph_code(self.gm)

    def parent_token(self) -> fx.Node:
        """The [N] ``parent_token`` row of ``tree_info``, one node for all passes."""
        return self.shared("parent_token", lambda c: c.graph.call_function(
            operator.getitem, (c.tree_info, 1)))

    def shared(self, key, make, example: bool = True):
        """A node built once (before the model's first op of the root graph) by
        ``make(root_context)`` and reused by every site; bodies import it as an operand, so a
        checkpointed region does not rebuild the tree's masks in its recomputation.
        ``example``: record its example value (off for one that cannot be computed yet)."""
        root = self.root
        if key not in root._cache:
            successor = root.prelude.next
            with root.graph.inserting_before(successor):
                node = make(root)
            root.prelude = successor.prev
            if example and isinstance(node, fx.Node) and "example_value" not in node.meta:
                set_example(node)
            root._cache[key] = node
        value = root._cache[key]
        if isinstance(value, tuple):
            return tuple(self.local(v) for v in value)
        return self.local(value)


def set_example(node: fx.Node) -> None:
    """Record a fake example value for a node treefx added (and for its inputs that lack
    one), by running its target on its inputs' example values. A placeholder made for a body
    carries its operand's example value, so nodes passed into bodies need one.

    Run as Dynamo runs ops when it traces (with the Python dispatcher, so composite ops such
    as ``matmul`` decompose in Python with size-oblivious checks): torch 2.11's C++
    ``matmul`` of 4-D tensors otherwise guards the token count to its example value, which
    specializes the whole graph."""
    from torch._dispatch.python import enable_python_dispatcher

    if not isinstance(node, fx.Node) or example(node) is not None:
        return
    for a in node.all_input_nodes:
        set_example(a)
    args = fx.map_arg(node.args, example)
    kwargs = fx.map_arg(node.kwargs, example)
    vals = _tensors((args, kwargs))
    mode = next((getattr(v, "fake_mode", None) for v in vals
                 if getattr(v, "fake_mode", None) is not None), None)
    if mode is None:
        return
    with mode, enable_python_dispatcher():
        if node.op == "call_function":
            node.meta["example_value"] = node.target(*args, **kwargs)
        elif node.op == "call_method":
            node.meta["example_value"] = getattr(args[0], node.target)(*args[1:], **kwargs)


def _tensors(x) -> list:
    out = []
    fx.node.map_aggregate(x, lambda v: out.append(v) if isinstance(v, torch.Tensor) else None)
    return out


def graph_code(gm: fx.GraphModule) -> str:
    """The code of a graph module and of every graph module inside it (the bodies of
    higher-order ops), each under a header naming it."""
    parts = [gm.code]
    for name, sub in gm.named_modules():
        if name and isinstance(sub, fx.GraphModule):
            parts.append(f"\n# ---- body {name} ----{sub.code}")
    return "".join(parts)
