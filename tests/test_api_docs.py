"""docs/api.md is what ``python docs/gen_api.py`` writes from the docstrings now, and every
public name it documents starts its docstring with a one-line summary in plain words."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gen_api():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_md_is_current(gen_api):
    committed = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert committed == gen_api.generate(), (
        "docs/api.md is out of date: run `python docs/gen_api.py` and commit docs/api.md")


def test_every_public_name_has_a_one_line_summary(gen_api):
    problems = []
    for mod_name, module in gen_api._import().items():
        items = [(mod_name, module)] + [(f"{mod_name}.{name}", obj)
                                        for name, obj in gen_api.documented(module)
                                        if not gen_api.is_constant(obj)]
        for path, obj in items:
            problem = gen_api.summary_problem(gen_api.own_doc(obj))
            if problem:
                problems.append(f"{path}: {problem}")
    assert not problems, "\n".join(problems)


def test_the_reference_covers_the_package(gen_api):
    """Every name of ``treefx.__all__`` is documented, and so is every public submodule it
    lists (and ``treefx.models``, which users import)."""
    import treefx

    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    modules = set(gen_api.MODULES)
    for name in treefx.__all__:
        obj = getattr(treefx, name)
        if inspect.ismodule(obj):
            assert obj.__name__ in modules, f"treefx.{name} is not in docs/gen_api.py's MODULES"
        else:
            assert f'<a id="{gen_api._anchor("treefx." + name)}"></a>' in text, name
    assert "treefx.models" in modules


def test_summary_rule(gen_api):
    ok = gen_api.summary_problem
    assert ok("Pack trees.\n\nMore.") is None and ok("Pack trees.") is None
    assert "no docstring" in ok("")
    assert "begin with a word" in ok("``n`` trees.")
    assert "period" in ok("Pack the trees of a forest so that")
    assert "blank line" in ok("Pack trees.\nMore.")
