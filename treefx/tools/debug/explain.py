"""``treefx.debug.explain(model, batch)``: what treefx does to a model, without training.

Runs one forward (no grad) through ``treefx.compile(model)``, watching each captured graph go
through the passes, and returns an :class:`ExplainReport`: every node a pass rewrote, every
attention-/position-like node it left alone and why, the positions' source, graph breaks or the
error that stops compilation, the number of graphs and compilations, and the graph code before
and after the passes (``report.diff()``, ``report.to_html(path)``).
"""

from __future__ import annotations

import difflib
import operator
import re
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ...run.engine import tree_info
from ...layout import TreeBatch, pack
from ...compiler.graph import (
    GraphBreakError,
    Rewrite,
    TreeCompileError,
    module_path,
)
from ...tree import Tree
from ...run.model import TreeModel, verify_default
from ...run.model import compile as tree_compile
from ...run.model import verify as verify_model
from ...verification import VerificationReport, VerificationUnavailable
from .display import (
    OUTSIDE,
    after_label,
    assigned,
    before_label,
    display_code,
    file_line,
    op_label,
    text_table,
)
from .page import render_page

__all__ = ["ExplainReport", "GraphReport", "explain"]

# The module, not the function of the same name that treefx/__init__ exports.



@dataclass
class GraphReport:
    """One captured graph: its code before and after the passes and what the passes did.

    ``code_after`` is None when compilation stopped inside the passes; ``partial_after`` is then
    the graph as far as the passes got.
    """

    index: int
    code_before: str
    code_after: str | None
    log: list[Rewrite]
    modules_before: dict[str, str] = field(repr=False, default_factory=dict)
    modules_after: dict[str, str] = field(repr=False, default_factory=dict)
    positions: list[str] = field(default_factory=list)
    partial_after: str | None = field(repr=False, default=None)
    globals_after: dict[str, str] = field(repr=False, default_factory=dict)
    label: str = ""  # what the graph ran: "the trees, forward", "the probe forest, ..."

    @property
    def rewrites(self) -> list[Rewrite]:
        return [r for r in self.log if not r.kept]

    @property
    def kept(self) -> list[Rewrite]:
        return [r for r in self.log if r.kept]

    @property
    def ok(self) -> bool:
        return self.code_after is not None


@dataclass
class ExplainReport:
    """What :func:`explain` found.

    ``print(report)`` gives a short table; :meth:`diff` the
    graph code diff; :meth:`to_html` one self-contained page with pictures."""

    model_name: str
    backend: str
    batch: TreeBatch = field(repr=False)
    graphs: list[GraphReport]
    num_graphs: int
    num_compilations: int
    graph_breaks: list[str] = field(default_factory=list)  # distinct reasons, in order
    num_graph_breaks: int = 0
    error: TreeCompileError | None = None
    stop_node: str | None = None  # the graph node that stops compilation
    stop_module: str | None = None
    stop_source: str | None = None
    verification: VerificationReport | None = None  # the probe check, when it ran
    verification_error: str | None = None  # why it could not run
    _model: torch.nn.Module | None = field(default=None, repr=False)

    # ------------------------------------------------------------------ summary

    @property
    def ok(self) -> bool:
        """Whether the model compiled for trees."""
        return self.error is None

    @property
    def status(self) -> str:
        if self.error is not None:
            return f"stopped: {type(self.error).__name__}"
        if self.verification is not None and not self.verification.passed:
            return "compiled, verification FAILED"
        return "compiled, verified" if self.verification is not None else "compiled"

    @property
    def rewrites(self) -> list[Rewrite]:
        return [r for g in self.graphs for r in g.rewrites]

    @property
    def kept(self) -> list[Rewrite]:
        return [r for g in self.graphs for r in g.kept]

    @property
    def positions(self) -> list[str]:
        out = []
        for g in self.graphs:
            out += [p for p in g.positions if p not in out]
        return out

    @property
    def modules(self) -> list[str]:
        """Module paths of the rewritten nodes, in graph order, without repeats."""
        return list(dict.fromkeys(r.module for r in self.rewrites))

    def graph_title(self, graph: GraphReport) -> str:
        """``graph 1 of 2 (the trees, forward)``: which graph, of how many, what it ran."""
        label = f" ({graph.label})" if graph.label else ""
        return f"graph {graph.index + 1} of {len(self.graphs)}{label}"

    def by_graph(self, kept: bool) -> list[tuple[str | None, list[Rewrite]]]:
        """The rewrites (``kept=False``) or the nodes left alone, per graph: ``(title, rows)``
        for each graph with rows, the title None when there is one graph."""
        rows = [(g, g.kept if kept else g.rewrites) for g in self.graphs]
        return [(self.graph_title(g) if len(rows) > 1 else None, r) for g, r in rows if r]

    def _batch_line(self) -> str:
        b = self.batch
        trees = len(b.trees)
        base = b.num_baseline_tokens
        por = 1 - b.num_real_tokens / base if base else 0.0
        return (f"{trees} tree{'s' if trees != 1 else ''}, {b.num_real_tokens} tokens, "
                f"{b.num_sequences} sequences ({base} tokens one by one, POR {por:.2f})")

    def __str__(self) -> str:
        lines = [
            f"treefx explain: {self.model_name}, {self.backend} backend, {self._batch_line()}",
            f"graphs: {self.num_graphs}   compilations: {self.num_compilations}   "
            f"graph breaks: {self.num_graph_breaks}   status: {self.status}",
        ]
        lines += ["", "rewritten"]
        for title, group in self.by_graph(kept=False):
            rows = [[r.pass_name, r.module, f"{before_label(r)} -> {after_label(r.after)}",
                     file_line(r.source)] for r in group]
            lines += [f"  {title}"] if title else []
            lines += text_table(["pass", "module", "before -> after", "source"], rows)
        if not self.rewrites:
            lines.append("  (nothing)")
        lines += ["", "left alone"]
        for title, group in self.by_graph(kept=True):
            rows = [[r.pass_name, r.module, op_label(r.before), r.note] for r in group]
            lines += [f"  {title}"] if title else []
            lines += text_table(["pass", "module", "node", "why"], rows)
        if not self.kept:
            lines.append("  (nothing)")
        lines += ["", "positions"]
        lines += [f"  {p}" for p in self.positions] or ["  (the model uses no positions treefx "
                                                        "could see)"]
        if self.graph_breaks:
            lines += ["", "graph breaks (treefx needs the whole forward as one graph)"]
            lines += [f"  {i + 1}. {b}" for i, b in enumerate(self.graph_breaks)]
        if self.error is not None and not self.graph_breaks:
            lines += ["", "stops compilation"]
            if self.stop_node:
                lines.append(f"  node    {self.stop_node}")
                lines.append(f"  module  {self.stop_module}")
                if self.stop_source:
                    lines.append(f"  source  {self.stop_source}")
            lines.append(f"  {type(self.error).__name__}: {self.error}")
        if self.verification is not None or self.verification_error:
            lines += ["", "verification (the tree run against each sequence run alone)"]
            lines.append(f"  {self.verification or self.verification_error}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"ExplainReport({self.model_name}, {self.backend}, graphs={self.num_graphs}, "
                f"compilations={self.num_compilations}, rewrites={len(self.rewrites)}, "
                f"status={self.status!r})")

    # ------------------------------------------------------------------ diff

    def code_pair(self, graph: int = 0) -> tuple[list[str], list[str]]:
        """Display lines of graph ``graph`` before and after the passes: parameters named by
        module path (``self.model.layers.0.self_attn.q_proj.weight``), a ``# --- module``
        header where the module changes, rewritten lines marked, ``x = None`` frees dropped."""
        g = self.graphs[graph]
        after_code = g.code_after if g.ok else (g.partial_after or "")
        before_marks, after_marks = {}, {}
        for r in g.log:
            if r.kept:
                before_marks[r.node] = f"treefx {r.pass_name}: left alone"
                after_marks[r.node] = f"treefx {r.pass_name}: left alone"
                continue
            new = assigned(r.after)
            before_marks[r.node] = f"treefx {r.pass_name}: rewritten"
            if new and new in after_marks:
                after_marks[new] += f", {r.node}"
            elif new:
                after_marks[new] = f"treefx {r.pass_name}: replaces {r.node}"
        if self.stop_node and graph == len(self.graphs) - 1 and not g.ok:
            name = assigned(self.stop_node)
            before_marks[name] = after_marks[name] = "<-- treefx stops here"
        before = display_code(g.code_before, g.modules_before, before_marks, {}, self._model)
        after = display_code(after_code, g.modules_after, after_marks, g.globals_after, self._model)
        return before, after

    def diff(self, context: int = 3) -> str:
        """Unified diff (difflib) of each graph's code before and after the passes, each
        named by :meth:`graph_title`."""
        out = []
        for g in self.graphs:
            before, after = self.code_pair(g.index)
            title = self.graph_title(g)
            to = "after the treefx passes" if g.ok else "where the treefx passes stopped"
            hunks = list(difflib.unified_diff(before, after, f"{title}: captured",
                                              f"{title}: {to}", n=context, lineterm=""))
            out += hunks
            if not g.ok:
                where = [i for i, ln in enumerate(before) if "treefx stops here" in ln]
                if not hunks:
                    out.append(f"# {title}: the passes changed nothing before stopping")
                for i in where[:1]:
                    out.append(f"# {title}: compilation stops at line {i + 1}:")
                    out += before[max(0, i - context):i + context + 1]
        if not self.graphs and self.error is not None:
            out.append(f"# no graph reached the passes: {type(self.error).__name__}: "
                       f"{self.error}")
        return "\n".join(out)

    # ------------------------------------------------------------------ html

    def to_html(self, path) -> str:
        """Write one self-contained HTML page (inline CSS and pictures): the tables, the tree,
        the attention mask and the side-by-side diff. Returns the path."""

        html_text = render_page(self)
        with open(path, "w", encoding="utf-8") as f:
            f.write(html_text)
        return str(path)


# ---------------------------------------------------------------------------------- explain

def explain(model: torch.nn.Module, batch, *, backend: str = "auto", verify: bool | None = None,
            **compile_kwargs) -> ExplainReport:
    """Report what treefx's passes do to a model: every rewrite, every node left alone and why.

    Capture and transform ``model`` for ``batch`` (a TreeBatch, a Tree or a list of Trees)
    with one no-grad forward through ``treefx.compile(model, backend=backend)``, and report
    what the passes did. ``backend``: as for :func:`treefx.compile` (default ``"auto"``:
    inductor on CUDA, eager elsewhere); ``report.backend`` is the one the batch ran with. A
    :class:`~treefx.TreeCompileError` (graph breaks, an attention treefx cannot rewrite) is
    recorded in the report, not raised. ``verify``: when the model compiled,
    also run :func:`treefx.verify` on its probe forest (values and gradients against each
    sequence run alone) and record the result in ``report.verification`` (default: as
    ``treefx.compile`` decides, :func:`treefx.run.model.verify_default`); its graph is
    reported too, labelled as the probe's (``report.graph_title``). The model's
    train/eval mode, parameters and gradients are left as they are."""
    if isinstance(batch, Tree) or isinstance(batch, (list, tuple)) and batch and isinstance(
            batch[0], Tree):
        batch = pack(batch)
    if not isinstance(batch, TreeBatch):
        raise TypeError(f"expected a TreeBatch, a Tree or a list of Trees, got "
                        f"{type(batch).__name__}")
    if isinstance(model, TreeModel):  # already compiled: explain its model
        model = model.model
    tm = tree_compile(model, backend=backend, **{"verify": False, **compile_kwargs})
    error = None
    try:
        with torch.no_grad():
            tm(batch)
    except TreeCompileError as e:
        error = e
    from_batch = len(tm.contexts)  # the graphs of the batch; later ones, of the probe check
    verification = verification_error = None
    if verify is None:
        verify = verify_default()
    if verify and error is None:
        try:
            verification = verify_model(tm, raise_on_failure=False)
        except VerificationUnavailable as e:
            verification_error = f"not run: {e}"
        except TreeCompileError as e:  # the probe forest needs a graph the batch did not
            error = e
    graphs = []
    for i, ctx in enumerate(tm.contexts):
        partial = None
        if not ctx.done:
            try:
                partial = ctx.graph.python_code("self").src
            except Exception:  # a graph left half-rewritten may not print
                partial = None
        before_map = {k: (OUTSIDE if v == "<treefx>" else v) for k, v in ctx.modules_before.items()}
        graphs.append(GraphReport(
            index=i, code_before=ctx.code_before, code_after=ctx.code_after if ctx.done else None,
            log=list(ctx.log), modules_before=before_map, modules_after=_module_map(ctx.graph),
            positions=_positions(ctx), partial_after=partial,
            globals_after=_global_names(ctx.graph),
            label=("the trees, forward" if i < from_batch else
                   "the check's probe forest, forward and backward"),
        ))

    report = ExplainReport(
        model_name=type(model).__name__, backend=tm.engine.resolve_backend(batch.device),
        batch=batch, graphs=graphs,
        num_graphs=len(graphs), num_compilations=tm.num_compilations, error=error,
        verification=verification, verification_error=verification_error, _model=model,
    )
    if isinstance(error, GraphBreakError):
        report.graph_breaks, report.num_graph_breaks = _break_reasons(error.breaks)
        report.num_graphs = _count_graphs(model, tm, batch) or report.num_graphs
    elif error is not None and error.node is not None:
        report.stop_node, report.stop_module = error.node, error.module
        report.stop_source = error.source
    return report


def _module_map(graph: fx.Graph) -> dict[str, str]:
    """Node name -> module path (``OUTSIDE`` for the tree wrapper around the model)."""
    return {n.name: module_path(n) if n.meta.get("nn_module_stack") else OUTSIDE
            for n in graph.nodes}


def _global_names(graph: fx.Graph) -> dict[str, str]:
    """FX's mangled global names of non-torch functions -> their qualified names."""
    out = {}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        t = n.target
        mod = getattr(t, "__module__", None) or ""
        name = getattr(t, "__qualname__", None) or getattr(t, "__name__", None)
        if not name or mod.startswith(("torch", "builtins", "_operator", "operator", "math")):
            continue
        qual = f"{mod}.{name}" if mod else name
        out[re.sub(r"[^0-9a-zA-Z_]", "_", qual)] = qual
    return out


def _positions(ctx) -> list[str]:
    """Where the model's positions come from, in words."""
    out = []
    for n in ctx.graph.nodes:
        if (n.op == "call_function" and n.target is operator.getitem and n.args
                and n.args[0] is ctx.tree_info and n.args[1] == slice(0, 1, None)):
            users = _consumers(n)
            out.append("model input position_ids = tree positions (each token's offset in its "
                       "own sequence)" + (f", read by {', '.join(users)}" if users else ""))
    rewritten = False
    for r in ctx.log:
        if r.pass_name == "positions" and not r.kept:
            where = file_line(r.source)
            out.append(f"{op_label(r.before)} in {r.module}{f' ({where})' if where else ''} -> tree "
                       f"positions")
            rewritten = True
    if rewritten and ctx.done:
        users = _consumers(ctx.positions)
        if users:
            out.append(f"tree positions read by {', '.join(users)}")
    return out


def _consumers(node: fx.Node, depth: int = 8, limit: int = 3) -> list[str]:
    """Module paths (inside the model) of the nodes that read ``node``, nearest first."""
    seen, found, frontier = {node}, [], [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u in seen:
                    continue
                seen.add(u)
                if u.meta.get("nn_module_stack"):
                    p = module_path(u)
                    # Nodes of the model's outer container ("model" in Hugging Face) are passed
                    # through: the readers worth naming are the submodules below it.
                    if p != "<model>" and "." in p:
                        if p not in found:
                            found.append(p)
                        continue
                nxt.append(u)
        if len(found) >= limit:
            break
        frontier = nxt
    return found[:limit]


def _break_reasons(reasons: list[str]) -> tuple[list[str], int]:
    """Distinct reasons (``(xK)`` when Dynamo gave one K times) and how many it gave."""
    counts = Counter(reasons)
    out = [r if counts[r] == 1 else f"{r} (x{counts[r]})" for r in dict.fromkeys(reasons)]
    return out, len(reasons)


def _count_graphs(model, tm, batch) -> int | None:
    """How many graphs Dynamo splits the traced forward into (when it breaks)."""
    try:
        fn = tm.engine.make_traced(-2)
        with torch.no_grad():
            return int(torch._dynamo.explain(fn)(tm.model, batch.input_ids,
                                                 tree_info(batch)).graph_count)
    except Exception:
        return None
