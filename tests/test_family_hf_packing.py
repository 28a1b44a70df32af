"""Hugging Face's packed-sequence inference during a tree capture
(:mod:`treefx.families.hf_packing`): within :func:`one_sequence_per_path` it finds one
sequence per path (no packing) where the DFS row's positions jump at a branch, and the
original function is back afterwards, also after an error."""

from __future__ import annotations

import sys

import pytest
import torch

from treefx.families.hf_packing import one_sequence_per_path

transformers = pytest.importorskip("transformers")
masking_utils = pytest.importorskip("transformers.masking_utils")


def test_one_sequence_per_path_patches_and_restores_the_inference():
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        pytest.skip("this transformers has no packed-sequence inference")
    row = torch.tensor([[0, 1, 2, 1, 2]])  # a DFS row: the positions jump where a branch starts
    with one_sequence_per_path():
        assert masking_utils.find_packed_sequence_indices is not original
        assert masking_utils.find_packed_sequence_indices(row) is None
    assert masking_utils.find_packed_sequence_indices is original
    with pytest.raises(RuntimeError, match="inside"), one_sequence_per_path():
        raise RuntimeError("inside")
    assert masking_utils.find_packed_sequence_indices is original


def test_without_transformers_imported_nothing_is_patched(monkeypatch):
    monkeypatch.delitem(sys.modules, "transformers.masking_utils")
    with one_sequence_per_path():
        pass
    assert "transformers.masking_utils" not in sys.modules
