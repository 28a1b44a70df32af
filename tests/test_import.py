"""``import treefx`` stays light: no transformers until something asks for it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _modules_after(code: str, package: str = "transformers") -> list[str]:
    """The modules of ``package`` loaded after running ``code`` in a fresh interpreter."""
    return _packages_after(code, (package,))[package]


def _packages_after(code: str, packages) -> dict[str, list[str]]:
    """For each of ``packages``: its modules loaded after running ``code`` in one fresh
    interpreter."""
    probe = code + "\nimport json, sys\nprint(json.dumps({p: sorted(m for m in sys.modules " \
        "if m == p or m.startswith(p + '.')) for p in " + repr(list(packages)) + "}))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


# One fresh interpreter for every package the command line's import must leave unloaded (each
# a test below): the same import, so one run answers them all.
_CLI_IMPORT = "import treefx, treefx.tools.cli"
_LIGHT = ("transformers", "torch._dynamo", "torch._inductor", "sympy")


@pytest.fixture(scope="module")
def after_cli_import() -> dict[str, list[str]]:
    return _packages_after(_CLI_IMPORT, _LIGHT)


def test_import_treefx_does_not_import_transformers(after_cli_import):
    # The recurrence registry used to import transformers' modeling modules at import (~4 s);
    # it registers Hugging Face's kernels on first capture now
    # (treefx.compiler.recurrences._ensure_builtins).
    assert after_cli_import["transformers"] == []


def test_import_treefx_does_not_import_dynamo_or_inductor(after_cli_import):
    # torch._dynamo and torch._inductor take about 2 s to import (a module-level
    # torch._dynamo.allow_in_graph(...) is enough to load them): the command line's stats,
    # synth and draw never compile. Load them in the function that compiles.
    for package in ("torch._dynamo", "torch._inductor"):
        assert after_cli_import[package] == [], package


def test_compiling_a_torch_model_does_not_import_transformers():
    # A capture with transformers never imported has no Hugging Face kernel to route.
    code = (
        "import treefx\n"
        "from treefx.models import tiny_decoder\n"
        "tree = treefx.Tree.from_sequences([[1, 2, 3], [1, 2, 4, 5]])\n"
        "batch = treefx.pack(tree)\n"
        "treefx.tree_loss(treefx.compile(tiny_decoder(), verify=False)(batch), batch)\n"
    )
    assert _modules_after(code) == []


def test_hf_kernels_are_registered_once_transformers_is_loaded():
    code = (
        "import treefx.compiler.recurrences as k\n"
        "before = [n for n in k._REGISTRY if n.startswith('qwen3_next')]\n"
        "assert before == [], before\n"
        "import transformers\n"
        "with k.capture_patches():\n"
        "    from transformers.models.qwen3_next import modeling_qwen3_next as m\n"
        "    assert k.registered(m.torch_chunk_gated_delta_rule) is not None\n"
        "assert k.registered(m.torch_chunk_gated_delta_rule) is None\n"
        "from treefx.families.hf_kernels import torch_function\n"
        "assert k.recurrence('qwen3_next_gated_delta_rule').fn is "
        "torch_function(m.torch_chunk_gated_delta_rule)\n"
    )
    assert "transformers.models.qwen3_next.modeling_qwen3_next" in _modules_after(code)


def test_import_treefx_does_not_import_sympy(after_cli_import):
    # sympy takes about 0.4 s to import; the passes that read symbolic sizes import it when
    # they run (a capture has loaded it through torch's symbolic shapes by then).
    assert after_cli_import["sympy"] == []
