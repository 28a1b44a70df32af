"""Hugging Face's output-capturing hooks (:mod:`treefx.families.hf_hooks`): installed before
a capture for the modules whose config asks for a captured output (a tiny Mixtral with
``output_router_logits=True``, random weights from its config), as its first forward would;
not for a model that asks for none."""

from __future__ import annotations

import pytest

from treefx.families.hf_hooks import install_output_hooks

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.utils.output_capturing")


def _mixtral(**flags):
    cfg = transformers.AutoConfig.for_model(
        "mixtral", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
        num_experts_per_tok=1, **flags)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _hooked(model) -> list[str]:
    return [type(m).__name__ for m in model.modules()
            if getattr(m, "_output_capturing_hooks_installed", False)]


def test_hooks_are_installed_where_the_config_asks_for_router_logits():
    model = _mixtral(output_router_logits=True)
    assert _hooked(model) == []  # Hugging Face installs them lazily, on the first forward
    install_output_hooks(model)
    assert _hooked(model)


def test_no_hooks_without_a_captured_output():
    model = _mixtral()
    install_output_hooks(model)
    assert _hooked(model) == []
