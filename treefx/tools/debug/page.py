"""The HTML page of an :class:`~treefx.tools.debug.explain.ExplainReport`: one self-contained
file (inline CSS, inline SVG, base64 PNG; no scripts, no external resources)."""

from __future__ import annotations

import difflib
import html
from typing import TYPE_CHECKING

from ..._version import __version__
from .display import after_label, before_label, file_line, op_label
from .pictures import mask_svg, tree_svg

if TYPE_CHECKING:  # the report renders itself through this module
    from .explain import ExplainReport

__all__ = ["render_page"]

_CSS = """
body { font: 14px/1.45 -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       color: #1d2530; margin: 18px 24px; background: #fff; }
h1 { font-size: 22px; margin: 0 0 6px; }
h1 span { color: #2f6fba; }
h2 { font-size: 15px; margin: 16px 0 6px; border-bottom: 1px solid #e2e6eb; padding-bottom: 3px; }
.facts span { display: inline-block; background: #eef2f6; border-radius: 10px; padding: 1px 9px;
              margin: 2px 4px 2px 0; font-size: 13px; }
.facts span.ok { background: #d9f2dd; color: #16602a; font-weight: 600; }
.facts span.bad { background: #fbdcdc; color: #8a1c1c; font-weight: 600; }
.grid { display: grid; grid-template-columns: minmax(0, 1.25fr) minmax(0, 1fr); gap: 28px; }
table.t { border-collapse: collapse; width: 100%; font-size: 13px; }
table.t th { text-align: left; color: #5a6675; font-weight: 600; border-bottom: 1px solid #cfd6de;
             padding: 3px 8px 3px 0; }
table.t td { border-bottom: 1px solid #eef1f4; padding: 4px 8px 4px 0; vertical-align: top; }
table.t tr.main:has(+ tr.code) td { border-bottom: none; padding-bottom: 0; }
table.t tr.code td { padding-top: 0; }
code, .mono { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 12px; }
.pass { font-weight: 600; }
.pass.attention { color: #2f6fba; } .pass.positions { color: #b35c12; }
.pass.ssm { color: #34864f; } .pass.loss { color: #8a3d8a; }
.src { color: #6a7480; font-size: 12px; }
.src code { color: #38414c; overflow-wrap: anywhere; }
.arrow { color: #8a96a3; }
.none { color: #8a96a3; font-style: italic; }
.error { background: #fff4f4; border: 1px solid #f1b8b8; border-radius: 6px; padding: 8px 12px;
         margin: 10px 0; }
.error pre { white-space: pre-wrap; margin: 4px 0 0; font-size: 12px; }
.pics { display: flex; gap: 28px; align-items: flex-start; }
.pics .tree { flex: 1 1 auto; min-width: 0; } .pics .mask { flex: 0 0 auto; }
.pic { overflow: auto; max-height: 560px; border: 1px solid #e2e6eb; border-radius: 6px;
       padding: 6px; }
.pic svg { max-width: 100%; height: auto; display: block; }
table.diff { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 11.5px;
             border-collapse: collapse; width: 100%; table-layout: fixed; }
table.diff col.n { width: 3.4em; } table.diff col.x { width: 0.6em; }
table.diff td.diff_next a { display: none; }
table.diff td { padding: 0 4px; vertical-align: top; white-space: pre-wrap;
                word-break: break-all; }
table.diff th { background: #eef2f6; text-align: left; padding: 3px 6px; font-weight: 600; }
.diff_header { background: #f4f6f8; color: #98a2ad; text-align: right; }
.diff_next { background: #f4f6f8; }
.diff_add { background: #d6f5da; }
.diff_chg { background: #fff0b3; }
.diff_sub { background: #fbd9d9; }
pre.udiff { font-size: 11.5px; background: #f8f9fb; padding: 8px; overflow: auto; }
pre.udiff .a { color: #16602a; } pre.udiff .d { color: #8a1c1c; } pre.udiff .h { color: #6a7480; }
footer { color: #8a96a3; font-size: 12px; margin-top: 20px; }
"""


def _e(s) -> str:
    return html.escape(str(s), quote=True)


def _facts(r: ExplainReport) -> str:
    b = r.batch
    base = b.num_baseline_tokens
    por = 1 - b.num_real_tokens / base if base else 0.0
    trees = len(b.trees)
    items = [
        f"{_e(r.backend)} backend",
        f"{trees} tree{'s' if trees != 1 else ''}",
        f"{b.num_real_tokens} tokens ({base} one sequence at a time, POR {por:.2f})",
        f"{b.num_sequences} sequences",
        f"{r.num_graphs} graph{'s' if r.num_graphs != 1 else ''}",
        f"{r.num_compilations} compilation{'s' if r.num_compilations != 1 else ''}",
        f"{r.num_graph_breaks} graph break{'s' if r.num_graph_breaks != 1 else ''}",
    ]
    cls = "ok" if r.ok and (r.verification is None or r.verification.passed) else "bad"
    verified = r.verification or r.verification_error
    return ("".join(f"<span>{i}</span>" for i in items)
            + f'<span class="{cls}">{_e(r.status)}</span>'
            + (f'<span class="src" title="{_e(str(verified))}">{_e(str(verified))}</span>'
               if verified else ""))


def _where(src: str) -> str:
    return f'<span class="src">{_e(file_line(src))}</span>' if src else ""


def _code_row(src: str, span: int) -> str:
    """A sub-row under a table row: the source line that made the node."""
    code = src.partition("  ")[2].strip() if src else ""
    if not code:
        return ""
    return (f'<tr class="code"><td></td><td colspan="{span}" class="src"><code>{_e(code)}</code>'
            f'</td></tr>')


def _graph_row(title: str | None, span: int) -> str:
    """A table row naming the graph the rows under it belong to (several graphs only)."""
    return f'<tr><th colspan="{span}" class="graph">{_e(title)}</th></tr>' if title else ""


def _rewrites(r: ExplainReport) -> str:
    if not r.rewrites:
        return '<p class="none">no node was rewritten</p>'
    return _table(("pass", "module", "before → after", "source"), r.by_graph(kept=False),
                  _rewrite_rows)


def _table(headers, groups, rows_html) -> str:
    """A table of ``headers`` with each graph's rows under a row naming the graph."""
    body = "".join(_graph_row(title, len(headers)) + rows_html(rows) for title, rows in groups)
    head = "".join(f"<th>{h}</th>" for h in headers)
    return f'<table class="t"><tr>{head}</tr>{body}</table>'


def _rewrite_rows(rows) -> str:
    return "".join(
        f'<tr class="main"><td class="pass {_e(x.pass_name)}">{_e(x.pass_name)}</td>'
        f'<td><code>{_e(x.module)}</code></td>'
        f'<td><code title="{_e(x.before)}">{_e(before_label(x))}</code> '
        f'<span class="arrow">→</span> <code title="{_e(x.after)}">{_e(after_label(x.after))}'
        f'</code></td><td>{_where(x.source)}</td></tr>{_code_row(x.source, 3)}'
        for x in rows)


def _kept(r: ExplainReport) -> str:
    if not r.kept:
        return ('<p class="none">nothing: no attention-, position- or state-like node was '
                'left as it is</p>')
    return _table(("pass", "module", "node", "why", "source"), r.by_graph(kept=True),
                  _kept_rows)


def _kept_rows(rows) -> str:
    return "".join(
        f'<tr class="main"><td class="pass {_e(x.pass_name)}">{_e(x.pass_name)}</td>'
        f'<td><code>{_e(x.module)}</code></td><td><code title="{_e(x.before)}">'
        f'{_e(op_label(x.before))}</code></td><td>{_e(x.note)}</td><td>{_where(x.source)}</td></tr>'
        f'{_code_row(x.source, 4)}'
        for x in rows)


def _stop(r: ExplainReport) -> str:
    if r.error is None:
        return ""
    parts = ['<div class="error">']
    if r.graph_breaks:
        parts.append("<b>Graph breaks</b>: treefx needs the whole forward as one graph to "
                     "rewrite it.<ol>")
        parts += [f"<li><code>{_e(b)}</code></li>" for b in r.graph_breaks]
        parts.append("</ol>")
    else:
        parts.append(f"<b>Compilation stops</b> ({_e(type(r.error).__name__)})")
        if r.stop_node:
            parts.append(f'<table class="t"><tr><td>node</td><td><code>{_e(r.stop_node)}'
                         f'</code></td></tr><tr><td>module</td><td><code>{_e(r.stop_module)}'
                         f'</code></td></tr>')
            if r.stop_source:
                where, _, code = r.stop_source.partition("  ")
                parts.append(f"<tr><td>source</td><td><span class=\"src\">{_e(where)}</span> "
                             f"<code>{_e(code.strip())}</code></td></tr>")
            parts.append("</table>")
    parts.append(f"<pre>{_e(r.error)}</pre></div>")
    return "".join(parts)


def _diff_tables(r: ExplainReport) -> str:
    if not r.graphs:
        return ('<p class="none">no graph reached the passes, so there is no diff (see the '
                'graph breaks above)</p>')
    out = []
    hd = difflib.HtmlDiff(tabsize=4, wrapcolumn=None)
    for g in r.graphs:
        before, after = r.code_pair(g.index)
        to = "after the treefx passes" if g.ok else "where the treefx passes stopped"
        title = r.graph_title(g)
        table = hd.make_table(before, after, f"{title}: captured by Dynamo",
                              f"{title}: {to}", context=True, numlines=2)
        # Fixed column widths: line numbers narrow, code halves equal.
        cols = ('<colgroup><col class="x"><col class="n"><col><col class="x"><col class="n">'
                '<col></colgroup>')
        table = table.replace("<colgroup></colgroup>", "").replace("<thead>", cols + "<thead>",
                                                                      1)
        table = table.replace(' nowrap="nowrap"', "")
        out.append(table)
    return "".join(out)


def _udiff(r: ExplainReport) -> str:
    lines = []
    for ln in r.diff().splitlines():
        cls = ("a" if ln.startswith("+") and not ln.startswith("+++") else
               "d" if ln.startswith("-") and not ln.startswith("---") else
               "h" if ln.startswith(("@@", "---", "+++")) else "")
        lines.append(f'<span class="{cls}">{_e(ln)}</span>' if cls else _e(ln))
    return "\n".join(lines)


def render_page(r: ExplainReport) -> str:

    positions = ("".join(f"<li><code>{_e(p.replace(' -> ', ' → '))}</code></li>"
                         for p in r.positions)
                 or '<li class="none">the model uses no positions treefx could see</li>')
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>treefx explain: {_e(r.model_name)}</title>
<style>{_CSS}</style></head>
<body>
<h1>treefx explain <span>{_e(r.model_name)}</span></h1>
<div class="facts">{_facts(r)}</div>
{_stop(r)}
<div class="grid">
<section>
<h2>Rewritten nodes</h2>
{_rewrites(r)}
</section>
<section>
<h2>Left alone</h2>
{_kept(r)}
<h2>Positions</h2>
<ul>{positions}</ul>
</section>
</div>
<div class="pics">
<section class="tree"><h2>Tree</h2>
<div class="pic">{tree_svg(r.batch)}</div></section>
<section class="mask"><h2>Attention mask</h2>
<div class="pic">{mask_svg(r.batch, size=300)}</div></section>
</div>
<h2>Graph code: captured → after the passes</h2>
{_diff_tables(r)}
<details><summary>unified diff (<code>report.diff()</code>)</summary>
<pre class="udiff">{_udiff(r)}</pre></details>
<footer>treefx {_e(__version__)} · treefx.debug.explain</footer>
</body></html>
"""
