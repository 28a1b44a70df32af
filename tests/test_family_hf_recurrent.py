"""treefx.families.hf_recurrent: Hugging Face's torch fallbacks of Gated DeltaNet, Kimi Delta
Attention, Mamba2's chunked scan and Mamba's selective scan, registered as recurrences by name
(a kernel family) and, for the modeling modules known today, once transformers is imported.
(Exactness of the models that use them: tests/test_hybrid.py, tests/test_mamba.py.)"""

from __future__ import annotations

import pytest
import torch

import treefx
from treefx.compiler.recurrences import all_recurrences, discover, kernel_families
from treefx.families import hf_recurrent

transformers = pytest.importorskip("transformers")


def test_every_kernel_family_is_registered_by_name():
    assert set(hf_recurrent.FAMILIES) <= set(kernel_families())


@pytest.mark.parametrize("model_type,attr", [
    ("qwen3_next", "torch_chunk_gated_delta_rule"),
    ("mamba2", "mamba2_chunk_scan"),
])
def test_the_known_modules_kernels_are_registered(model_type, attr):
    mod = pytest.importorskip(f"transformers.models.{model_type}.modeling_{model_type}")
    if not hasattr(mod, attr):
        pytest.skip(f"this transformers' {model_type} has no {attr}")
    names = set(all_recurrences())  # registers the builtins on first use
    assert any(n.startswith(model_type) for n in names), sorted(names)


def test_a_model_built_from_its_config_is_discovered_and_exact():
    from treefx.tools.synth import odd_forest
    from treefx.tools.zoo import build_model

    model = build_model("qwen3_next")
    found = discover(model)
    assert found and any("gated_delta_rule" in r.name for r in found), found
    vocab = model.get_input_embeddings().num_embeddings
    rep = treefx.verify(treefx.compile(model, backend="eager", verify=False),
                        odd_forest(2, vocab), reduction="mean")
    assert rep.passed, rep
