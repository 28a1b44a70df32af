"""Depth-first layout of one or several trees (a forest) as one token row.

Every subtree is a contiguous range of the row, so a key ``k`` is visible to a query ``q`` iff
``k <= q < subtree_end[k]``: one interval per key column, no N x N table needed.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .mask import dense_tree_mask, tree_block_mask
from .tree import Tree

__all__ = ["TreeBatch", "TreeOutput", "check_num_sequences", "known_host_row", "pack", "remember_host_row",
           "row_key"]

# The loss normalizations a batch may have (read by distributed.pack too).
REDUCTIONS = ("sum", "mean")


@dataclass(eq=False)
class TreeBatch:
    """N tokens of a forest of trees laid out depth-first (see :func:`pack`).

    Token tensors: ``input_ids`` and ``position_ids`` [1, N]; ``parent_token``,
    ``subtree_end``, ``loss_weights`` and ``tree_index`` (-1 on padding) [N].
    Node tensors, DFS order over the whole forest: ``node_offset`` (first token),
    ``node_length``, ``node_parent`` (-1 for roots). ``sequence_node_ends`` [P] holds the node
    each sequence ends in, ``sequence_tree`` [P] the tree it belongs to.
    ``num_sequences_normalizer``: the sequence count every loss weight is divided by (this
    batch's own count, or the global count given to :func:`pack`); :mod:`treefx.rl` divides
    by the same number. ``loss_scale``: the factor every loss weight is multiplied by (1
    unless given to :func:`pack`; the data-parallel world size under
    :func:`treefx.distributed.pack`, since DDP and FSDP average gradients over ranks);
    :mod:`treefx.rl` multiplies by the same number.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    parent_token: torch.Tensor
    subtree_end: torch.Tensor
    loss_weights: torch.Tensor
    tree_index: torch.Tensor
    node_offset: torch.Tensor
    node_length: torch.Tensor
    node_parent: torch.Tensor
    sequence_node_ends: torch.Tensor
    sequence_tree: torch.Tensor
    reduction: str
    num_real_tokens: int
    num_sequences_normalizer: int
    loss_weights_by_reduction: dict = field(repr=False)
    trees: list[Tree] = field(repr=False)
    max_token_id: int = field(default=-1, repr=False)  # from the host: no device sync to check
    loss_scale: float = 1.0
    _block_masks: dict = field(default_factory=dict, repr=False)
    _parent_list: list | None = field(default=None, repr=False)
    # reduction -> why its weights are unusable in the batch's weight dtype (see pack)
    _weight_errors: dict = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ sizes

    @property
    def num_tokens(self) -> int:
        """Tokens in the row, padding included."""
        return int(self.input_ids.shape[-1])

    @property
    def num_padding(self) -> int:
        return self.num_tokens - self.num_real_tokens

    @property
    def num_sequences(self) -> int:
        return int(self.sequence_node_ends.numel())

    @property
    def num_baseline_tokens(self) -> int:
        return sum(t.num_baseline_tokens for t in self.trees)

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    # ------------------------------------------------------------------ per sequence

    def sequence_index(self, i: int) -> torch.Tensor:
        """DFS indices of sequence ``i``'s tokens, in order (sequences numbered over the forest
        in pack order, each tree's in its input order)."""
        if not 0 <= i < self.num_sequences:
            raise IndexError(f"sequence {i} out of range; the batch holds {self.num_sequences}")
        if self._parent_list is None:
            self._parent_list = self.node_parent.tolist()
        parent = self._parent_list
        n = int(self.sequence_node_ends[i])
        path = []
        while n >= 0:
            path.append(n)
            n = parent[n]
        path.reverse()
        off, ln = self.node_offset[path], self.node_length[path]
        return torch.cat([torch.arange(int(o), int(o) + int(k)) for o, k in zip(off, ln)]).to(
            self.device
        )

    def loss_weights_for(self, reduction: str) -> torch.Tensor:
        """``loss_weights`` as they would be for another per-sequence reduction."""
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if reduction in self._weight_errors:
            raise ValueError(self._weight_errors[reduction])
        return self.loss_weights_by_reduction[reduction]

    # ------------------------------------------------------------------ mapping access

    _KEYS = ("input_ids", "labels", "position_ids", "attention_mask")

    def __getitem__(self, key: str) -> torch.Tensor:
        """Mapping access as a Hugging Face collator's batch: ``input_ids``, ``labels`` (the
        tokens, -100 where no sequence trains on a token), ``position_ids`` (tree positions),
        ``attention_mask`` (ones: the tree mask replaces it inside a treefx step)."""
        if key == "input_ids":
            return self.input_ids
        if key == "position_ids":
            return self.position_ids
        if key == "attention_mask":
            return torch.ones_like(self.input_ids)
        if key == "labels":
            trained = (self.loss_weights_by_reduction["sum"] > 0)[None]
            return torch.where(trained, self.input_ids, torch.full_like(self.input_ids, -100))
        raise KeyError(f"{key!r}: a TreeBatch provides {', '.join(self._KEYS)}")

    def keys(self):
        return self._KEYS

    def __contains__(self, key) -> bool:
        return key in self._KEYS

    # ------------------------------------------------------------------ masks

    def dense_mask(self) -> torch.Tensor:
        """[N, N] boolean tree mask, rows are queries: ``mask[q, k] = k <= q < subtree_end[k]``."""
        return dense_tree_mask(self.subtree_end)

    def block_mask(self, block_size: int = 128):
        """FlexAttention ``BlockMask`` of the tree, built from per-block min/max of
        ``subtree_end`` (no N x N tensor). Cached per block size."""
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        key = (block_size, str(self.device))
        if key not in self._block_masks:
            self._block_masks[key] = tree_block_mask(self.subtree_end, block_size)
        return self._block_masks[key]

    # ------------------------------------------------------------------ moving

    _TENSOR_FIELDS = ("input_ids", "position_ids", "parent_token", "subtree_end",
                      "loss_weights", "tree_index", "node_offset", "node_length", "node_parent",
                      "sequence_node_ends", "sequence_tree")

    def to(self, device, non_blocking: bool = True) -> TreeBatch:
        """The batch on ``device``. From the CPU to a GPU its tensors travel as one pinned
        buffer per dtype, copied without blocking the host: a training loop can prepare the
        next batch while the GPU runs (the copies stay ordered before any kernel on the
        current stream that reads them). A CUDA device without CUDA is a ``RuntimeError``."""
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"batch.to({str(device)!r}): CUDA is not available here "
                               "(torch.cuda.is_available() is False); keep the batch on the CPU "
                               "with the model")
        reductions = list(self.loss_weights_by_reduction)
        tensors = [self.loss_weights_by_reduction[r] for r in reductions]
        tensors += [getattr(self, f) for f in self._TENSOR_FIELDS]
        moved = move_tensors(tensors, device, non_blocking)
        k = len(reductions)
        out = replace(self, _block_masks={}, _parent_list=self._parent_list,
                      loss_weights_by_reduction=dict(zip(reductions, moved[:k])),
                      **dict(zip(self._TENSOR_FIELDS, moved[k:])))
        if self.parent_token.device.type == "cpu" and device.type != "cpu":
            remember_host_row(out.parent_token, self.parent_token)
        return out


def row_key(t: torch.Tensor):
    """The identity of a tensor's current contents: device, address of its first element,
    dtype, layout and version counter (a view of the same memory laid out alike, e.g. row 0
    of a [1, N] tensor and the [N] row, has the same key); None for tensors without storage
    (fake and functional wrappers)."""
    try:
        layout = (t.numel(),) if t.is_contiguous() else (tuple(t.shape), t.stride())
        return (t.device, t.data_ptr(), t.dtype, layout, t._version)
    except Exception:  # noqa: BLE001  (no storage: no key)
        return None


_HOST_ROWS: OrderedDict = OrderedDict()  # row_key -> (device row, its host copy), newest last
_HOST_ROWS_KEPT = 16
_PINNED_ROWS: dict = {}  # row_key -> (device row, its host copy), kept until forgotten
_HOST_ROWS_LOCK = threading.Lock()  # a loader thread may move the next batch meanwhile


def remember_host_row(device_row: torch.Tensor, host_row, *, pinned: bool = False):
    """Keep the host copy (a CPU tensor or array, copied here) of a row on a device: the row
    :meth:`TreeBatch.to` moved there, and the graph input the engine stacks from it. The ops
    that read the tree's structure on the host (:mod:`treefx.ops.host_row`) then find it
    without copying the row back, which would wait for the device's queue. The device row is
    held: its memory cannot go to another tensor while its key is kept. The newest
    ``_HOST_ROWS_KEPT`` rows are kept; a ``pinned`` one (a part's rows, read again in its
    backward after every later part's forward) until :func:`forget_host_rows`. Returns the
    row's key (None where it has none)."""
    key = row_key(device_row)
    if key is None:
        return None
    if isinstance(host_row, torch.Tensor):
        host_row = host_row.numpy()
    entry = (device_row, np.array(host_row, dtype=np.int64))
    with _HOST_ROWS_LOCK:
        if pinned:
            _PINNED_ROWS[key] = entry
            return key
        _HOST_ROWS[key] = entry
        _HOST_ROWS.move_to_end(key)
        while len(_HOST_ROWS) > _HOST_ROWS_KEPT:
            _HOST_ROWS.popitem(last=False)
    return key


def forget_host_rows(keys) -> None:
    """Drop pinned rows (keys from :func:`remember_host_row`) and their device rows."""
    with _HOST_ROWS_LOCK:
        for key in keys:
            _PINNED_ROWS.pop(key, None)


def known_host_row(t: torch.Tensor) -> np.ndarray | None:
    """The host copy (int64) of the row ``t`` where :meth:`TreeBatch.to` moved it there and it
    is unchanged since (the same memory, layout and version); else None."""
    key = row_key(t)
    if key is None:
        return None
    with _HOST_ROWS_LOCK:
        hit = _PINNED_ROWS.get(key)
        if hit is not None:
            return hit[1]
        hit = _HOST_ROWS.get(key)
        if hit is None:
            return None
        _HOST_ROWS.move_to_end(key)
    return hit[1]


def move_tensors(tensors: list[torch.Tensor], device: torch.device,
                 non_blocking: bool = True) -> list[torch.Tensor]:
    """``tensors`` on ``device``, same shapes and dtypes. CPU tensors bound for a CUDA device
    are concatenated per dtype into one pinned buffer and copied once (``non_blocking``: the
    host does not wait for the copy); anything else moves tensor by tensor."""
    if device.type != "cuda" or not all(t.device.type == "cpu" for t in tensors):
        return [t.to(device) for t in tensors]
    return grouped_copy(tensors, device, pin=non_blocking)


def grouped_copy(tensors: list[torch.Tensor], device: torch.device,
                 pin: bool) -> list[torch.Tensor]:
    """One buffer per dtype (pinned if ``pin``, then copied without blocking), split back into
    views of ``tensors``' shapes."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    for dtype, idx in groups.items():
        # Each tensor starts on a 64-byte boundary of the buffer, as a fresh allocation
        # would (Inductor's kernels assume aligned inputs).
        unit = max(1, 64 // dtype.itemsize)
        sizes = [tensors[i].numel() for i in idx]
        slots = [-(-n // unit) * unit for n in sizes]
        flat = torch.empty(sum(slots), dtype=dtype, pin_memory=pin)
        for i, part, n in zip(idx, flat.split(slots), sizes):
            part[:n].copy_(tensors[i].reshape(-1))
        flat = flat.to(device, non_blocking=pin)
        for i, part, n in zip(idx, flat.split(slots), sizes):
            out[i] = part[:n].view(tensors[i].shape)
    return out


def subtree_tokens(parents: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Each node's subtree size in tokens (its own and its descendants'); a tree's nodes come
    parents first (each child after its parent)."""
    sub = np.asarray(lengths, dtype=np.int64).copy()
    for i in range(len(parents) - 1, -1, -1):
        if parents[i] >= 0:
            sub[parents[i]] += sub[i]
    return sub


def _dfs_order(parents: np.ndarray, lengths: np.ndarray, children_order=None) -> np.ndarray:
    """Preorder of the nodes, a node's children largest subtree first (by tokens; ties in index
    order).

    Any preorder lays the tree out right; this one keeps attention's block sparsity from
    depending on the token ids. A subtree's queries see their ancestors, and every sibling
    subtree laid out before them sits between those keys: a gap whose edges are partly masked
    blocks for all of the subtree's query blocks. Largest first, the gaps fall under the smaller
    subtrees. In a comb (every call's completion a leaf off the growing conversation) the trunk
    then stays contiguous: on the SWE-bench trees of BENCHMARKS.md, laying the leaves first
    computes 7-28% more attention blocks than the pairs need, against 1-3% this way
    (``benchmarks/layout_blocks.py``)."""
    n = len(parents)
    sub = subtree_tokens(parents, lengths)
    children: list[list[int]] = [[] for _ in range(n)]
    roots = []
    for i, p in enumerate(parents.tolist()):
        (children[p] if p >= 0 else roots).append(i)
    order, stack = [], roots[::-1]
    while stack:
        v = stack.pop()
        order.append(v)
        kids = children[v]
        if children_order is not None:  # (children, subtree sizes) -> their order
            kids = children_order(kids, sub)
        elif len(kids) > 1:
            kids = sorted(kids, key=lambda c: -sub[c])
        stack.extend(kids[::-1])
    return np.asarray(order, dtype=np.int64)


def check_num_sequences(num_sequences, own: int) -> int:
    """The loss normalizer: ``num_sequences`` checked, or ``own`` (the batch's own sequence
    count) when it is None.

    A global count is the number of sequences of the whole batch that this one is a part of
    (several micro-batches, several ranks, the parts of a partitioned tree), so it is a
    positive integer no smaller than ``own``. A smaller number is refused rather than taken:
    it would scale the loss up silently (the old "sum of per-tree means" was such a case).
    """
    if num_sequences is None:
        return own
    if not isinstance(num_sequences, numbers.Integral) or isinstance(num_sequences, bool):
        raise TypeError(
            f"num_sequences must be an integer count of sequences, got {num_sequences!r} "
            f"({type(num_sequences).__name__})"
        )
    if num_sequences < own:
        raise ValueError(
            f"num_sequences={int(num_sequences)} is smaller than the {own} sequences of this "
            "batch; it is the sequence count of the whole global batch (all micro-batches and "
            "ranks together) that the loss is averaged over, so at least this batch's own "
            "count. Leave it None to average over this batch; weigh sequences with Tree weights"
        )
    return int(num_sequences)


def _check_loss_scale(loss_scale) -> float:
    if not isinstance(loss_scale, numbers.Real) or isinstance(loss_scale, bool):
        raise TypeError(f"loss_scale must be a positive number, got {loss_scale!r} "
                        f"({type(loss_scale).__name__})")
    if not (math.isfinite(loss_scale) and loss_scale > 0):
        raise ValueError(f"loss_scale must be a finite positive number, got {loss_scale!r}")
    return float(loss_scale)


def _check_pad_token_id(pad_token_id) -> int:
    if not isinstance(pad_token_id, numbers.Integral) or isinstance(pad_token_id, bool):
        raise TypeError(
            f"pad_token_id must be an integer token id, got {pad_token_id!r} "
            f"({type(pad_token_id).__name__})"
        )
    if not 0 <= pad_token_id < 2**63:
        raise ValueError(f"pad_token_id must be a non-negative token id, got {pad_token_id}")
    return int(pad_token_id)


def pack(
    trees: Tree | Iterable[Tree],
    *,
    reduction: str = "mean",
    num_sequences: int | None = None,
    pad_to_multiple: int | None = None,
    pad_token_id: int = 0,
    weight_dtype: torch.dtype = torch.float64,
    loss_scale: float = 1.0,
    pad_node_tokens: int = 1,
) -> TreeBatch:
    """Lay one tree or a forest of trees out depth-first as one row of tokens.

    The batch's loss (``treefx.tree_loss``, ``@treefx.step``, every :mod:`treefx.rl`
    objective) is the mean over all its sequences, of all its trees:

        L = (1/P) · Σ_p ω_p · r_p · Σ_{j≥1} m_p(j) · ℓ_p(j)

    with ω_p the sequence's weight (``Tree`` weights, default 1), m_p its loss mask, r_p from
    ``reduction`` and P = ``num_sequences``. ``loss_weights`` holds, per token t, the sum of
    ``ω_p · r_p · m_p(t) / P`` over the sequences p through t.

    ``reduction``: how each sequence's token losses combine — ``"mean"`` (the default, the
    documented loss: r_p = 1 / its loss-masked predicted tokens; 0 when it has none) or
    ``"sum"`` (r_p = 1).
    ``num_sequences``: P, default the number of sequences in this batch (all trees). A global
    batch split into micro-batches, or over ranks, passes the global count to every ``pack``:
    the micro-batch losses and gradients then sum to those of the global batch's mean. At least
    this batch's own count (a part of a batch cannot hold more sequences than the whole).
    With DDP / FSDP, which average gradients over ranks, each rank's loss is also multiplied
    by the world size (``loss_scale``; :func:`treefx.distributed.pack` sets both). The parts
    of :func:`treefx.partition` take the whole tree's count.
    ``pad_to_multiple``: pad the row with inert tokens (weight 0, seen by no real token)
    to a multiple of this, with token id ``pad_token_id`` (a non-negative integer).
    ``pad_node_tokens``: the padding comes in nodes of up to this many tokens, each a root of
    its own chain (positions 0, 1, ...: keep it within the model's positions); 1, the
    default: each pad token its own root. A recurrent layer runs node by node, so a row
    padded with thousands of one-token roots hands it thousands of sequences; longer pad
    nodes make a few.
    ``loss_weights`` come out in ``weight_dtype``, a floating dtype (float64 by default, so
    weights summed over many sequences stay exact); a weight that it turns into 0 or inf
    (float16 and small weights over a large count, say) raises a ``ValueError``, for the other
    reduction when :meth:`TreeBatch.loss_weights_for` asks for it.
    ``loss_scale``: a positive factor s every loss weight is multiplied by (so every
    :mod:`treefx.rl` objective too), ``w_t = s · Σ_p ω_p r_p m_p(t) / P``; 1 by default. With
    data parallelism, where DDP / FSDP average the ranks' gradients, each rank packs its share
    with the global P and s = the world size W, so the mean of the W rank losses is the global
    batch's loss: :func:`treefx.distributed.pack` does both.
    """
    trees = _tree_list(trees, reduction)
    _check_padding(pad_to_multiple, pad_node_tokens)
    pad_token_id = _check_pad_token_id(pad_token_id)
    _check_weight_dtype(weight_dtype)
    normalizer = check_num_sequences(num_sequences, sum(t.num_sequences for t in trees))
    loss_scale = _check_loss_scale(loss_scale)

    rows = _Rows()
    for ti, tree in enumerate(trees):
        rows.add_tree(ti, tree, normalizer, loss_scale)
    num_real = rows.num_tokens
    if pad_to_multiple:
        rows.add_padding(pad_to_multiple, pad_node_tokens, pad_token_id)
    return rows.batch(trees, reduction, weight_dtype, num_real, normalizer, loss_scale)


def _tree_list(trees, reduction: str) -> list[Tree]:
    """:func:`pack`'s ``trees`` as a non-empty list of trees (``reduction`` checked first)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(trees, Tree):
        trees = [trees]
    trees = list(trees)
    if not trees:
        raise ValueError("pack needs at least one tree")
    for i, t in enumerate(trees):
        if not isinstance(t, Tree):
            raise TypeError(f"trees[{i}] is a {type(t).__name__}, not a treefx.Tree")
    return trees


def _check_padding(pad_to_multiple, pad_node_tokens) -> None:
    if pad_to_multiple is not None and (
        not isinstance(pad_to_multiple, int) or isinstance(pad_to_multiple, bool)
        or pad_to_multiple <= 0
    ):
        raise ValueError(f"pad_to_multiple must be a positive integer, got {pad_to_multiple!r}")
    if not isinstance(pad_node_tokens, numbers.Integral) or isinstance(pad_node_tokens, bool) \
            or pad_node_tokens <= 0:
        raise ValueError(f"pad_node_tokens must be a positive integer, got {pad_node_tokens!r}")


def _check_weight_dtype(weight_dtype) -> None:
    if not isinstance(weight_dtype, torch.dtype) or not weight_dtype.is_floating_point:
        raise ValueError(
            f"weight_dtype must be a floating torch dtype (float64, float32, ...), got "
            f"{weight_dtype!r}: loss weights are fractions, an integer dtype would make them 0"
        )


class _Rows:
    """The row :func:`pack` lays out, as numpy pieces per tree (then the padding), made one
    :class:`TreeBatch` by :meth:`batch`."""

    def __init__(self):
        self.ids, self.pos, self.par, self.send, self.tix = [], [], [], [], []
        self.wts: dict[str, list] = {r: [] for r in REDUCTIONS}
        self.n_off, self.n_len, self.n_par, self.s_end, self.s_tree = [], [], [], [], []
        self.num_tokens = self.num_nodes = 0

    def add_tree(self, ti: int, tree: Tree, normalizer: int, loss_scale: float) -> None:
        """Tree ``ti`` laid out depth-first after what the row holds."""
        tok_base, node_base = self.num_tokens, self.num_nodes
        order = _dfs_order(tree.parents, tree.segment_lengths)
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        lens = tree.segment_lengths[order]
        parents = tree.parents[order]
        parents = np.where(parents >= 0, rank[np.maximum(parents, 0)], -1)
        offs = np.concatenate([[0], np.cumsum(lens)[:-1]])
        n = int(lens.sum())
        # Subtree sizes bottom-up: preorder puts every child after its parent.
        sub = lens.copy()
        for i in range(len(order) - 1, 0, -1):
            if parents[i] >= 0:
                sub[parents[i]] += sub[i]
        node_of_tok = np.repeat(np.arange(len(order)), lens)
        within = np.arange(n) - offs[node_of_tok]
        depth = tree.node_depths[order]
        seg = np.concatenate([tree.segments[o] for o in order])
        parent_tok = np.arange(n) - 1
        first = within == 0
        pnode = parents[node_of_tok[first]]
        parent_tok[first] = np.where(pnode >= 0, offs[np.maximum(pnode, 0)] + lens[pnode] - 1, -1)
        ends = rank[tree.sequence_ends]
        for r in REDUCTIONS:
            w = _token_weights(tree, ends, offs, lens, parents, node_of_tok, r, normalizer,
                               loss_scale)
            w[depth[node_of_tok] + within == 0] = 0.0  # nothing predicts a sequence's 1st token
            self.wts[r].append(w)

        self.ids.append(seg)
        self.pos.append(depth[node_of_tok] + within)
        self.par.append(np.where(parent_tok >= 0, parent_tok + tok_base, -1))
        self.send.append((offs + sub)[node_of_tok] + tok_base)
        self.tix.append(np.full(n, ti))
        self.n_off.append(offs + tok_base)
        self.n_len.append(lens)
        self.n_par.append(np.where(parents >= 0, parents + node_base, -1))
        self.s_end.append(ends + node_base)
        self.s_tree.append(np.full(len(ends), ti))
        self.num_tokens += n
        self.num_nodes += len(order)

    def add_padding(self, pad_to_multiple: int, pad_node_tokens: int, pad_token_id: int) -> None:
        """Inert tokens up to a multiple of ``pad_to_multiple``, in nodes of up to
        ``pad_node_tokens`` tokens, each a root of its own chain."""
        num_real = self.num_tokens
        total = -(-num_real // pad_to_multiple) * pad_to_multiple
        k = total - num_real
        if k:
            ar = np.arange(num_real, total)
            rel = np.arange(k) % int(pad_node_tokens)  # a pad token's place in its node
            self.ids.append(np.full(k, pad_token_id))
            self.pos.append(rel)
            self.par.append(np.where(rel == 0, -1, ar - 1))
            self.send.append(np.minimum(ar - rel + int(pad_node_tokens), total))
            for r in REDUCTIONS:
                self.wts[r].append(np.zeros(k))
            self.tix.append(np.full(k, -1))

    def batch(self, trees: list[Tree], reduction: str, weight_dtype: torch.dtype,
              num_real: int, normalizer: int, loss_scale: float) -> TreeBatch:
        """The batch of the row: its tensors, the weights in ``weight_dtype`` (a weight that
        dtype loses raises for ``reduction``, or later for the other one)."""
        def cat(xs, dtype=torch.int64):
            return torch.from_numpy(np.ascontiguousarray(np.concatenate(xs))).to(dtype)

        wts = self.wts
        weights = {r: cat(wts[r], weight_dtype) for r in REDUCTIONS}
        errors = {r: e for r in REDUCTIONS
                  if (e := _weights_lost(np.concatenate(wts[r]), weights[r], r)) is not None}
        if reduction in errors:
            raise ValueError(errors[reduction])

        return TreeBatch(
            input_ids=cat(self.ids)[None],
            position_ids=cat(self.pos)[None],
            parent_token=cat(self.par),
            subtree_end=cat(self.send),
            loss_weights=weights[reduction].clone(),
            loss_weights_by_reduction=weights,
            tree_index=cat(self.tix),
            node_offset=cat(self.n_off),
            node_length=cat(self.n_len),
            node_parent=cat(self.n_par),
            sequence_node_ends=cat(self.s_end),
            sequence_tree=cat(self.s_tree),
            reduction=reduction,
            num_real_tokens=num_real,
            num_sequences_normalizer=normalizer,
            loss_scale=loss_scale,
            max_token_id=max(int(np.max(x)) for x in self.ids),
            trees=trees,
            _weight_errors=errors,
        )


# Losses are computed in float32 at least (token log-probs are promoted to it): a weight below
# its smallest normal number means nothing in any dtype, so only larger ones count as lost.
_FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)


def _weights_lost(exact: np.ndarray, cast: torch.Tensor, reduction: str) -> str | None:
    """Why ``cast`` (the float64 weights ``exact`` in a narrower dtype) would train wrongly —
    a weight that float32 holds but ``cast`` flushes to 0, or one that overflows — or None."""
    if cast.dtype == torch.float64:
        return None
    back = cast.double().numpy()
    bad = np.flatnonzero(((np.abs(exact) >= _FLOAT32_TINY) & (back == 0)) | ~np.isfinite(back))
    if not bad.size:
        return None
    t = int(bad[0])
    what = "underflows to 0" if np.isfinite(back[t]) else "overflows"
    return (f'loss weight of token {t} ({exact[t]:.3g}, reduction="{reduction}") {what} in '
            f"{cast.dtype} ({bad.size} tokens do); pack with weight_dtype=torch.float32 or "
            "torch.float64 (the default)")


def _token_weights(tree, ends, offs, lens, parents, node_of_tok, reduction,
                   normalizer: int, scale: float = 1.0) -> np.ndarray:
    """w_t = sum over sequences p through t of weight_p * r_p * mask_p(t) / normalizer * scale,
    float64 (a scale of 1 changes no bit).

    Masks default to all ones; then a sequence adds the same amount to every token of its path,
    so the sum runs over nodes (bottom-up), not tokens.
    """
    seq_len = tree.sequence_lengths
    n = int(lens.sum())
    if tree.loss_masks is None:
        predicted = (seq_len - 1).astype(np.float64)
        r = np.ones_like(predicted) if reduction == "sum" else _safe_inv(predicted)
        node_w = np.zeros(len(lens))
        np.add.at(node_w, ends, tree.weights * r / normalizer * scale)
        for i in range(len(lens) - 1, 0, -1):
            if parents[i] >= 0:
                node_w[parents[i]] += node_w[i]
        return node_w[node_of_tok].copy()
    w = np.zeros(n)
    for i, e in enumerate(ends.tolist()):
        path = []
        while e >= 0:
            path.append(e)
            e = int(parents[e])
        path.reverse()
        idx = np.concatenate([np.arange(offs[p], offs[p] + lens[p]) for p in path])
        m = tree.loss_masks[i].copy()
        m[0] = 0.0  # the first token is never predicted
        r = 1.0 if reduction == "sum" else _safe_inv(np.array([m.sum()]))[0]
        w[idx] += tree.weights[i] * r / normalizer * scale * m
    return w


def _safe_inv(x: np.ndarray) -> np.ndarray:
    """1/x, with 0 where x == 0 (a sequence with nothing to predict adds nothing)."""
    out = np.zeros_like(x, dtype=np.float64)
    np.divide(1.0, x, out=out, where=x > 0)
    return out


@dataclass
class TreeOutput:
    """What a tree-compiled model returns: its logits and each token's log-probability.

    ``logits`` [1, N, V] in DFS order (None for a model compiled with ``logits=False``);
    ``token_logprobs`` [N] (float32, float64 for a float64 model), entry t is
    log p(token t | its own sequence's prefix), 0 where t has no predecessor."""

    logits: torch.Tensor | None
    token_logprobs: torch.Tensor
