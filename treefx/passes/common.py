"""What every pass shares: the graph context, node descriptions, errors, the rewrite log."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx

__all__ = [
    "TreeCompileError",
    "UnmatchedAttentionError",
    "GraphBreakError",
    "Rewrite",
    "GraphContext",
    "module_path",
    "source_line",
    "describe",
    "example",
    "same_size",
    "is_call",
    "arg",
]


class TreeCompileError(RuntimeError):
    """treefx cannot turn this model into an exact tree computation."""


class UnmatchedAttentionError(TreeCompileError):
    """An attention- or state-like op that no pass can rewrite: running it over the DFS row
    as it is would silently mix sequences."""


class GraphBreakError(TreeCompileError):
    """The model could not be captured as one graph."""


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


def is_call(node, *targets, methods: tuple[str, ...] = ()) -> bool:
    """``node`` calls one of ``targets`` (functions) or one of ``methods`` (tensor methods)."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return node.target in targets
    if node.op == "call_method":
        return node.target in methods
    return False


@dataclass
class GraphContext:
    """The captured graph and the tree tensors wired into it.

    ``positions``, ``subtree_end``: [N] int64 nodes read from the graph input ``tree_info``.
    ``seq_len``: N as the graph knows it (a SymInt under dynamic shapes).
    """

    gm: fx.GraphModule
    backend: str
    input_ids: fx.Node
    tree_info: fx.Node
    positions: fx.Node
    subtree_end: fx.Node
    seq_len: object
    entry: fx.Node
    tree_weights: fx.Node | None = None  # [2, N] loss weights (sum, mean); in training steps
    block_size: int = 128
    kernel_options: dict = field(default_factory=dict)  # FlexAttention's, for every site
    interleave_heads: bool | None = None  # KV heads along the row (None: in training)
    code_before: str = ""  # the captured graph's code before any pass ran
    modules_before: dict = field(default_factory=dict)  # node name -> module path, before
    done: bool = False  # every pass ran and the graph was handed to the backend
    log: list[Rewrite] = field(default_factory=list)
    _cache: dict = field(default_factory=dict)

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def record(self, pass_name: str, node: fx.Node, after: str, note: str = "") -> None:
        self.log.append(
            Rewrite(pass_name, node.name, describe(node), after, module_path(node),
                    source_line(node), note)
        )

    def keep(self, pass_name: str, node: fx.Node, why: str) -> None:
        """Record a node that looks relevant to a pass but is correct as it is."""
        self.record(pass_name, node, "", note=why)

    @property
    def code_after(self) -> str:
        return self.gm.code

    def parent_token(self) -> fx.Node:
        """The [N] ``parent_token`` row of ``tree_info``, one node for all passes."""
        import operator

        return self.shared("parent_token",
                           lambda: self.graph.call_function(operator.getitem, (self.tree_info, 1)))

    def shared(self, key, make):
        """A node built once per graph (before the model's first op) and reused by every site."""
        if key not in self._cache:
            with self.graph.inserting_before(self.entry):
                self._cache[key] = make()
        return self._cache[key]
