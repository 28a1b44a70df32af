"""Every Python code block of README.md and of the docs/ pages runs as written, each on its own:
in a fresh namespace, in a fresh folder, as if copied alone into a file.

A block that cannot run here (it needs a GPU or several processes) is fenced
```` ```python no-run: REASON ````, the reason right after the marker; every no-run marker must
carry one. Today one block is no-run: docs/distributed.md's FSDP2 block, which needs several
processes (``torchrun``); ``examples/fsdp.py`` runs the same calls and tests/test_examples.py
runs that."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The pages whose Python blocks run: the README and every page under docs/.
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.M | re.S)
_NO_RUN = re.compile(r"^python\s+no-run\b(.*)$")


def fenced_blocks(text: str) -> list[tuple[int, str, str]]:
    """(first line number, info string, code) of each fenced block."""
    return [(text.count("\n", 0, m.start(2)) + 1, m.group(1).strip(), m.group(2))
            for m in _FENCE.finditer(text)]


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, code) of each ```python block not marked no-run."""
    return [(line, code) for line, info, code in fenced_blocks(text)
            if info.split()[:1] == ["python"] and not _NO_RUN.match(info)]


def no_run_reasons(text: str) -> list[tuple[int, str]]:
    """(first line number, reason) of each ```python no-run block; the reason is what follows
    the marker (a colon or dash before it is dropped), empty when there is none."""
    out = []
    for line, info, _ in fenced_blocks(text):
        m = _NO_RUN.match(info)
        if m:
            out.append((line, m.group(1).strip().lstrip(":—-").strip()))
    return out


def _id(path: pathlib.Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


ALL_BLOCKS = [(path, line, code) for path in PAGES
              for line, code in python_blocks(path.read_text(encoding="utf-8"))]


def test_the_fence_reader():
    text = ("x\n```python\na = 1\n```\n```\nshell\n```\n```python no-run: needs a GPU\nboom()\n"
            "```\n```python\nb = 2\n```\n```python no-run\nboom()\n```\n")
    assert python_blocks(text) == [(3, "a = 1\n"), (12, "b = 2\n")]
    assert no_run_reasons(text) == [(9, "needs a GPU"), (15, "")]


def test_every_no_run_block_says_why():
    missing = [_id(path, line) for path in PAGES
               for line, reason in no_run_reasons(path.read_text(encoding="utf-8"))
               if not reason]
    assert not missing, f"```python no-run without a reason after the marker: {missing}"


def test_the_pages_have_blocks():
    pages = {path.name for path, _, _ in ALL_BLOCKS}
    assert {"README.md", "guide.md", "parts.md", "debugging.md"} <= pages
    assert len(python_blocks(README.read_text(encoding="utf-8"))) >= 1  # the quickstart


@pytest.mark.parametrize("path,line,code", ALL_BLOCKS,
                         ids=[_id(p, ln) for p, ln, _ in ALL_BLOCKS])
def test_python_block_runs_alone(path, line, code, tmp_path, monkeypatch):
    pytest.importorskip("transformers")  # some blocks run a small Hugging Face model
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace: dict = {"__name__": "__doc_block__"}
    # Line numbers in a traceback are the page's own.
    exec(compile("\n" * (line - 1) + code, str(path), "exec"), namespace)
    if "# == reference.sequence_loss(" in code:
        # The quickstart's comment: the tree loss is this per-sequence loss.
        claim = code.split("# == ", 1)[1].split("\n", 1)[0]
        assert claim == 'reference.sequence_loss(model, tree, reduction="mean")'
        ref = eval(claim, {**namespace, "reference": namespace["treefx"].reference})
        torch.testing.assert_close(namespace["loss"].detach(), ref.detach())


def test_the_quickstart_claim_is_checked():
    assert any("# == reference.sequence_loss(" in code
               for line, code in python_blocks(README.read_text(encoding="utf-8")))


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


def anchors(text: str) -> set[str]:
    """The anchors of a markdown page: GitHub's slug of each heading, and each ``<a id>``."""
    out = set(re.findall(r'<a id="([^"]+)">', text))
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_links_between_the_pages_resolve():
    """A relative link ``[text](path)`` or ``[text](path#anchor)`` of the README or a docs/
    page names a file of the repository, and an anchor one of that page's headings."""
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = page.parent / file if file else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and path.suffix == ".md" and \
                    anchor not in anchors(path.read_text(encoding="utf-8")):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_the_heading_slugs():
    text = "# A\n## Options of `treefx.compile`\n```\n# not a heading\n```\n<a id=\"x-y\"></a>\n"
    assert anchors(text) == {"a", "options-of-treefxcompile", "x-y"}


def test_ci_runs_the_readme_test_command():
    """``.ci/run`` runs exactly the README's command that installs and runs the tests."""
    text = README.read_text(encoding="utf-8")
    commands = [code.strip() for _, info, code in fenced_blocks(text)
                if not info and "pytest" in code]
    assert len(commands) == 1, commands
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
          if ln.strip() and not ln.startswith("#") and not ln.startswith(("set ", "cd "))]
    assert ci[-1] == commands[0]


def test_the_readme_is_a_page():
    """The README stays a page (issue 67): at most 150 lines; the figures live in
    BENCHMARKS.md."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 150, f"README.md has {lines} lines; move detail to docs/ or BENCHMARKS.md"
