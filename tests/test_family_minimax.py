"""Lightning attention (HF MiniMax): the layer's block loop is the recurrence
``S ← exp(-s_h)·S + kᵀv, o = q·S``; treefx recognises the layer, runs it as one recurrence
node (each tree node from its parent node's state) and is exact against the per-branch oracle.
A layer that looks the same but computes something else is left alone, and refused."""

from __future__ import annotations

import pytest
import torch
from support import check_against_oracle
from trees import odd_forest

import treefx
from treefx.ops.lightning import lightning_attention, lightning_attention_reference
from treefx.tools.zoo import build_model

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("n", [1, 7, 64, 65, 150])
def test_chunked_kernel_matches_the_recurrence(n):
    torch.manual_seed(n)
    q, k, v = (torch.randn(2, n, 3, 8, dtype=torch.float64) for _ in range(3))
    g = -torch.rand(2, n, 3, dtype=torch.float64)
    s0 = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    out, state = lightning_attention(q, k, v, g, s0, output_final_state=True)
    ref, ref_state = lightning_attention_reference(q, k, v, g, s0)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, ref_state, rtol=1e-12, atol=1e-12)


def minimax(block_size=4):
    """The zoo's tiny MiniMax (full and lightning layers) with blocks shorter than most probe
    sequences, so that the model's own loop runs several blocks."""
    model = build_model("minimax", block_size=block_size)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def test_minimax_matches_oracle():
    model = minimax()
    tm = treefx.compile(model, backend="eager")
    trees = odd_forest(3, model.config.vocab_size)
    check_against_oracle(tm, trees)
    notes = [r.after for c in tm.contexts for r in c.log if r.pass_name == "ssm"]
    assert any("lightning_attention" in a for a in notes), notes


def test_a_subclass_with_another_forward_is_not_taken_for_the_recurrence():
    """Same attributes, another forward of its own (the output doubled): the probe finds it
    differs from the recurrence, so treefx does not replace that forward (it may still call
    the recognised base layer's, which is exact), and the model stays exact."""
    model = minimax()
    layer = next(m for m in model.modules() if hasattr(m, "slope_rate"))
    base = type(layer)

    class Doubled(base):
        def forward(self, *args, **kwargs):
            out, state = base.forward(self, *args, **kwargs)
            return 2 * out, state

    for m in model.modules():
        if type(m) is base:
            m.__class__ = Doubled
    assert not treefx.families.minimax.lightning_matches(layer)
    tm = treefx.compile(model, backend="eager")
    check_against_oracle(tm, odd_forest(2, model.config.vocab_size))
    assert all(cls is not Doubled for cls, _ in treefx.compiler.recurrences._LAYER_SITES)


def test_changed_decay_tables_are_refused():
    """The layer's loop reads its tables, treefx's recurrence its rates: tables that are not
    the rates' are a clear error, not a different model."""
    model = minimax()
    layer = next(m for m in model.modules() if hasattr(m, "slope_rate"))
    with torch.no_grad():
        layer.diagonal_decay.mul_(0.5)
    tm = treefx.compile(model, backend="eager", verify=False)
    with pytest.raises(treefx.TreeCompileError, match="diagonal_decay"):
        with torch.no_grad():
            tm(treefx.pack(odd_forest(1, model.config.vocab_size)))
