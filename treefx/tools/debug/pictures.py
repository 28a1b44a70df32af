"""Pictures of a packed batch: the tree (nodes with token and sequence counts) and its attention
mask, as SVG text or PNG bytes. No dependencies beyond numpy: SVG is written by hand, PNG with
zlib + struct, text in PNGs with a 3x5 pixel font.

The mask is never materialized as N x N: :func:`pooled_mask` ORs it over blocks straight from
``subtree_end`` (key k is visible to queries ``k .. subtree_end[k]-1``, one interval per key).
"""

from __future__ import annotations

import base64
import html
import math
import os
import re
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from ...layout import TreeBatch, pack
from ...mask import pooled_mask
from ...tree import Tree

__all__ = [
    "MAX_DEPTH",
    "MAX_LEAVES",
    "PicturePart",
    "TreeLayout",
    "draw",
    "layout_tree",
    "mask_png",
    "mask_svg",
    "picture_part",
    "png_bytes",
    "pooled_mask",
    "tree_png",
    "tree_svg",
]

# What a person can read: at most MAX_LEAVES leaves across (50 pixels each) and MAX_DEPTH nodes
# deep (56 pixels each). A larger tree is drawn from its first sequences, and the picture says so
# (an agent tree of 376 sequences was 19,376 pixels wide in full).
MAX_LEAVES = 40
MAX_DEPTH = 40

# Colours: shared nodes (several sequences through them) and unique ones; one hue per tree.
_SHARED = (47, 111, 186)
_UNIQUE = (150, 160, 172)
_TREE_COLORS = [(47, 111, 186), (214, 110, 36), (52, 150, 86), (160, 70, 160), (190, 60, 70),
                (30, 150, 160), (130, 110, 40)]
_PAD = (190, 190, 190)
_BG = (255, 255, 255)
_OFF = (238, 241, 245)


def _hex(c) -> str:
    return "#%02x%02x%02x" % tuple(c)


# ---------------------------------------------------------------------------------------- PNG

def png_bytes(rgb: np.ndarray) -> bytes:
    """PNG file bytes of an [H, W, 3] uint8 image."""
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    h, w, c = rgb.shape
    if c != 3:
        raise ValueError(f"expected an [H, W, 3] image, got shape {rgb.shape}")
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rgb.reshape(h, w * 3)], axis=1).tobytes()

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


# ---------------------------------------------------------------------------------------- mask

def _as_batch(x) -> TreeBatch:
    if isinstance(x, TreeBatch):
        return x
    if isinstance(x, Tree) or isinstance(x, (list, tuple)) and x and isinstance(x[0], Tree):
        return pack(x)
    raise TypeError(f"expected a TreeBatch, a Tree or a list of Trees, got {type(x).__name__}")




def _mask_rgb(batch: TreeBatch, max_size: int = 512) -> tuple[np.ndarray, int]:
    """[B, B, 3] picture of the pooled mask, cells coloured by the tree of their query block."""
    grid, block = pooled_mask(batch.subtree_end, max_size)
    nb = grid.shape[0]
    tix = batch.tree_index.cpu().numpy()[::block][:nb]
    pal = np.array(_TREE_COLORS + [_PAD], np.uint8)
    row_color = pal[np.where(tix >= 0, tix % len(_TREE_COLORS), len(_TREE_COLORS))]
    img = np.empty((nb, nb, 3), np.uint8)
    img[:] = _OFF
    img[grid] = np.broadcast_to(row_color[:, None, :], (nb, nb, 3))[grid]
    return img, block


def mask_png(batch, max_size: int = 512, min_size: int = 256) -> bytes:
    """A PNG picture of a tree's attention mask.

    PNG of the tree mask: one pixel per token (upscaled to at least ``min_size`` pixels for
    small batches) or per OR-pooled block of tokens (at most ``max_size``)."""
    img, _ = _mask_rgb(_as_batch(batch), max_size)
    if len(img):
        f = max(1, min_size // len(img))
        img = img.repeat(f, 0).repeat(f, 1)
    return png_bytes(img)


def mask_svg(batch, size: int = 360, max_size: int = 512) -> str:
    """A self-contained SVG picture of a tree's attention mask.

    SVG of the tree mask (queries as rows, keys as columns) with axis labels; the bitmap is
    an inline base64 PNG, so the SVG is self-contained."""
    batch = _as_batch(batch)
    img, block = _mask_rgb(batch, max_size)
    n = batch.num_tokens
    png = png_bytes(img) if len(img) else png_bytes(np.full((1, 1, 3), 255, np.uint8))
    m, top = 34, 30
    w, h = size + m + 10, size + top + 34
    cell = f"{block}×{block} tokens a pixel, OR-pooled" if block > 1 else "one token a pixel"
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink" '
        f'width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" '
        f'class="treefx-mask">'
        f'<text x="{m}" y="14" font-size="13" font-weight="bold">attention mask, '
        f'{n}×{n}</text>'
        f'<text x="{m}" y="{top - 5}" font-size="11" fill="#555">keys →</text>'
        f'<text x="{m - 8}" y="{top + 4}" font-size="11" fill="#555" '
        f'transform="rotate(90 {m - 8} {top + 4})">queries →</text>'
        f'<rect x="{m - 1}" y="{top - 1}" width="{size + 2}" height="{size + 2}" fill="none" '
        f'stroke="#999"/>'
        f'<image x="{m}" y="{top}" width="{size}" height="{size}" preserveAspectRatio="none" '
        f'style="image-rendering:pixelated" image-rendering="optimizeSpeed" '
        f'xlink:href="{_data_uri(png)}"/>'
        f'<text x="{m}" y="{top + size + 16}" font-size="11" fill="#555">key k is visible to '
        f'query q iff k ≤ q &lt; subtree_end[k]</text>'
        f'<text x="{m}" y="{top + size + 30}" font-size="11" fill="#555">{html.escape(cell)}'
        f'</text></svg>'
    )


# ---------------------------------------------------------------------------------------- tree

@dataclass
class TreeLayout:
    """Layered layout of a batch's nodes (DFS order over the forest)."""

    x: np.ndarray  # slot units (leaves at 0, 1, 2, ...; parents centred over their children)
    depth: np.ndarray  # layer (node depth)
    parent: np.ndarray
    tokens: np.ndarray  # tokens in the node
    sequences: np.ndarray  # sequences through the node (paths that contain it)
    ends: np.ndarray  # sequences ending in the node
    tree: np.ndarray  # tree of the forest the node belongs to
    num_slots: int
    num_layers: int


def layout_tree(batch) -> TreeLayout:
    batch = _as_batch(batch)
    parent = batch.node_parent.cpu().numpy()
    tokens = batch.node_length.cpu().numpy()
    offsets = batch.node_offset.cpu().numpy()
    m = len(parent)
    ends = np.bincount(batch.sequence_node_ends.cpu().numpy(), minlength=m)
    seqs = ends.copy()
    for i in range(m - 1, -1, -1):  # preorder: children come after their parent
        if parent[i] >= 0:
            seqs[parent[i]] += seqs[i]
    depth = np.zeros(m, np.int64)
    children: list[list[int]] = [[] for _ in range(m)]
    for i in range(m):
        if parent[i] >= 0:
            depth[i] = depth[parent[i]] + 1
            children[parent[i]].append(i)
    x = np.zeros(m)
    slot = 0
    roots = [i for i in range(m) if parent[i] < 0]
    for r in roots:
        # post-order without recursion
        stack = [(r, False)]
        while stack:
            v, done = stack.pop()
            if done:
                ch = children[v]
                x[v] = (x[ch[0]] + x[ch[-1]]) / 2 if ch else slot
                if not ch:
                    slot += 1
                continue
            stack.append((v, True))
            stack.extend((c, False) for c in reversed(children[v]))
        slot += 0.5  # a gap between the trees of a forest
    tix = batch.tree_index.cpu().numpy()
    tree = tix[offsets] if m else np.zeros(0, np.int64)
    return TreeLayout(x, depth, parent, tokens, seqs, ends, tree,
                      max(1, math.ceil(slot - 0.5)) if m else 0,
                      int(depth.max()) + 1 if m else 0)


def tree_svg(batch, *, slot: int = 50, layer: int = 58, max_width: int | None = None,
             note: str | None = None) -> str:
    """An SVG picture of a tree or a forest.

    SVG of the tree(s): one box a node, labelled with its token count and ``×k``, the number
    of sequences through it (what per-sequence training would compute k times). ``note``: a
    line under the title (what part of a larger tree this is)."""
    batch = _as_batch(batch)
    L = layout_tree(batch)
    bw, bh = slot - 8, 34
    pad, top = 12, 44 + (16 if note else 0)
    w = int(L.num_slots * slot + 2 * pad)
    w = max(w, 600, 7 * len(note or "") + 2 * pad)
    h = int(L.num_layers * layer + top + pad)
    trees = len(batch.trees)
    title = (f"{trees} tree{'s' if trees != 1 else ''}, {len(L.parent)} nodes, "
             f"{batch.num_real_tokens} tokens, {batch.num_sequences} sequences "
             f"({batch.num_baseline_tokens} tokens one by one)")
    style = f' style="max-width:{max_width}px"' if max_width else ""
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        f'viewBox="0 0 {w} {h}" font-family="sans-serif" class="treefx-tree"{style}>',
        f'<text x="{pad}" y="16" font-size="13" font-weight="bold">{html.escape(title)}</text>',
        f'<text x="{pad}" y="32" font-size="11" fill="#555">box: tokens in the node · ×k: '
        f'sequences through it (computed once here, k times one sequence at a time)</text>',
    ]
    if note:
        out.append(f'<text x="{pad}" y="48" font-size="12" font-weight="bold" fill="#b03030">'
                   f'{html.escape(note)}</text>')

    def cx(i):
        return pad + L.x[i] * slot + slot / 2

    def cy(i):
        return top + L.depth[i] * layer + bh / 2

    for i in range(len(L.parent)):
        p = L.parent[i]
        if p >= 0:
            x1, y1, x2, y2 = cx(p), cy(p) + bh / 2, cx(i), cy(i) - bh / 2
            ym = (y1 + y2) / 2
            out.append(f'<path d="M{x1:.1f} {y1:.1f} C{x1:.1f} {ym:.1f} {x2:.1f} {ym:.1f} '
                       f'{x2:.1f} {y2:.1f}" fill="none" stroke="#9aa5b1" stroke-width="1.5"/>')
    labels = len(L.parent) <= 3000
    for i in range(len(L.parent)):
        shared = L.sequences[i] > 1
        color = _hex(_TREE_COLORS[L.tree[i] % len(_TREE_COLORS)] if shared else _UNIQUE)
        x0, y0 = cx(i) - bw / 2, cy(i) - bh / 2
        tip = (f"node {i}: {L.tokens[i]} tokens, {L.sequences[i]} sequences through it, "
               f"{L.ends[i]} ending here")
        out.append(f'<g><title>{tip}</title><rect x="{x0:.1f}" y="{y0:.1f}" width="{bw}" '
                   f'height="{bh}" rx="5" fill="{color}"/>')
        if labels:
            out.append(f'<text x="{cx(i):.1f}" y="{y0 + 15:.1f}" font-size="12" '
                       f'font-weight="bold" fill="#fff" text-anchor="middle">{L.tokens[i]}</text>'
                       f'<text x="{cx(i):.1f}" y="{y0 + 28:.1f}" font-size="10" fill="#fff" '
                       f'text-anchor="middle">×{L.sequences[i]}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


# ---------------------------------------------------------------------------------------- raster

# 3x5 pixel font (rows top to bottom, 3 bits each).
_FONT = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111",
    "3": "111001111001111", "4": "101101111001001", "5": "111100111001111",
    "6": "111100111101111", "7": "111001001001001", "8": "111101111101111",
    "9": "111101111001111", "x": "000101010101000", "=": "000111000111000",
    ":": "000010000010000", ".": "000000000000010", "-": "000000111000000",
    ",": "000000000010100", " ": "000000000000000", "(": "010100100100010",
    ")": "010001001001010", "/": "001001010100100", "<": "001010100010001",
    "A": "010101111101101", "B": "110101110101110", "C": "011100100100011",
    "D": "110101101101110", "E": "111100110100111", "F": "111100110100100",
    "G": "011100101101011", "H": "101101111101101", "I": "111010010010111",
    "J": "001001001101010", "K": "101101110101101", "L": "100100100100111",
    "M": "101111111101101", "N": "111101101101101", "O": "010101101101010",
    "P": "110101110100100", "Q": "010101101110011", "R": "110101110101101",
    "S": "011100010001110", "T": "111010010010010", "U": "101101101101111",
    "V": "101101101101010", "W": "101101111111101", "X": "101101010101101",
    "Y": "101101010010010", "Z": "111001010100111",
}


class _Canvas:
    def __init__(self, w: int, h: int):
        self.img = np.empty((h, w, 3), np.uint8)
        self.img[:] = _BG

    def rect(self, x0, y0, x1, y1, color):
        h, w, _ = self.img.shape
        x0, x1 = max(0, int(round(x0))), min(w, int(round(x1)))
        y0, y1 = max(0, int(round(y0))), min(h, int(round(y1)))
        if x1 > x0 and y1 > y0:
            self.img[y0:y1, x0:x1] = color

    def text(self, x, y, s, color=(0, 0, 0), scale=2):
        for ch in s:
            g = _FONT.get(ch, _FONT.get(ch.upper(), _FONT[" "]))
            for r in range(5):
                for c in range(3):
                    if g[r * 3 + c] == "1":
                        self.rect(x + c * scale, y + r * scale, x + (c + 1) * scale,
                                  y + (r + 1) * scale, color)
            x += 4 * scale

    @staticmethod
    def text_width(s, scale=2):
        return len(s) * 4 * scale - scale

    def blit(self, x, y, img):
        h, w, _ = img.shape
        self.img[y:y + h, x:x + w] = img


def _tree_raster(c: _Canvas, L: TreeLayout, x_off: int, y_off: int, slot: int, layer: int):
    bw, bh = slot - 8, 34

    def cx(i):
        return x_off + L.x[i] * slot + slot / 2

    def ty(i):
        return y_off + L.depth[i] * layer

    edge = (154, 165, 177)
    for i in range(len(L.parent)):
        p = L.parent[i]
        if p >= 0:  # elbow connector: down, across, down
            ym = ty(i) - (layer - bh) / 2
            c.rect(cx(p) - 1, ty(p) + bh, cx(p) + 1, ym + 1, edge)
            c.rect(min(cx(p), cx(i)) - 1, ym - 1, max(cx(p), cx(i)) + 1, ym + 1, edge)
            c.rect(cx(i) - 1, ym - 1, cx(i) + 1, ty(i), edge)
    for i in range(len(L.parent)):
        shared = L.sequences[i] > 1
        color = _TREE_COLORS[L.tree[i] % len(_TREE_COLORS)] if shared else _UNIQUE
        c.rect(cx(i) - bw / 2, ty(i), cx(i) + bw / 2, ty(i) + bh, color)
        for k, s in enumerate((str(L.tokens[i]), f"x{L.sequences[i]}")):
            scale = 2 if c.text_width(s, 2) <= bw - 4 else 1
            tw = c.text_width(s, scale)
            c.text(int(cx(i) - tw / 2), int(ty(i) + (5 if k == 0 else 19)), s,
                   (255, 255, 255) if k == 0 else (225, 232, 240), scale)


def tree_png(batch, *, mask: bool = True, max_mask: int = 512, note: str | None = None) -> bytes:
    """PNG of the tree (and, with ``mask``, its attention mask to the right).

    ``note``: a line
    under the title (what part of a larger tree this is)."""
    batch = _as_batch(batch)
    L = layout_tree(batch)
    slot, layer, pad, top = 50, 56, 16, 52 + (16 if note else 0)
    tw = int(L.num_slots * slot)
    th = int(L.num_layers * layer)
    mimg = None
    if mask:
        mimg, block = _mask_rgb(batch, max_mask)
        f = max(1, min(8, 384 // max(1, len(mimg))))
        mimg = mimg.repeat(f, 0).repeat(f, 1)
    mw = mimg.shape[1] + 2 * pad if mimg is not None else 0
    title = (f"{len(batch.trees)} TREE(S), {len(L.parent)} NODES, "
             f"{batch.num_real_tokens} TOKENS, {batch.num_sequences} SEQUENCES")
    W = max(tw + 2 * pad + mw, 420, _Canvas.text_width(title) + 2 * pad,
            _Canvas.text_width(note or "") + 2 * pad)
    H = max(th, mimg.shape[0] + 14 if mimg is not None else 0) + top + pad
    c = _Canvas(W, H)
    c.text(pad, 10, title, (0, 0, 0), 2)
    c.text(pad, 30, "BOX: TOKENS   XK: SEQUENCES THROUGH THE NODE", (85, 85, 85), 1)
    if note:
        c.text(pad, 42, note.upper(), (176, 48, 48), 2)
    _tree_raster(c, L, pad, top, slot, layer)
    if mimg is not None:
        x0 = W - mw + pad
        n = batch.num_tokens
        c.text(x0, top - 12, f"MASK {n}X{n}" + (f" ({block}X{block} A PIXEL)" if block > 1 else ""),
               (85, 85, 85), 1)
        c.rect(x0 - 1, top - 1, x0 + mimg.shape[1] + 1, top + mimg.shape[0] + 1, (153, 153, 153))
        c.blit(x0, top, mimg)
    return png_bytes(c.img)


# ---------------------------------------------------------------------------------------- draw

@dataclass
class PicturePart:
    """The part of a forest that a picture shows: its first ``sequences`` sequences (all of
    them unless the whole is too large to read)."""

    trees: list  # the forest drawn (sub-trees of the first sequences when capped)
    sequences: int
    total_sequences: int
    tokens: int
    total_tokens: int

    @property
    def capped(self) -> bool:
        return self.sequences < self.total_sequences

    def note(self) -> str:
        return (f"showing the first {self.sequences} of {self.total_sequences} sequences "
                f"({self.tokens} of {self.total_tokens} tokens)")


def _extent(trees) -> tuple[int, int]:
    """(leaf slots across, nodes deep) of the picture of a forest, as :func:`layout_tree`
    lays it out (half a slot between trees)."""
    leaves, depth = 0, 0
    for t in trees:
        parents = np.asarray(t.parents)
        inner = np.zeros(len(parents), bool)
        inner[parents[parents >= 0]] = True
        leaves += int((~inner).sum())
        d = np.zeros(len(parents), np.int64)
        for i, p in enumerate(parents.tolist()):  # parents come before their children
            if p >= 0:
                d[i] = d[p] + 1
        depth = max(depth, int(d.max()) + 1 if len(d) else 0)
    return math.ceil(leaves + 0.5 * (len(trees) - 1)), depth


def picture_part(trees, *, max_leaves: int = MAX_LEAVES, max_depth: int = MAX_DEPTH
                 ) -> PicturePart:
    """The first sequences of ``trees`` (a Tree, a list of Trees or a TreeBatch, in order) whose
    picture is at most ``max_leaves`` leaves across and ``max_depth`` nodes deep: all of them
    when the whole fits. At least one sequence."""
    if max_leaves < 1 or max_depth < 1:
        raise ValueError(f"max_leaves and max_depth must be at least 1, got {max_leaves} and "
                         f"{max_depth}")
    forest = list(trees.trees) if isinstance(trees, TreeBatch) else (
        [trees] if isinstance(trees, Tree) else list(trees))
    total = sum(t.num_sequences for t in forest)
    total_tokens = sum(t.num_tokens for t in forest)

    def first(k: int) -> list[Tree]:
        out = []
        for t in forest:
            if k <= 0:
                break
            out.append(t if k >= t.num_sequences else t.subtree(range(k)))
            k -= t.num_sequences
        return out

    def fits(k: int) -> bool:
        leaves, depth = _extent(first(k))
        return leaves <= max_leaves and depth <= max_depth

    if fits(total):
        return PicturePart(forest, total, total, total_tokens, total_tokens)
    lo, hi = 1, total  # fits(lo) or lo == 1; not fits(hi). Sequences only add leaves and depth
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    part = first(lo)
    return PicturePart(part, lo, total, sum(t.num_tokens for t in part), total_tokens)


def draw(trees, path: str | os.PathLike, *, max_mask: int = 512, max_leaves: int = MAX_LEAVES,
         max_depth: int = MAX_DEPTH) -> str:
    """Draw a tree and its attention mask to a PNG or SVG file.

    Draw a tree (or a forest, or a packed batch) and its attention mask to ``path``: ``.png``
    (raster) or ``.svg`` (vector tree, bitmap mask inline). Returns the path.

    A forest more than ``max_leaves`` leaves across or ``max_depth`` nodes deep is drawn from
    its first sequences (:func:`picture_part`), tree and mask, and the picture says so."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".png", ".svg"):
        raise ValueError(f"cannot draw to {path!r}: use a .png or .svg file name")
    if max_mask < 1:
        raise ValueError(f"max_mask must be at least 1, got {max_mask}")
    part = picture_part(trees, max_leaves=max_leaves, max_depth=max_depth)
    batch = pack(part.trees) if part.capped else _as_batch(trees)
    note = part.note() if part.capped else None
    if ext == ".png":
        data = tree_png(batch, max_mask=max_mask, note=note)
        with open(path, "wb") as f:
            f.write(data)
    else:
        t = tree_svg(batch, note=note)
        m = mask_svg(batch, max_size=max_mask)
        tw, th = _svg_size(t)
        mw, mh = _svg_size(m)
        gap = 24
        W, H = tw + gap + mw, max(th, mh)
        body = (f'<svg xmlns="http://www.w3.org/2000/svg" '
                f'xmlns:xlink="http://www.w3.org/1999/xlink" width="{W}" height="{H}" '
                f'viewBox="0 0 {W} {H}"><rect width="{W}" height="{H}" fill="#fff"/>'
                f'<g>{_inner(t)}</g><g transform="translate({tw + gap} 0)">{_inner(m)}</g></svg>')
        with open(path, "w", encoding="utf-8") as f:
            f.write(body)
    return path


def _svg_size(svg: str) -> tuple[int, int]:
    m = re.search(r'width="(\d+)" height="(\d+)"', svg)
    return int(m.group(1)), int(m.group(2))


def _inner(svg: str) -> str:
    """An SVG's content wrapped as a nested <svg> with its own font settings."""
    start = svg.index(">") + 1
    head = svg[:start]
    font = re.search(r'font-family="[^"]*"', head)
    body = svg[start:-len("</svg>")]
    return f'<svg {font.group(0) if font else ""} overflow="visible">{body}</svg>'
