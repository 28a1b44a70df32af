"""Sliding windows leave key blocks out of the tree's block mask: a site whose model mask has a
window conjunct (``kv > q - W`` and its rearrangements, read from the lifted mask's
structure) lists only the key blocks that could hold a pair within the window. Checked block
by block against the dense tree-and-window mask, and end to end against the oracle."""

from __future__ import annotations

import random

import pytest
import torch
from trees import check_forward, odd_forest

import treefx
from treefx.mask import dense_tree_mask, tree_block_tensors


def _listed(num, idx, rows, cols):
    out = torch.zeros(rows, cols, dtype=torch.bool)
    for r in range(rows):
        out[r, idx[0, 0, r, : num[0, 0, r]].long()] = True
    return out


def long_trees(vocab: int, seed: int = 0) -> list[treefx.Tree]:
    """A tree of sequences up to ~130 tokens sharing prefixes of every length (many blocks of
    16 beyond a window of a few tokens), and the odd forest."""
    rng = random.Random(seed)
    base = [rng.randrange(4, vocab) for _ in range(60)]
    seqs = [base[:rng.randrange(1, 60)] + [rng.randrange(4, vocab)
                                           for _ in range(rng.randrange(1, 70))]
            for _ in range(4)]
    return [treefx.Tree.from_sequences(seqs), *odd_forest(seed + 2, vocab)]


@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("window", [0, 3, 17, 1000])
def test_window_blocks_list_every_pair_within_the_window(block, window):
    dropped = 0
    for seed in range(3):
        batch = treefx.pack(long_trees(64, seed))
        se, pos = batch.subtree_end, batch.position_ids[0]
        n = se.numel()
        kv_num, kv_idx, full_num, full_idx, _ = tree_block_tensors(se, block, full=True,
                                                                   positions=pos, window=window)
        nb = kv_num.shape[-1]
        assert int(full_num.sum()) == 0  # the window is applied by the mask_mod: no full block
        listed = _listed(kv_num, kv_idx, nb, nb)
        need = dense_tree_mask(se) & (pos[:, None] - pos[None, :] <= window)
        pad = nb * block - n
        need = torch.nn.functional.pad(need, (0, pad, 0, pad))
        need = need.view(nb, block, nb, block).any(3).any(1)
        assert not (need & ~listed).any(), "a block with a pair inside the window is left out"
        tree_only = _listed(*tree_block_tensors(se, block, full=False)[:2], nb, nb)
        assert not (listed & ~tree_only).any()
        dropped += int((tree_only & ~listed).sum())
    if window <= 17:
        assert dropped > 0  # the window leaves blocks out
    if window >= 1000:
        assert dropped == 0  # wider than every path: the tree's blocks


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_windowed_sites_match_oracle(name):
    """Mistral (SDPA, window 5) and Gemma 2 (eager with a softcap, alternating windows) through
    the inductor backend's graph run eagerly, with blocks of 16 so that the window leaves
    blocks out."""
    from treefx.tools.zoo import build_model

    model = build_model(name).double()
    if name == "gemma2":
        model.set_attn_implementation("eager")
    tm = treefx.compile(model, backend="flex-eager", verify=False, block_size=16)
    check_forward(tm, long_trees(model.config.vocab_size), atol=1e-6, pad_to_multiple=16)
    notes = [r.note for c in tm.contexts for r in c.log if r.pass_name == "attention"]
    assert any("beyond its window (4)" in n for n in notes), notes


class WindowForms(torch.nn.Module):
    """One attention layer whose mask is causal and bounded by ``form``."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.emb = torch.nn.Embedding(64, 32)
        self.qkv = torch.nn.Linear(32, 96)
        self.head = torch.nn.Linear(32, 64)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        n = x.shape[1]
        pos = torch.arange(n, device=x.device)
        q, kv = pos[:, None], pos[None, :]
        causal = kv <= q
        if self.form == "difference":
            mask = causal & (q - kv <= 6)
        elif self.form == "shifted":
            mask = (kv + 7 > q) & causal
        else:  # "lower bound": keys at least 2 back, no window
            mask = causal & (q - kv >= 2) | (kv == q)
        a, b, c = (t.view(1, n, 4, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        o = torch.nn.functional.scaled_dot_product_attention(a, b, c, attn_mask=mask)
        return self.head(o.transpose(1, 2).reshape(1, n, 32))


@pytest.mark.parametrize("form, window", [("difference", 6), ("shifted", 6),
                                          ("lower bound", None)])
def test_window_read_from_the_mask(form, window):
    torch.manual_seed(0)
    model = WindowForms(form).double()
    tm = treefx.compile(model, backend="flex-eager", verify=False, block_size=16)
    check_forward(tm, long_trees(64), atol=1e-9, pad_to_multiple=16)
    notes = [r.note for c in tm.contexts for r in c.log if r.pass_name == "attention"]
    assert any(f"beyond its window ({window})" in n for n in notes) == (window is not None)


class AdditiveWindow(torch.nn.Module):
    """Eager attention with the additive mask written as transformers 5.17 writes it
    (``torch.where(mask, torch.tensor(0.0), min)``): lifted as a mask, not kept as a bias,
    so its window leaves blocks out and the causal part is implied by the tree."""

    def __init__(self, window):
        super().__init__()
        self.window = window
        self.emb = torch.nn.Embedding(64, 32)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(32, 96) for _ in range(2))
        self.head = torch.nn.Linear(32, 64)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        n = x.shape[1]
        pos = torch.arange(n, device=x.device)
        causal = pos[None, :] <= pos[:, None]
        masks = (causal & (pos[None, :] > pos[:, None] - self.window), causal)
        for qkv, allowed in zip(self.qkv, masks):
            add = torch.where(allowed, torch.tensor(0.0, dtype=x.dtype, device=x.device),
                              torch.finfo(x.dtype).min)
            q, k, v = (t.view(1, n, 4, 8).transpose(1, 2) for t in qkv(x).chunk(3, -1))
            w = torch.softmax(q @ k.transpose(-1, -2) * 8 ** -0.5 + add, dim=-1)
            x = x + (w @ v).transpose(1, 2).reshape(1, n, 32)
        return self.head(x)


def test_additive_mask_with_a_tensor_zero_is_lifted():
    torch.manual_seed(0)
    model = AdditiveWindow(5).double()
    tm = treefx.compile(model, backend="flex-eager", verify=False, block_size=16)
    check_forward(tm, long_trees(64), atol=1e-9, pad_to_multiple=16)
    notes = [r.note for c in tm.contexts for r in c.log if r.pass_name == "attention"]
    assert len(notes) == 2
    assert "beyond its window (4)" in notes[0] and "score_mod" not in notes[0], notes
    assert "implied by the tree" in notes[1] and "score_mod" not in notes[1], notes
