"""See what treefx does to a model: reports, graph diffs and pictures of trees.

See what treefx does to a model: ``explain(model, batch)`` reports every rewrite, every
node left alone and why, graph breaks or the node that stops compilation, with a graph-code diff
and an HTML page; ``draw(trees, "tree.png")`` pictures a tree and its attention mask."""

from .explain import ExplainReport, GraphReport, explain
from .pictures import draw, mask_png, mask_svg, pooled_mask, tree_png, tree_svg

__all__ = [
    "ExplainReport",
    "GraphReport",
    "draw",
    "explain",
    "mask_png",
    "mask_svg",
    "pooled_mask",
    "tree_png",
    "tree_svg",
]
