"""GPT-Neo's local-attention table and MPT's ALiBi, cut to the token count
(:mod:`treefx.families.position_tables`): read at path positions, each query at its own prefix
length. Models built from a config with random weights (test_model_positions' builder, which
also covers these families with flex, windows and checkpointing); exact against the
per-branch oracle."""

from __future__ import annotations

import pytest
import torch
from support import VOCAB, check_against_oracle
from trees import odd_forest

import treefx
from treefx.families.position_tables import SymFn

transformers = pytest.importorskip("transformers")
sympy = pytest.importorskip("sympy")

from test_model_positions import model_of  # noqa: E402  (needs transformers)


@pytest.mark.parametrize("name", ["gpt_neo", "mpt"])
def test_table_read_at_path_positions_matches_oracle(name):
    tm = treefx.compile(model_of(name), backend="eager")
    check_against_oracle(tm, odd_forest(3, VOCAB))
    notes = [r.note for c in tm.contexts for r in c.log if r.pass_name == "positions"]
    assert "a table cut to the token count" in notes, notes


def test_size_expression_at_prefix_lengths():
    n = sympy.Symbol("s0", positive=True, integer=True)
    lengths = torch.tensor([[1], [5], [300]])
    f = SymFn(sympy.Max(0, 256 - n), n)
    assert f(lengths).flatten().tolist() == [255, 251, 0]
    assert SymFn(sympy.Integer(7), n)(lengths).flatten().tolist() == [7, 7, 7]
