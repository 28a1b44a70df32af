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


def test_the_oracle_runs_the_torch_kernel_beneath_hugging_faces_fla_wrapper(monkeypatch):
    """Hugging Face wraps its Gated DeltaNet so that it calls fla whenever fla is installed,
    unchecked. The oracle runs the torch function beneath the wrapper (the reference, shared
    with nothing the tree runs); the model's own calls outside the oracle go through it."""
    import functools
    import sys

    from treefx.tools.synth import odd_forest
    from treefx.tools.zoo import build_model

    model = build_model("qwen3_next")
    mod = sys.modules[type(model.model.layers[0].linear_attn).__module__]
    torch_fn = mod.torch_chunk_gated_delta_rule
    calls = []

    @functools.wraps(torch_fn)
    def fla_wrapper(*args, **kwargs):  # what the hub fallback does when fla is installed
        calls.append(1)
        return torch_fn(*args, **kwargs)

    monkeypatch.setattr(mod, "torch_chunk_gated_delta_rule", fla_wrapper)
    vocab = model.get_input_embeddings().num_embeddings
    trees = odd_forest(2, vocab)
    loss = treefx.reference.sequence_loss(model, trees, reduction="mean")
    loss.backward()
    assert not calls and mod.torch_chunk_gated_delta_rule is fla_wrapper
    with torch.no_grad():
        model(torch.tensor([trees[0].sequence(0)]))
    assert calls  # the model's own call, outside the oracle
    rep = treefx.verify(treefx.compile(model, backend="eager", verify=False), trees,
                        reduction="mean")
    assert rep.passed, rep
    assert len(calls) == 1  # the check's oracle ran beneath the wrapper too
