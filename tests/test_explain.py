"""treefx.tools.debug (treefx.debug): the explain report, its diff and HTML page, the pictures,
and the ``treefx explain`` / ``treefx draw`` commands."""

from __future__ import annotations

import base64
import re

import numpy as np
import pytest
import torch
from pngs import read_png
from support import BreaksGraph, Wrapper
from trees import odd_forest, odd_tree

import treefx
from treefx.tools.cli import main
from treefx.tools.debug import draw, explain, mask_svg, pooled_mask, tree_svg
from treefx.tools.debug.pictures import png_bytes
from treefx.models import tiny_decoder

transformers = pytest.importorskip("transformers")

VOCAB = 64
ATTENTION = {"model.layers.0.self_attn", "model.layers.1.self_attn"}
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
# Qwen3 with SDPA (the removed call is scaled_dot_product_attention), Llama with eager
# attention (the removed calls are matmul, softmax, matmul).
HF = {"qwen3": (dict(SMALL, head_dim=8), "sdpa"), "llama": (SMALL, "eager")}


def hf_model(name: str) -> torch.nn.Module:
    cfg, impl = HF[name]
    config = transformers.AutoConfig.for_model(name, vocab_size=VOCAB, **cfg)
    config._attn_implementation = impl
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module", params=sorted(HF))
def hf_report(request):
    return request.param, explain(hf_model(request.param), odd_forest(1, VOCAB))


def test_report_names_every_attention_module_and_the_positions(hf_report):
    name, report = hf_report
    assert report.ok and report.status == "compiled"
    assert report.num_graphs == 1 and report.num_compilations == 1
    assert report.graph_breaks == [] and report.error is None
    attention = [r for r in report.rewrites if r.pass_name == "attention"]
    assert {r.module for r in attention} == ATTENTION
    assert all(re.match(r"\S+\.py:\d+ ", r.source) for r in attention)  # file:line code
    # Positions: the model builds its own (an arange), which becomes the tree positions, read
    # by the rotary embedding; the index grids of the mask it builds are tree positions too.
    assert any("tree positions" in p and "model.rotary_emb" in p for p in report.positions)
    text = str(report)
    for module in ATTENTION:
        assert module in text
    assert "tree positions" in text and "model.rotary_emb" in text
    assert report.status in text
    before = "scaled_dot_product_attention(" if name == "qwen3" else "softmax("
    assert any(before in ln and "tree_attention_dense(" in ln for ln in text.splitlines())
    assert len(text.splitlines()) < 40  # a short table


def test_diff_shows_the_removed_and_the_added_call(hf_report):
    name, report = hf_report
    diff = report.diff().splitlines()
    assert diff[0].startswith("--- graph 1 of 1 (the trees, forward): captured")
    assert diff[1].startswith("+++ graph 1 of 1 (the trees, forward): after the treefx "
                               "passes")
    removed = [ln for ln in diff if ln.startswith("-") and not ln.startswith("---")]
    added = [ln for ln in diff if ln.startswith("+") and not ln.startswith("+++")]
    if name == "qwen3":
        assert sum("scaled_dot_product_attention(" in ln for ln in removed) == 2
    else:
        assert sum(".softmax(" in ln for ln in removed) == 2
        assert sum("matmul(" in ln for ln in removed) == 4
    assert sum("treefx.ops.attention.reference.tree_attention_dense(" in ln for ln in added) == 2
    assert any("dense_tree_mask(" in ln for ln in added)
    # Nodes named by module path: parameters and a header per module.
    before, after = report.code_pair(0)
    assert any("self.model.layers.0.self_attn.q_proj.weight" in ln for ln in before)
    assert "    # --- model.layers.1.self_attn" in before
    assert "    # --- model.layers.1.self_attn" in after
    assert sum("# treefx attention: rewritten" in ln for ln in before) == 2


def _self_contained(page: str) -> None:
    assert 'src="http' not in page and "src='http" not in page
    assert "<link" not in page and "<script" not in page
    assert not re.search(r"url\(\s*['\"]?(?!data:)", page)
    assert not re.search(r"""(?:src|href)=["'](?!data:|#)""", page)


def test_html_page_is_self_contained_with_diff_and_pictures(hf_report, tmp_path):
    name, report = hf_report
    path = tmp_path / "explain.html"
    assert report.to_html(path) == str(path)
    page = path.read_text(encoding="utf-8")
    _self_contained(page)
    assert page.startswith("<!DOCTYPE html>") and "<style>" in page
    assert page.count("<svg") >= 2  # the tree and the mask
    # The mask's bitmap is an inline PNG that decodes.
    uris = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)
    assert uris and base64.b64decode(uris[0])[:8] == b"\x89PNG\r\n\x1a\n"
    assert 'class="diff"' in page  # the side-by-side diff
    assert "tree_attention_dense(" in page
    assert ("scaled_dot_product_attention(" if name == "qwen3" else "softmax(") in page
    for module in ATTENTION:
        assert module in page


def test_unmatched_attention_report_shows_the_node_that_stops(tmp_path):
    torch.manual_seed(0)
    report = explain(Wrapper(), odd_tree(8, VOCAB))  # records the error, does not raise
    assert not report.ok
    assert isinstance(report.error, treefx.UnmatchedAttentionError)
    assert report.stop_module == "block"
    assert report.stop_node.startswith("att = .softmax(")
    assert "support.py" in report.stop_source and "softmax" in report.stop_source
    assert report.num_graphs == 1 and report.num_compilations == 0
    text = str(report)
    assert "UnmatchedAttentionError" in text
    assert report.stop_node in text and report.stop_module in text
    assert "treefx stops here" in report.diff()
    page = tmp_path / "p.html"
    report.to_html(page)
    html = page.read_text(encoding="utf-8")
    _self_contained(html)
    assert "Compilation stops" in html and "att = .softmax(" in html


def test_graph_break_report_lists_the_breaks(tmp_path):
    report = explain(BreaksGraph(), odd_tree(9, VOCAB))
    assert isinstance(report.error, treefx.GraphBreakError)
    assert report.graph_breaks and any("item()" in b for b in report.graph_breaks)
    assert report.num_graph_breaks >= 1 and report.num_compilations == 0
    text = str(report)
    assert all(b in text for b in report.graph_breaks)
    report.to_html(tmp_path / "p.html")
    html = (tmp_path / "p.html").read_text(encoding="utf-8")
    _self_contained(html)
    assert "Graph breaks" in html and "item()" in html


def test_pooled_mask_is_the_or_pooled_dense_mask():
    for seed in range(3):
        batch = treefx.pack(odd_forest(seed, VOCAB), pad_to_multiple=16)
        dense = batch.dense_mask().numpy()
        n = dense.shape[0]
        grid, block = pooled_mask(batch.subtree_end, max_size=n)
        assert block == 1 and np.array_equal(grid, dense)
        for size in (5, 11, 32):
            grid, block = pooled_mask(batch.subtree_end, max_size=size)
            nb = -(-n // block)
            assert grid.shape == (nb, nb) and nb <= size
            ref = np.array([[dense[i * block:(i + 1) * block, j * block:(j + 1) * block].any()
                             for j in range(nb)] for i in range(nb)])
            assert np.array_equal(grid, ref)


def test_png_writer_round_trips():
    img = np.random.default_rng(0).integers(0, 256, size=(7, 5, 3), dtype=np.uint8)
    assert np.array_equal(read_png(png_bytes(img)), img)


def test_pictures_of_a_large_tree_stay_small():
    tree = treefx.synth.agent_tree(0, vocab_size=VOCAB, rollouts=2)
    batch = treefx.pack(tree)
    assert batch.num_tokens > 2000
    svg = mask_svg(batch)
    png = base64.b64decode(re.search(r"base64,([A-Za-z0-9+/=]+)", svg).group(1))
    h, w, _ = read_png(png).shape
    assert h == w <= 512
    t = tree_svg(batch)
    assert t.count("<rect") == tree.num_nodes
    assert f"{batch.num_real_tokens} tokens" in t


@pytest.fixture
def trees_file(tmp_path):
    path = tmp_path / "trees.jsonl"
    treefx.write_jsonl(path, odd_forest(3, VOCAB))
    return path


def test_cli_draw(trees_file, tmp_path, capsys):
    png = tmp_path / "tree.png"
    assert main(["draw", str(trees_file), "-o", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    img = read_png(png.read_bytes())
    assert img.shape[0] > 50 and img.shape[1] > 100 and len(np.unique(img.reshape(-1, 3), 0)) > 3
    svg = tmp_path / "tree.svg"
    assert main(["draw", str(trees_file), "-o", str(svg), "--index", "1"]) == 0
    text = svg.read_text(encoding="utf-8")
    assert text.startswith("<svg") and "data:image/png;base64," in text
    tree = list(treefx.read_jsonl(trees_file))[1]
    assert f"{tree.num_tokens} tokens" in text
    with pytest.raises(SystemExit, match="out of range"):
        main(["draw", str(trees_file), "-o", str(svg), "--index", "5"])
    with pytest.raises(SystemExit, match=r"\.png or \.svg"):
        main(["draw", str(trees_file), "-o", str(tmp_path / "tree.jpg")])
    assert draw(odd_tree(2, VOCAB), tmp_path / "t.png").endswith("t.png")


def test_cli_explain_default_tree(tmp_path, capsys):
    page = tmp_path / "out.html"
    assert main(["explain", "treefx.tools.debug.examples:qwen3_tiny", "--html", str(page),
                 "-v"]) == 0
    captured = capsys.readouterr()
    assert "Qwen3ForCausalLM" in captured.out and "status: compiled" in captured.out
    for module in ATTENTION:
        assert module in captured.out
    assert f"wrote {page}" in captured.out
    assert "treefx: pass attention: 2 rewrite(s)" in captured.err  # -v: the pass log
    _self_contained(page.read_text(encoding="utf-8"))


def test_cli_explain_trees_file(trees_file, tmp_path, capsys):
    page = tmp_path / "llama.html"
    assert main(["explain", "treefx.tools.debug.examples:llama_tiny", "--trees", str(trees_file),
                 "-n", "1", "--html", str(page), "--diff"]) == 0
    out = capsys.readouterr().out
    tree = next(treefx.read_jsonl(trees_file))
    assert f"1 tree, {tree.num_tokens} tokens" in out
    assert "+++ graph 1 of 1 (the trees, forward): after the treefx passes" in out  # --diff
    assert page.exists()


def test_cli_explain_bad_factory():
    with pytest.raises(SystemExit, match="MODULE:FACTORY"):
        main(["explain", "treefx.tools.debug.examples"])
    with pytest.raises(SystemExit, match="has no 'nope'"):
        main(["explain", "treefx.tools.debug.examples:nope"])
    with pytest.raises(SystemExit, match="cannot import"):
        main(["explain", "no_such_module_xyz:f"])


def test_two_graphs_are_labelled(tmp_path):
    """With the probe check on, the report holds two graphs (the trees' forward, the probe's
    forward and backward): each listing says which graph it is."""
    torch.manual_seed(0)
    report = explain(tiny_decoder(vocab_size=VOCAB), odd_tree(2, VOCAB),
                     verify=True)
    assert report.num_graphs == 2 and report.verification.passed
    titles = ["graph 1 of 2 (the trees, forward)",
              "graph 2 of 2 (the check's probe forest, forward and backward)"]
    assert [report.graph_title(g) for g in report.graphs] == titles
    lines = str(report).splitlines()
    rewritten = lines[lines.index("rewritten") + 1:lines.index("left alone")]
    assert [ln.strip() for ln in rewritten if ln.strip().startswith("graph ")] == titles
    assert all(f"--- {t}: captured" in report.diff() for t in titles)
    report.to_html(tmp_path / "p.html")
    page = (tmp_path / "p.html").read_text(encoding="utf-8")
    assert all(t.replace("'", "&#x27;") in page for t in titles)


def test_cli_explain_exit_status_as_check(tmp_path, capsys):
    """A model treefx refuses: exit status 2 from explain as from check (the report says
    where it stops)."""
    page = tmp_path / "e.html"
    assert main(["explain", "support:EinsumAttention", "--html", str(page)]) == 2
    out = capsys.readouterr().out
    assert "UnmatchedAttentionError" in out and page.exists()
