"""Text helpers of the explain report and its page: node descriptions shortened to an op
label, source locations, tables, and graph code with module paths and marks."""

from __future__ import annotations

import re

from ...compiler.graph import Rewrite

OUTSIDE = "(treefx wrapper)"  # nodes of the traced function outside the user's model


def assigned(desc: str) -> str:
    """``name`` of ``name = target(...)`` (or of ``name (tree positions)``)."""
    return re.split(r"\s*=\s*|\s+\(", desc.strip(), maxsplit=1)[0] if desc else ""


_KEEP_KW = ("is_causal", "attn_mask", "dim", "dtype")


def op_label(desc: str) -> str:
    """``scaled_dot_product_attention(attn_mask=…, is_causal=False)`` from a node description."""
    m = re.match(r"\s*\w+ = ([\w.]+)\((.*)\)\s*$", desc or "")
    if not m:
        return desc
    target, args = m.group(1), m.group(2)
    name = target.rsplit(".", 1)[-1] if not target.startswith(".") else target
    parts = _split_args(args)
    shown = []
    pos = [p for p in parts if "=" not in p.split("(")[0]]
    if name in ("arange",) and pos:
        shown.append(pos[0])
    elif pos:
        shown.append("…")
    for p in parts:
        k, _, v = p.partition("=")
        if v and k.strip() in _KEEP_KW:
            v = v.strip()
            if re.fullmatch(r"[a-z_]\w*", v) and v not in ("None", "True", "False"):
                v = "…"  # a graph value, not a constant
            shown.append(f"{k.strip()}={v}")
    return f"{name}({', '.join(shown)})"


def before_label(r: Rewrite) -> str:
    op = op_label(r.before)
    if r.pass_name == "attention" and r.note.startswith("eager"):
        return f"matmul → {op} → matmul"  # the eager pattern, named by its softmax
    return op


def after_label(after: str) -> str:
    if not after:
        return "(left alone)"
    if after.endswith("(tree positions)"):
        return "tree positions"
    return op_label(after)


def _split_args(s: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def file_line(source: str) -> str:
    return source.split("  ", 1)[0] if source else ""


def text_table(header, rows, indent="  ") -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = [indent + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
           for r in [header, *rows]]
    return [fmt[0], indent + "  ".join("-" * w for w in widths), *fmt[1:]]


# ---------------------------------------------------------------------------------- display

_ALIAS = re.compile(r"^\s+(\w+) = ([GL]_\w+)$")
_FREES = re.compile(r";\s+(?:\w+ = )+None$")
_ATTR = re.compile(r"\b[gGlL]_model_\w+")
_LINE_NAME = re.compile(r"^\s+(\w+) = ")


def _attr_name(ident: str) -> str:
    """``g_model_modules_model_modules_layers_modules_0_..._parameters_weight_`` ->
    ``self.model.layers.0.….weight``."""
    rest = ident[len("g_model"):]
    parts = [p for p in re.split(r"_(?:modules|parameters|buffers)_", rest + "_") if p]
    if not parts or not re.match(r"_(?:modules|parameters|buffers)_", rest + "_"):
        return ident
    parts[-1] = parts[-1].rstrip("_") or parts[-1]
    return "self." + ".".join(parts)


def display_code(code: str, modules: dict[str, str], marks: dict[str, str],
             globals_: dict[str, str], model) -> list[str]:
    if not code:
        return []
    lines = code.strip("\n").splitlines()
    rename: dict[str, str] = {}
    for ln in lines:
        m = _ALIAS.match(ln)
        if m and not _ATTR.fullmatch(m.group(1)):
            rename[m.group(1)] = rename[m.group(2)] = m.group(1)[2:-1] or m.group(1)
    rename.update(globals_)
    word = re.compile(r"\b(" + "|".join(map(re.escape, sorted(rename, key=len, reverse=True)))
                      + r")\b") if rename else None
    group_cache: dict[str, str] = {}
    out, current = [], None
    for ln in lines:
        if ln.startswith("def forward("):
            params = [p.split(":")[0].strip() for p in _split_args(ln[len("def forward("):-2])]
            params = [p for p in params if not _ATTR.fullmatch(p)]
            ln = "def forward(" + ", ".join(params) + "):"
        elif _ALIAS.match(ln):
            continue
        ln = _FREES.sub("", ln.rstrip())
        if not ln.strip():
            continue
        ln = _ATTR.sub(lambda m: _attr_name(m.group(0)), ln)
        if word is not None:
            ln = word.sub(lambda m: rename[m.group(1)], ln)
        m = _LINE_NAME.match(ln)
        name = m.group(1) if m else None
        if name is not None:
            # the name before renaming, for the module map and the marks
            orig = next((k for k, v in rename.items() if v == name and k in modules), name)
            mod = modules.get(orig) or modules.get(name)
            if mod is not None:
                grp = group_cache.get(mod) or group_cache.setdefault(mod, _group(mod, model))
                if grp != current:
                    out.append(f"    # --- {grp}")
                    current = grp
            mark = marks.get(name) or marks.get(orig)
            if mark:
                ln = f"{ln}  # {mark}"
        out.append(ln)
    return out


def _group(path: str, model) -> str:
    """The module a header names: the innermost non-leaf module around ``path`` (so a q_proj
    Linear or a norm is shown under its attention block)."""
    if path in (OUTSIDE, "<model>") or model is None:
        return path if path != "<model>" else f"<model> ({type(model).__name__})" if model \
            is not None else path
    parts = path.split(".")
    while parts:
        try:
            sub = model.get_submodule(".".join(parts))
        except (AttributeError, TypeError):
            return path
        if next(sub.children(), None) is not None:
            return ".".join(parts)
        parts.pop()
    return f"<model> ({type(model).__name__})"
