"""One model family that treefx cannot read under the installed transformers never takes down
another model: its kernel is left unregistered, the models that use it are refused at compile
time in one line (the family, the transformers release, what was found), and every other model
compiles and trains exactly, in the same process and in later calls.

A release that changes a kernel is played by planting an opaque kernel object (a callable
treefx cannot see into, as transformers 5.25's ``kernels`` wrappers were before treefx read
them) in every modeling module of each recurrent family, in a fresh process, before treefx
first reads them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent

# Per family: its kernel's name, the models whose modules define it, the one compiled here.
FAMILIES = {
    "torch_chunk_gated_delta_rule": (["qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid"],
                                     "qwen3_next", "Gated DeltaNet"),
    "chunk_kimi_delta_attention": (["kimi_linear", "bailing_hybrid"], "kimi_linear",
                                   "Kimi Delta Attention"),
    "mamba2_chunk_scan": (["mamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h",
                           "zamba2"], "mamba2", "Mamba2"),
    "mamba_selective_scan": (["mamba", "falcon_mamba", "jamba", "zamba"], "mamba",
                             "Mamba's selective scan"),
}

SCRIPT = textwrap.dedent("""
    import importlib, json, sys
    import transformers, treefx
    from treefx.tools.synth import odd_forest
    from treefx.tools.zoo import build_model

    families = json.loads(sys.argv[1])

    class OpaqueKernel:
        def __call__(self, *args, **kwargs):
            raise AssertionError("the opaque kernel ran")

    planted = {}
    for attr, (models, _, _) in families.items():
        for model_type in models:
            try:
                mod = importlib.import_module(
                    f"transformers.models.{model_type}.modeling_{model_type}")
            except ImportError:
                continue
            if hasattr(mod, attr):
                setattr(mod, attr, OpaqueKernel())
                planted.setdefault(attr, []).append(model_type)

    def exact(model_type):
        model = build_model(model_type)
        vocab = model.get_input_embeddings().num_embeddings
        tm = treefx.compile(model, backend="eager", verify=False)
        rep = treefx.verify(tm, odd_forest(2, vocab), reduction="mean")
        return bool(rep.passed)

    result = {"version": transformers.__version__, "planted": planted,
              "before": exact("qwen3"), "refused": {}}
    for attr, (_, model_type, _) in families.items():
        if attr not in planted:
            continue
        model = build_model(model_type)
        vocab = model.get_input_embeddings().num_embeddings
        try:
            treefx.verify(treefx.compile(model, backend="eager", verify=False),
                          odd_forest(1, vocab), reduction="mean")
            result["refused"][attr] = None
        except treefx.TreeCompileError as e:
            result["refused"][attr] = str(e)
    result["after"] = exact("qwen3")
    result["short_conv_after"] = exact("lfm2")
    print("RESULT " + json.dumps(result))
""")


def test_a_family_treefx_cannot_read_refuses_only_its_own_models():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(FAMILIES)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert done.returncode == 0 and line, (done.stdout + done.stderr)[-4000:]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["before"] and result["after"], result
    assert result["short_conv_after"], result  # a hybrid of no recurrent family
    # every family this release has was planted, and its model refused (before 5.15 Mamba2's
    # scan is inline: no kernel to plant)
    assert "torch_chunk_gated_delta_rule" in result["planted"], result["planted"]
    for attr, message in result["refused"].items():
        _, model_type, family = FAMILIES[attr]
        assert message is not None, f"{model_type} with an opaque {attr} was not refused"
        assert "\n" not in message, message
        assert family in message and attr in message, message
        assert f"transformers {result['version']}" in message, message
        assert "OpaqueKernel object" in message, message  # what was found
