"""Write docs/api.md, treefx's API reference, from the docstrings.

    python docs/gen_api.py            # rewrite docs/api.md
    python docs/gen_api.py --check    # exit 1 if docs/api.md is not what this writes now

Every public name of ``treefx.__all__`` and of the submodules users import (``__all__`` of
each module in MODULES) with its signature and docstring; a class with its public methods and
properties. The first line of each docstring is its one-line summary (the index at the top);
``tests/test_api_docs.py`` checks that docs/api.md is current and that every public name has
such a summary. Standard library and treefx only.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "api.md"

# The modules whose public names (their ``__all__``) are documented, in this order.
MODULES = [
    "treefx",
    "treefx.data",
    "treefx.trajectories",
    "treefx.rl",
    "treefx.distributed",
    "treefx.reference",
    "treefx.models",
    "treefx.tools.synth",
    "treefx.parts",
    "treefx.tools.debug",
    "treefx.tools.debug.examples",
    "treefx.integrations.hf",
]

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc):`~?([^`]+)`")


def _import():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return {name: importlib.import_module(name) for name in MODULES}


def own_doc(obj) -> str:
    """The docstring ``obj`` itself has (not one inherited from a base class), cleaned."""
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__")
        if doc and obj.__module__ and _is_dataclass_autodoc(obj, doc):
            doc = None
    else:
        doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def _is_dataclass_autodoc(cls, doc: str) -> bool:
    # dataclasses write "Name(field: type = default, ...)" when a class has no docstring.
    return "__dataclass_fields__" in cls.__dict__ and doc.startswith(cls.__name__ + "(")


def summary(doc: str) -> str:
    """The one-line summary: the docstring's first line."""
    return doc.splitlines()[0].strip() if doc else ""


def summary_problem(doc: str) -> str | None:
    """Why ``doc`` does not start with a one-line summary in plain words, or None if it does:
    a first line that begins with a word, ends a sentence with a period, and is followed by a
    blank line or nothing."""
    if not doc:
        return "no docstring"
    lines = doc.splitlines()
    first = lines[0].strip()
    if not re.match(r"[A-Za-z]", first):
        return f"the first line does not begin with a word: {first!r}"
    if not first.endswith("."):
        return f"the first line is not a sentence ending with a period: {first!r}"
    if len(lines) > 1 and lines[1].strip():
        return f"the first line is not followed by a blank line: {lines[1].strip()!r}"
    return None


def signature(obj) -> str:
    """``obj``'s signature, without private parameters (``_name``) or memory addresses."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    params = [p.replace(annotation=_unquoted(p.annotation)) for p in sig.parameters.values()
              if not p.name.startswith("_")]
    sig = sig.replace(parameters=params, return_annotation=_unquoted(sig.return_annotation))
    return _ADDRESS.sub("", str(sig))


class _Unquoted(str):
    """An annotation kept as a string (``from __future__ import annotations``), shown as written."""

    def __repr__(self) -> str:
        return str(self)


def _unquoted(annotation):
    return _Unquoted(annotation) if isinstance(annotation, str) else annotation


def _anchor(qualname: str) -> str:
    return re.sub(r"[^a-z0-9_-]", "", qualname.lower().replace(".", "-"))


def _md_summary(text: str) -> str:
    return _ROLE.sub(r"`\1`", text)


def _body(doc: str) -> list[str]:
    """The docstring after its summary line, as a text block (kept verbatim)."""
    rest = "\n".join(doc.splitlines()[1:]).strip("\n")
    if not rest.strip():
        return []
    return ["```text", rest, "```", ""]


def public_names(module) -> list[str]:
    return list(module.__all__)


def documented(module) -> list[tuple[str, object]]:
    """(name, object) of the module's public names that are not modules."""
    out = []
    for name in public_names(module):
        obj = getattr(module, name)
        if not inspect.ismodule(obj):
            out.append((name, obj))
    return out


def is_constant(obj) -> bool:
    """A value (a number, a tuple, an instance), shown by its repr, not a class or function."""
    return not (inspect.isclass(obj) or inspect.isroutine(obj))


def members(cls) -> list[tuple[str, object]]:
    """Public methods and properties that ``cls`` or its treefx base classes define."""
    seen, out = set(), []
    for base in cls.__mro__:
        if not (base.__module__ or "").startswith("treefx"):
            continue
        for name, raw in base.__dict__.items():
            if name.startswith("_") or name in seen:
                continue
            if isinstance(raw, (staticmethod, classmethod)):
                obj = raw.__func__
            elif isinstance(raw, property) or inspect.isfunction(raw):
                obj = raw
            elif getattr(raw, "__wrapped__", None) is not None and callable(raw):
                obj = raw  # functools.cached_property and similar
            elif type(raw).__name__ == "cached_property":
                obj = raw
            else:
                continue
            seen.add(name)
            out.append((name, raw if isinstance(raw, (property,)) else obj))
    return sorted(out, key=lambda item: item[0])


def _member_lines(cls_path: str, name: str, obj) -> list[str]:
    if isinstance(obj, property) or type(obj).__name__ == "cached_property":
        head = f"- **`{name}`** (property)"
        doc = inspect.cleandoc(obj.__doc__ or "") if not isinstance(obj, property) else \
            inspect.cleandoc((obj.fget.__doc__ if obj.fget else None) or "")
    else:
        sig = signature(obj)
        sig = re.sub(r"^\(self(?:, )?", "(", sig)
        sig = re.sub(r"^\(cls(?:, )?", "(", sig)
        head = f"- **`{name}{sig}`**"
        doc = own_doc(obj)
    lines = [head]
    if doc:
        lines += ["", "  ```text", *("  " + ln if ln else "" for ln in doc.splitlines()),
                  "  ```"]
    lines.append("")
    return lines


def render_object(path: str, obj) -> list[str]:
    doc = own_doc(obj)
    if is_constant(obj):
        return [f"### `{path}`", "", f"`{path} = {_ADDRESS.sub('', repr(obj))}`", ""]
    kind = "class" if inspect.isclass(obj) else "function"
    sig = signature(obj)
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        kind, sig = "exception", ""
    lines = [f"### `{path}{sig}`", "", f"*{kind}*" + (f" — {_md_summary(summary(doc))}"
                                                       if doc else ""), ""]
    lines += _body(doc)
    if inspect.isclass(obj) and not issubclass(obj, BaseException):
        ms = members(obj)
        if ms:
            lines += ["Members:", ""]
            for name, m in ms:
                lines += _member_lines(path, name, m)
    return lines


def render(modules: dict) -> str:
    lines = [
        "# treefx API reference",
        "",
        "<!-- Generated by `python docs/gen_api.py` from the docstrings; do not edit by hand."
        " tests/test_api_docs.py checks that it is current. -->",
        "",
        "Every public name of `treefx` and of the submodules you import, with its signature"
        " and docstring. The [user guide](guide.md) says how they fit together.",
        "",
        "## Index",
        "",
    ]
    for mod_name, module in modules.items():
        lines.append(f"- [`{mod_name}`](#{_anchor(mod_name)}): "
                     f"{_md_summary(summary(own_doc(module)))}")
        for name, obj in documented(module):
            path = f"{mod_name}.{name}"
            text = _md_summary(summary(own_doc(obj))) if not is_constant(obj) else "a constant"
            lines.append(f"  - [`{name}`](#{_anchor(path)}): {text}")
    lines.append("")
    for mod_name, module in modules.items():
        doc = own_doc(module)
        lines += [f'<a id="{_anchor(mod_name)}"></a>', "", f"## `{mod_name}`", "",
                  _md_summary(summary(doc)), ""]
        lines += _body(doc)
        subs = [n for n in public_names(module) if inspect.ismodule(getattr(module, n))]
        if subs:
            # a submodule's section is under its own name (treefx.debug: treefx.tools.debug)
            lines += ["Submodules: " + ", ".join(
                f"[`{mod_name}.{n}`](#{_anchor(getattr(module, n).__name__)})"
                for n in subs) + ".", ""]
        for name, obj in documented(module):
            path = f"{mod_name}.{name}"
            lines += [f'<a id="{_anchor(path)}"></a>', ""]
            lines += render_object(path, obj)
    return "\n".join(lines).rstrip("\n") + "\n"


def generate() -> str:
    return render(_import())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if docs/api.md differs from what this writes")
    args = parser.parse_args(argv)
    text = generate()
    if args.check:
        current = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
        if current != text:
            print("docs/api.md is out of date: run python docs/gen_api.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
