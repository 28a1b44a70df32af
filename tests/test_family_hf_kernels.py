"""treefx.families.hf_kernels: the torch code beneath Hugging Face's kernel wrappers, and the
model's calls steered to it while treefx captures the model or the oracle runs it, so that a
wrapper that would call another package's kernel (fla, mamba_ssm, causal_conv1d, a Hub kernel)
never runs it over the tree's depth-first row."""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

import treefx
from treefx.families.hf_kernels import is_kernel_wrapper, torch_function

transformers = pytest.importorskip("transformers")


def test_the_torch_function_beneath_each_wrapper_is_read():
    """Qwen3-Next's kernels (a ``kernels`` Func module from transformers 5.25, a function
    wrapper before): the function beneath is the modeling module's own torch code."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    for attr in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        fn = torch_function(getattr(m, attr))
        assert inspect.isfunction(fn) and fn.__module__ == m.__name__ and fn.__name__ == attr
        assert not hasattr(fn, "__wrapped__")
    assert torch_function(len) is None  # a callable treefx cannot see into
    assert torch_function(torch.nn.Linear(2, 2)) is None


def test_a_wrapper_that_dispatches_to_a_package_is_steered_to_the_torch_code(monkeypatch):
    """Hugging Face's own wrapper (``use_kernel_func_from_hub_with_fallback``) around Qwen3-Next's
    causal conv1d, dispatching to an installed package (planted here, as causal_conv1d would be
    on a GPU): the tree and the oracle run the torch code beneath it, exactly; the model's own
    calls outside treefx go to the package."""
    hub = pytest.importorskip("transformers.integrations.hub_kernels")
    if not hasattr(hub, "use_kernel_func_from_hub_with_fallback"):
        pytest.skip("this transformers has no hub-kernel fallback wrapper")
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    from treefx.tools.synth import odd_forest
    from treefx.tools.zoo import build_model

    torch_conv = torch_function(getattr(m, "causal_conv1d_fn", None))
    if torch_conv is None:
        pytest.skip("this transformers' Qwen3-Next has no causal_conv1d_fn kernel")
    calls = []

    # a package's kernel: an opaque op (as causal_conv1d's CUDA op is), one call over the row
    @torch.library.custom_op("treefx_test::packed_causal_conv1d", mutates_args=())
    def packed(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        calls.append(hidden_states.shape[-1])
        return torch_conv(hidden_states, weight, None, activation="silu")

    packed.register_fake(lambda hidden_states, weight: torch.empty_like(hidden_states))

    def packed_conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        assert bias is None and activation == "silu"  # Qwen3-Next's
        return packed(hidden_states, weight)

    package = types.ModuleType("treefx_test_packed_kernels")
    package.causal_conv1d_fn = packed_conv
    monkeypatch.setitem(sys.modules, package.__name__, package)
    wrapper = hub.use_kernel_func_from_hub_with_fallback(
        "causal_conv1d_fn", package.__name__)(torch_conv)
    assert is_kernel_wrapper(wrapper) and torch_function(wrapper) is torch_conv
    monkeypatch.setattr(m, "causal_conv1d_fn", wrapper)

    model = build_model("qwen3_next")
    vocab = model.get_input_embeddings().num_embeddings
    trees = odd_forest(2, vocab)
    with torch.no_grad():
        model(torch.tensor([trees[0].sequence(0)]))
    assert calls  # the model's own call went to the package
    calls.clear()
    rep = treefx.verify(treefx.compile(model, backend="eager", verify=False), trees,
                        reduction="mean")
    assert rep.passed, rep
    assert calls == []  # neither the tree nor the oracle ran it
    assert m.causal_conv1d_fn is wrapper  # restored
