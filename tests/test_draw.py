"""``treefx draw`` / :func:`treefx.debug.draw` on trees too large to read: the picture shows the
first sequences, within a bounded size, and says so in the picture and on stdout."""

from __future__ import annotations

import re

import pytest
from pngs import read_png

import treefx
from treefx.tools.cli import main
from treefx.tools.debug import draw
from treefx.tools.debug.pictures import MAX_DEPTH, MAX_LEAVES, picture_part

# Pixels: 50 a leaf slot and 56 a layer (pictures.tree_png), the mask (512 at most, drawn 1:1)
# beside the tree, margins and titles.
MAX_W = MAX_LEAVES * 50 + 512 + 200
MAX_H = MAX_DEPTH * 56 + 200
_NOTE_RED = (176, 48, 48)


@pytest.fixture(scope="module")
def wide_tree():
    """An agent tree of several hundred sequences (the issue's had 376: 19,376 pixels wide)."""
    tree = treefx.synth.agent_tree(0, vocab_size=128, rollouts=64, system_len=(5, 10),
                                   prompt_len=(5, 10), think_len=(2, 5), answer_len=(2, 5),
                                   tool_len=(2, 5))
    assert tree.num_sequences > 300
    return tree


def test_cli_draws_the_first_sequences_of_a_wide_tree(wide_tree, tmp_path, capsys):
    path = tmp_path / "trees.jsonl"
    treefx.write_jsonl(path, [wide_tree])
    png = tmp_path / "tree.png"
    assert main(["draw", str(path), "-o", str(png)]) == 0
    out = capsys.readouterr().out
    part = picture_part(wide_tree)
    assert part.capped and 1 <= part.sequences < wide_tree.num_sequences
    assert (f"wrote {png}: showing the first {part.sequences} of {wide_tree.num_sequences} "
            "sequences") in out
    img = read_png(png.read_bytes())
    h, w, _ = img.shape
    assert w <= MAX_W and h <= MAX_H, (w, h)
    assert (img.reshape(-1, 3) == _NOTE_RED).all(1).any()  # the note is in the picture

    svg = tmp_path / "tree.svg"
    assert main(["draw", str(path), "-o", str(svg), "--max-leaves", "10"]) == 0
    text = svg.read_text(encoding="utf-8")
    w, h = map(int, re.search(r'width="(\d+)" height="(\d+)"', text).groups())
    assert w <= 10 * 50 + 1000 and h <= MAX_H
    small = picture_part(wide_tree, max_leaves=10)
    assert f"showing the first {small.sequences} of {wide_tree.num_sequences} sequences" in text
    assert small.sequences < part.sequences


def test_picture_part_is_the_largest_prefix_that_fits(wide_tree):
    part = picture_part(wide_tree, max_leaves=25)
    sub = wide_tree.subtree(range(part.sequences))
    assert part.trees[0] == sub and part.tokens == sub.num_tokens
    assert part.total_sequences == wide_tree.num_sequences
    assert part.total_tokens == wide_tree.num_tokens

    def leaves(tree):
        inner = set(tree.parents[tree.parents >= 0].tolist())
        return tree.num_nodes - len(inner)

    assert leaves(sub) <= 25 < leaves(wide_tree.subtree(range(part.sequences + 1)))


def test_a_deep_chain_is_cut_by_depth(tmp_path):
    # Each sequence extends the one before by a token: one leaf, as deep as it has sequences.
    chain = treefx.Tree.from_sequences([list(range(1, k + 1)) for k in range(1, 150)])
    part = picture_part(chain)
    assert part.sequences == MAX_DEPTH and part.capped
    img = read_png(open(draw(chain, tmp_path / "chain.png"), "rb").read())
    assert img.shape[0] <= MAX_H


def test_a_tree_that_fits_is_drawn_whole(tmp_path, capsys):
    tree = treefx.Tree.from_sequences([[1, 2, 3], [1, 2, 4], [5, 6]])
    assert not picture_part(tree).capped
    path = tmp_path / "t.jsonl"
    treefx.write_jsonl(path, [tree])
    png = tmp_path / "t.png"
    assert main(["draw", str(path), "-o", str(png)]) == 0
    assert capsys.readouterr().out == f"wrote {png}\n"
    img = read_png(png.read_bytes())
    assert not (img.reshape(-1, 3) == _NOTE_RED).all(1).any()


def test_draw_rejects_bad_limits(tmp_path):
    tree = treefx.Tree.from_sequences([[1, 2]])
    with pytest.raises(ValueError, match="max_mask must be at least 1"):
        draw(tree, tmp_path / "t.png", max_mask=0)
    with pytest.raises(ValueError, match="max_leaves and max_depth must be at least 1"):
        draw(tree, tmp_path / "t.png", max_leaves=0)
