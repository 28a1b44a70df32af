"""The tree cumulative sum against each sequence's own torch.cumsum and a plain loop, values
and gradients, on trees with every odd shape."""

from __future__ import annotations

import pytest
import torch
from trees import odd_forest

import treefx
from treefx.ops.scan import tree_cumsum, tree_cumsum_reference


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dim_first", [False, True], ids=["B-N-C", "N-C"])
def test_tree_cumsum_matches_each_sequence(seed, dim_first):
    batch = treefx.pack(odd_forest(seed))
    n = batch.num_tokens
    g = torch.Generator().manual_seed(seed)
    shape, dim = ((n, 3), 0) if dim_first else ((2, n, 3), 1)
    x = torch.randn(shape, dtype=torch.float64, generator=g, requires_grad=True)
    out = tree_cumsum(x, dim, batch.parent_token, batch.subtree_end)
    torch.testing.assert_close(out, tree_cumsum_reference(x, dim, batch.parent_token))
    for i in range(batch.num_sequences):
        idx = batch.sequence_index(i)
        torch.testing.assert_close(out.index_select(dim, idx),
                                   torch.cumsum(x.index_select(dim, idx), dim))
    probe = torch.randn(out.shape, dtype=torch.float64, generator=g)
    (got,) = torch.autograd.grad((out * probe).sum(), x)
    ref = tree_cumsum_reference(x, dim, batch.parent_token)
    (want,) = torch.autograd.grad((ref * probe).sum(), x)
    torch.testing.assert_close(got, want)


def test_integer_counts_are_exact():
    """RoBERTa counts the non-padding tokens before each one with a cumsum of an int mask."""
    batch = treefx.pack(odd_forest(3))
    mask = (batch.input_ids != 5).int()
    out = tree_cumsum(mask, 1, batch.parent_token, batch.subtree_end)
    assert out.dtype == torch.int64
    for i in range(batch.num_sequences):
        idx = batch.sequence_index(i)
        assert torch.equal(out[0, idx], torch.cumsum(mask[0, idx], 0))
