"""``import treefx`` stays light: no transformers until something asks for it."""

from __future__ import annotations

import json
import subprocess
import sys


def _modules_after(code: str, package: str = "transformers") -> list[str]:
    """The modules of ``package`` loaded after running ``code`` in a fresh interpreter."""
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(m for m in sys.modules " \
        f"if m == {package!r} or m.startswith({package + '.'!r}))))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_treefx_does_not_import_transformers():
    # The recurrence registry used to import transformers' modeling modules at import (~4 s);
    # it registers Hugging Face's kernels on first capture now
    # (treefx.compiler.recurrences._ensure_builtins).
    assert _modules_after("import treefx, treefx.tools.cli") == []


def test_import_treefx_does_not_import_dynamo_or_inductor():
    # torch._dynamo and torch._inductor take about 2 s to import (a module-level
    # torch._dynamo.allow_in_graph(...) is enough to load them): the command line's stats,
    # synth and draw never compile. Load them in the function that compiles.
    for package in ("torch._dynamo", "torch._inductor"):
        assert _modules_after("import treefx, treefx.tools.cli", package) == [], package


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
        "assert k.recurrence('qwen3_next_gated_delta_rule').fn is m.torch_chunk_gated_delta_rule\n"
    )
    assert "transformers.models.qwen3_next.modeling_qwen3_next" in _modules_after(code)


def test_import_treefx_does_not_import_sympy():
    # sympy takes about 0.4 s to import; the passes that read symbolic sizes import it when
    # they run (a capture has loaded it through torch's symbolic shapes by then).
    assert _modules_after("import treefx, treefx.tools.cli", "sympy") == []
