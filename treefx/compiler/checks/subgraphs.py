"""Bodies of higher-order ops: activation checkpointing, ``wrap``, ``cond`` branches, ...

Dynamo captures an activation-checkpointed region (Hugging Face gradient checkpointing with
either ``use_reentrant``, ``torch.utils.checkpoint`` in user code, a selective policy) as a call
of the higher-order op ``tag_activation_checkpoint`` whose body is a graph module of its own;
``wrap``, ``invoke_subgraph``, grad-mode and autocast regions and the branches of ``cond`` look
the same. Such a body runs once on its operands, so the passes rewrite inside it exactly as at
top level. The tree tensors enter a body as extra operands of its calls (a graph input added by
hand would break AOTAutograd; an operand is an ordinary value the body receives), so a
checkpointed region recomputes nothing of the tree's masks in the backward.

Every other higher-order op (``scan``, ``map``, ``while_loop``, ``associative_scan``, custom
autograd functions, a model's own ``flex_attention``) runs its body some other way than once on
its operands: whatever touches the tokens inside it cannot be rewritten, so one that sees a
token axis stops compilation (:func:`check_opaque_ops`), except a custom ``autograd.Function``
that is elementwise in its forward and its backward (an activation written by hand).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..graph import (
    GraphContext,
    TreeCompileError,
    describe,
    example,
    module_path,
    same_size,
)

__all__ = ["discover", "prune", "check_opaque_ops", "opaque_ops",
           "UnsupportedSubgraphError"]


class UnsupportedSubgraphError(TreeCompileError):
    """A higher-order op treefx cannot see into runs over the tokens."""


@dataclass(frozen=True)
class _Kind:
    """Where a higher-order op's bodies and operands sit in its call's arguments: bodies at
    ``bodies``, operands from ``first`` on (or, with ``packed``, as one tuple at ``first``)."""

    bodies: tuple[int, ...]
    first: int
    packed: bool = False

    def operands(self, call: fx.Node) -> list:
        return list(call.args[self.first]) if self.packed else list(call.args[self.first:])

    def set_operands(self, call: fx.Node, operands: list) -> None:
        args = list(call.args)
        if self.packed:
            args[self.first] = type(call.args[self.first])(operands)
            call.args = tuple(args)
        else:
            call.args = tuple(args[: self.first]) + tuple(operands)


# Higher-order ops whose bodies run once on their operands (``cond`` runs one of two).
_KINDS = {
    "tag_activation_checkpoint": _Kind((0,), 1),
    "wrap": _Kind((0,), 1),
    "wrap_with_set_grad_enabled": _Kind((1,), 2),
    "wrap_with_autocast": _Kind((4,), 5),
    "invoke_subgraph": _Kind((0,), 2),
    "cond": _Kind((1, 2), 3, packed=True),
}


def _hop_name(node: fx.Node) -> str | None:
    t = node.target
    if node.op == "call_function" and isinstance(t, torch._ops.HigherOrderOperator):
        return t.name()
    return None


@dataclass(eq=False)
class Body:
    """How a body graph is called: the call nodes in the enclosing graph (one, or several
    calls of one shared body), the op's kind, and the bodies that share those calls' operands
    (both branches of a ``cond``), which must take the same placeholders."""

    kind: _Kind
    op: str
    sites: list[fx.Node] = field(default_factory=list)
    group: list[GraphContext] = field(default_factory=list)

    def placeholders(self, ctx: GraphContext) -> list[fx.Node]:
        return [n for n in ctx.graph.nodes if n.op == "placeholder"]

    def outer(self, ph: fx.Node):
        """The operand every call passes for placeholder ``ph`` (None when they differ)."""
        ctx = next(c for c in self.group if c.graph is ph.graph)
        i = self.placeholders(ctx).index(ph)
        values = {id(self.kind.operands(s)[i]): self.kind.operands(s)[i] for s in self.sites}
        return next(iter(values.values())) if len(values) == 1 else None


def discover(ctx: GraphContext) -> None:
    """Make a child context for every body of a higher-order op in ``ctx``'s graph (and in
    theirs, recursively). Bodies of ops treefx cannot see into are left to
    :func:`check_opaque_ops`."""
    bodies: dict[int, GraphContext] = {}
    for node in ctx.graph.nodes:
        name = _hop_name(node)
        kind = _KINDS.get(name)
        if kind is None:
            continue
        members = []
        for i in kind.bodies:
            attr = node.args[i]
            if not (isinstance(attr, fx.Node) and attr.op == "get_attr"):
                raise UnsupportedSubgraphError(
                    f"the {name} at {module_path(node)} (graph node `{describe(node)}`) has no "
                    "body graph treefx can read")
            gm = _attr(ctx.gm, attr.target)
            child = bodies.get(id(gm))
            if child is None:
                child = _child(ctx, gm, attr.target, kind, name)
                bodies[id(gm)] = child
            elif child.body.kind != kind:
                raise UnsupportedSubgraphError(
                    f"the body {attr.target} is called by different higher-order ops")
            members.append(child)
        for child in members:
            if node not in child.body.sites:
                child.body.sites.append(node)
        group = list(dict.fromkeys(c for m in members for c in m.body.group)) or members
        for m in members:
            if m not in group:
                group.append(m)
        for m in group:
            m.body.group = group
        for child in members:
            n_ph = len(child.body.placeholders(child))
            n_op = len(kind.operands(node))
            if n_ph != n_op:
                raise UnsupportedSubgraphError(
                    f"the {name} at {module_path(node)} passes {n_op} operands to a body with "
                    f"{n_ph} inputs; treefx cannot map them")
    for child in bodies.values():
        discover(child)


def _attr(gm: fx.GraphModule, target: str) -> fx.GraphModule:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, fx.GraphModule):
        raise UnsupportedSubgraphError(f"{target} is not a graph module")
    return obj


def _child(ctx: GraphContext, gm: fx.GraphModule, target: str, kind: _Kind,
           op: str) -> GraphContext:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not placeholders:
        raise UnsupportedSubgraphError(f"the body {target} takes no inputs")
    child = GraphContext(
        gm, ctx.backend, input_ids=ctx.root_node("input_ids"),
        tree_info=ctx.root_node("tree_info"), positions=ctx.root_node("positions"),
        subtree_end=ctx.root_node("subtree_end"), seq_len=ctx.seq_len, prelude=placeholders[-1],
        tree_weights=ctx.root_node("tree_weights"), parent=ctx,
        name=f"{ctx.name}.{target}" if ctx.name else target, body=Body(kind, op),
    )
    return child




def prune(ctx: GraphContext, eliminate_dead_code) -> None:
    """Dead code out of every graph, inner bodies first, and the inputs a body no longer
    reads out of it and out of its calls (so the enclosing graph can then drop what fed
    them)."""
    for child in ctx.children:
        prune(child, eliminate_dead_code)
    groups = {id(c.body.group[0]): c.body.group[0].body for c in ctx.children}
    for body in groups.values():
        _drop_unused_inputs(body)
    eliminate_dead_code(ctx.graph)


def _drop_unused_inputs(body: Body) -> None:
    lists = [body.placeholders(m) for m in body.group]
    if not lists or any(len(p) != len(lists[0]) for p in lists):
        return
    unused = [
        i for i in range(len(lists[0]))
        if all(not p[i].users and isinstance(example(p[i]), torch.Tensor) for p in lists)
    ]
    if not unused:
        return
    for site in body.sites:
        ops = body.kind.operands(site)
        body.kind.set_operands(site, [a for i, a in enumerate(ops) if i not in unused])
    for m, phs in zip(body.group, lists):
        for i in reversed(unused):
            m.graph.erase_node(phs[i])
        m.forget_erased_imports()


def opaque_ops(ctx: GraphContext):
    """Higher-order-op calls in ``ctx``'s graph whose bodies treefx does not rewrite."""
    for node in ctx.graph.nodes:
        name = _hop_name(node)
        if name is not None and name not in _KINDS:
            yield name, node


_POINTWISE_FUNCS = {
    operator.mul, operator.add, operator.sub, operator.truediv, operator.neg, operator.pow,
    torch.mul, torch.add, torch.sub, torch.div, torch.neg, torch.pow, torch.tanh, torch.sigmoid,
    torch.exp, torch.log, torch.erf, torch.sqrt, torch.rsqrt, torch.abs, torch.relu,
    torch.nn.functional.gelu, torch.nn.functional.silu, torch.nn.functional.relu,
    torch._C._set_grad_enabled,
}
_POINTWISE_METHODS = {"mul", "add", "sub", "div", "neg", "pow", "tanh", "sigmoid", "exp", "log",
                      "sqrt", "rsqrt", "abs", "relu", "to", "float", "type_as"}


def _pointwise_function(ctx: GraphContext, node: fx.Node) -> bool:
    """A custom ``autograd.Function`` that is elementwise on same-shape tensors (Bloom's GeLU):
    its forward and backward bodies use elementwise ops only, and every tensor its forward
    takes and returns has one shape, so its backward's inputs (the output gradients and
    saved forward values) do too. Such a function treats each token alone, like any
    elementwise op on the row."""
    bodies = []
    for i in (0, 1):
        attr = node.args[i] if len(node.args) > i else None
        if not (isinstance(attr, fx.Node) and attr.op == "get_attr"):
            return False
        try:
            bodies.append(_attr(ctx.gm, attr.target).graph)
        except UnsupportedSubgraphError:
            return False
    for g in bodies:
        for n in g.nodes:
            if n.op in ("placeholder", "output"):
                continue
            if n.op == "call_function" and n.target in _POINTWISE_FUNCS:
                continue
            if n.op == "call_method" and n.target in _POINTWISE_METHODS:
                continue
            return False
    fwd = bodies[0]
    shapes = set()
    for n in fwd.nodes:
        if n.op == "output":
            continue
        v = example(n)
        if isinstance(v, torch.Tensor):
            shapes.add(tuple(str(s) for s in v.shape))
        elif n.op == "placeholder" and not isinstance(v, (torch.SymInt, int)):
            return False  # an input without a recorded value
    return len(shapes) == 1


_WHY = {
    "flex_attention": "the model calls flex_attention itself; treefx does not rewrite a "
                      "model's own flex_attention yet",
    "associative_scan": "an associative scan runs along the tokens (a recurrence, e.g. Mamba's "
                        "selective scan), and treefx cannot route its state through the tree",
    "scan": "a scan runs along the tokens (a recurrence), and treefx cannot route its state "
            "through the tree",
    "while_loop": "a while_loop's body runs over the tokens some number of times",
    "map_impl": "a map runs its body over slices of the tokens",
    "autograd_function_apply": "a custom autograd.Function whose forward and backward are not "
                               "both elementwise on tensors of one shape is opaque to treefx "
                               "(it cannot tell whether they mix tokens)",
}


def check_opaque_ops(ctx: GraphContext) -> None:
    """A higher-order op treefx does not see into may only touch values without a token axis."""
    n = ctx.seq_len
    for name, node in opaque_ops(ctx):
        if name == "autograd_function_apply" and _pointwise_function(ctx, node):
            continue
        values = [example(a) for a in node.all_input_nodes] + [example(node)]
        flat = []
        for v in values:
            fx.node.map_aggregate(v, lambda x: flat.append(x) if isinstance(x, torch.Tensor)
                                  else None)
        if any(any(same_size(s, n) for s in t.shape) for t in flat):
            why = _WHY.get(name, f"treefx does not know how the higher-order op {name} runs "
                                 "its body")
            raise UnsupportedSubgraphError(
                f"treefx cannot rewrite the {name} at {module_path(node)} (graph node "
                f"`{describe(node)}`): {why}. Running it over the tree's DFS row would mix "
                "sequences, so compilation stops here.",
                node=node,
            )

