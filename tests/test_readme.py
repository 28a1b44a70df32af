"""Every Python code block of README.md runs as written: in order, in one namespace (a block
may use what an earlier one defined), in a fresh folder. A block fenced ```` ```python no-run ````
is skipped; none is today."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.M | re.S)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, code) of each ```python block not marked no-run."""
    out = []
    for m in _FENCE.finditer(text):
        info = m.group(1).split()
        if info[:1] == ["python"] and "no-run" not in info:
            out.append((text.count("\n", 0, m.start(2)) + 1, m.group(2)))
    return out


def test_the_fence_reader():
    text = ("x\n```python\na = 1\n```\n```\nshell\n```\n```python no-run\nboom()\n```\n"
            "```python\nb = a + 1\n```\n")
    assert python_blocks(text) == [(3, "a = 1\n"), (12, "b = a + 1\n")]


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    pytest.importorskip("transformers")  # the step block runs a small Hugging Face model
    text = README.read_text(encoding="utf-8")
    blocks = python_blocks(text)
    assert len(blocks) >= 2  # the quickstart and the step
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    checked = False
    for line, code in blocks:
        # Line numbers in a traceback are README's own.
        exec(compile("\n" * (line - 1) + code, str(README), "exec"), namespace)
        if "# == reference.sequence_loss(" in code:
            # The quickstart's comment: the tree loss is this per-sequence loss.
            claim = code.split("# == ", 1)[1].split("\n", 1)[0]
            assert claim == 'reference.sequence_loss(model, tree, reduction="mean")'
            ref = eval(claim, {**namespace, "reference": namespace["treefx"].reference})
            torch.testing.assert_close(namespace["loss"].detach(), ref.detach())
            checked = True
    assert checked, "the quickstart's loss claim was not found"


def test_documents_the_code_cites_exist():
    """A ``NAME.md`` the package's code or docstrings cite is a file of the repository, at
    that path from its root (docs/ARCHITECTURE.md, docs/zoo.md, BENCHMARKS.md, ...)."""
    root = README.parent
    cited = {}
    for path in sorted((root / "treefx").rglob("*.py")):
        for name in re.findall(r"(?<![\w/.-])([\w/-]+\.md)\b", path.read_text(encoding="utf-8")):
            cited.setdefault(name, path.relative_to(root))
    assert "docs/ARCHITECTURE.md" in cited
    missing = {name: str(where) for name, where in cited.items() if not (root / name).is_file()}
    assert not missing, f"cited but not in the repository: {missing}"
