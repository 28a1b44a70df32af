"""Tree recurrence: run a chunked/recurrent state kernel over a DFS-packed tree.

Every tree node is one chunk whose initial state is its parent node's final state (zeros for a
root). Siblings read the same parent state, so autograd sums their gradients into it. All
nodes at the same depth run together as one batch, right-padded with *neutral* tokens (inputs
that leave the state unchanged, e.g. a log-decay of 0 and an update rate of 0), so the number
of sequential kernel calls is the tree's depth in nodes, not its node count. Neutrality is
measured on the kernel (:func:`padding_is_neutral`); where it fails, the nodes of a depth run
in groups of equal length, unpadded.

This is the plain-torch reference (any device, differentiable through the kernel's own torch
code). Node boundaries come from ``parent_token``: a node starts wherever a token's
predecessor is not the token just before it. Under AOTAutograd / Inductor it runs inside one
opaque custom op (:mod:`.traced`); a part of a tree starts from its context's states
(:mod:`.part`).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..host_row import derived, on_host

__all__ = ["Recurrence", "kernel_runs", "tree_nodes", "tree_recurrence", "padding_is_neutral"]

# (recurrence name, "varlen" | "padded" | "grouped") -> tree runs in this process: which
# kernel path ran (a benchmark reports it, so a result cannot silently be on the slow path).
_RUNS: dict[tuple[str, str], int] = {}


def kernel_runs() -> dict[tuple[str, str], int]:
    """How many tree runs of each recurrence took each path in this process: ``varlen`` (the
    kernel's variable-length form, e.g. fla's), ``padded`` (the kernel itself, a depth as a
    padded batch) or ``grouped`` (the kernel itself, nodes of equal length together).
    Differences of two calls tell what a piece of work ran."""
    return dict(_RUNS)


@dataclass
class Recurrence:
    """What a recurrent kernel's arguments mean.

    ``fn(*args, **kwargs) -> (output, final_state)`` with:
    - ``seq_args``: per-token inputs, name -> their sequence dim (batch is dim 0);
    - ``neutral``: per seq arg, the padding value that leaves the state unchanged (e.g. a decay
      of 0 in log space and an update rate ``beta`` of 0); unlisted seq args pad with 0;
    - ``initial_state`` / ``output_final_state``: the names of the state-in argument and of the
      flag that asks for the final state;
    - ``output_seq_dim``: the sequence dim of ``output``;
    - ``bare_output_without_state``: called without asking for the final state, the kernel
      returns ``output`` alone rather than ``(output, None)``;
    - ``output_like``: the seq arg whose shape and dtype ``output`` has (default: the first);
    - ``varlen``: optional fast path for CUDA tensors. ``varlen(seq, static, initial_state,
      cu_seqlens, cu_seqlens_cpu) -> (output, final_state)`` runs many nodes at once without
      padding: ``seq`` holds the seq args with batch 1 and the nodes laid end to end along
      their sequence dims, ``cu_seqlens`` (int64, n + 1, on the tensors' device) where each
      node starts and ``cu_seqlens_cpu`` the same on the host (a kernel that plans its chunks
      from it reads nothing back from the device), ``initial_state`` one state per node or
      None (all zero), ``static`` the other arguments by name. A ``varlen`` that takes a
      keyword ``final`` is called with ``final=False`` where no node of the call hands its
      state on, and may then return ``(output, None)``. Built in for Gated DeltaNet when
      flash-linear-attention (fla) is installed;
    - ``varlen_split``: optional ``varlen_split(seq, static, sizes) -> counts``: how many
      nodes (of the given token counts, in order) each ``varlen`` call takes, for a kernel
      with limits per call (fla launches nodes x heads blocks on a CUDA grid axis of at most
      65,535); None: all nodes of a level in one call;
    - ``varlen_devices``: the device types ``varlen`` runs on (others take the padded path);
    - ``varlen_check``: optional ``varlen_check(seq, static) -> bool``, asked before each tree
      run on those devices: whether ``varlen`` may run these arguments (the fla family says no
      where fla's gradients are not known to be right, and announces it); no: padded path;
    - ``tree_varlen``: optional, for the same devices as ``varlen``: the whole tree in one go,
      ``tree_varlen(seq, static, nodes, root_init, keep) -> (output row, {node: final state})``
      with ``seq`` the DFS row's seq args, ``nodes`` (starts, lengths, parents, depth),
      ``root_init`` the depth-0 nodes' initial states (or None: zeros) and final states for
      the nodes ``keep``; it returns None where it does not apply (the level loop runs).
      Built in for Gated DeltaNet on fla 0.4.2 (:mod:`treefx.families.fla_tree`);
    - ``tree_fn``: the function run over the tree in place of ``fn``, for a kernel without an
      initial-state parameter (Hugging Face's Mamba selective scan starts from zeros). It takes
      ``fn``'s arguments by the same names, plus ``initial_state`` and ``output_final_state``;
      the model still calls ``fn`` (whose signature binds the model's arguments).
    """

    name: str
    fn: Callable
    seq_args: dict[str, int]
    neutral: dict[str, float] = field(default_factory=dict)
    initial_state: str = "initial_state"
    output_final_state: str = "output_final_state"
    output_seq_dim: int = 1
    bare_output_without_state: bool = False  # without the flag: ``output`` alone, no tuple
    output_like: str = ""  # the seq arg whose shape and dtype the output has (default: first)
    varlen: Callable | None = None
    varlen_devices: tuple[str, ...] = ("cuda",)
    varlen_check: Callable | None = None
    varlen_split: Callable | None = None
    tree_varlen: Callable | None = None
    tree_fn: Callable | None = None
    marker: Callable | None = None
    signature: inspect.Signature | None = None

    @property
    def run(self) -> Callable:
        """The function run per tree level (and probed for neutral padding)."""
        return self.tree_fn or self.fn

    def bind(self, args, kwargs) -> dict:
        """All arguments by name (defaults filled in)."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        out = dict(bound.arguments)
        out.update(out.pop("kwargs", {}) or {})
        return out


def tree_nodes(parent_token: torch.Tensor, ends=None):
    """(starts, lengths, parent node, depth in nodes) of the tree's nodes, DFS order, as
    tuples (the structure is data: this runs eagerly, one host copy of the row, reused while
    the same unchanged row comes back). ``ends``: tokens that must end a node (a part's exit
    tokens, whose state is handed on; :mod:`.part`); computed afresh then, not reused."""
    if ends is not None:
        return _tree_nodes(on_host(parent_token), ends)
    return derived(parent_token, "recurrence nodes", _tree_nodes)


def _tree_nodes(par: np.ndarray, ends=None):
    n = par.shape[0]
    children = np.bincount(par[par >= 0], minlength=n)
    if ends is not None:  # tokens that must end a node (their state is handed on)
        children[np.asarray(ends, dtype=np.int64)] = 2
    t = np.arange(n)
    # A node starts where the predecessor is not the previous token, and right after a
    # branching token (its first child follows it in DFS order, yet starts a new node).
    prev_branches = np.concatenate([[False], children[:-1] > 1])
    is_start = (t == 0) | (par != t - 1) | prev_branches
    starts = np.flatnonzero(is_start)
    lengths = np.diff(np.append(starts, n))
    node_of_token = np.cumsum(is_start) - 1
    first_par = par[starts]
    parents = np.where(first_par >= 0, node_of_token[np.maximum(first_par, 0)], -1).tolist()
    depth: list[int] = []
    for p in parents:  # DFS order: a parent comes before its children
        depth.append(depth[p] + 1 if p >= 0 else 0)
    return tuple(starts.tolist()), tuple(lengths.tolist()), tuple(parents), tuple(depth)


def _pad_seq(x: torch.Tensor, dim: int, length: int, value: float) -> torch.Tensor:
    missing = length - x.shape[dim]
    if missing == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, missing]
    return F.pad(x, pad, value=value)


def tree_recurrence(rec: Recurrence, parent_token: torch.Tensor, args: tuple, kwargs: dict):
    """``rec.fn`` (``rec.tree_fn`` where given) over the tree; returns what the kernel returns
    on the DFS row without a final state, ``(output, None)`` or ``output`` (a tree has a final
    state per leaf, none for "the row"). Seq args the model passes as None (an absent gate)
    stay None."""
    row, _, _ = run_tree(rec, parent_token, args, kwargs)
    return row if rec.bare_output_without_state else (row, None)


def run_tree(rec: Recurrence, parent_token: torch.Tensor, args: tuple, kwargs: dict,
              root_state=None, nodes=None, keep=()):
    """(output row, final state per node, (starts, lengths, parents, depth)); a root node's
    initial state is ``root_state(its first token)`` (None: zeros). Final states are kept
    for the nodes with children and the nodes in ``keep``, and computed only where a kernel
    call has such a node: a state is heads x key x value channels (2 MiB in float32 at 32
    heads of 128), so the states of thousands of leaves (a forest of short trees, a row
    padded with one-token roots) would not fit."""
    bound = rec.bind(args, kwargs)
    if bound.get(rec.initial_state) is not None:
        raise ValueError(f"{rec.name}: an initial state given by the model (a cache?) cannot be "
                         "combined with tree states")
    starts, lengths, parents, depth = nodes if nodes is not None else tree_nodes(parent_token)
    seq = {name: bound[name] for name in rec.seq_args if bound.get(name) is not None}
    if not seq or rec.output_like not in seq:
        raise ValueError(f"{rec.name}: {rec.output_like} (the output's shape) is None")
    for name, t in seq.items():
        if t.shape[0] != 1:
            raise ValueError(f"{rec.name}: {name} has batch {t.shape[0]}; a tree row has batch 1")
    static = {k: v for k, v in bound.items() if k not in seq and k not in (
        rec.initial_state, rec.output_final_state)}
    if static.get("cu_seqlens") is not None:
        raise ValueError(f"{rec.name}: the model passes cu_seqlens (packed sequences); a tree "
                         "row is one sequence of nodes, pass a plain batch of 1")
    fast = (rec.varlen is not None
            and all(t.device.type in rec.varlen_devices for t in seq.values())
            and (rec.varlen_check is None or bool(rec.varlen_check(seq, static))))
    if fast and rec.tree_varlen is not None:
        whole = rec.tree_varlen(seq, static, (starts, lengths, parents, depth),
                                _root_init([starts[i] for i, d in enumerate(depth) if d == 0],
                                           root_state), tuple(keep))
        if whole is not None:
            _RUNS[(rec.name, "tree")] = _RUNS.get((rec.name, "tree"), 0) + 1
            return whole[0], whole[1], (starts, lengths, parents, depth)
    if fast and max(depth, default=0) == 0:
        whole = _roots_in_one_call(rec, seq, static, starts, lengths, root_state, keep)
        if whole is not None:
            _RUNS[(rec.name, "varlen")] = _RUNS.get((rec.name, "varlen"), 0) + 1
            return whole[0], whole[1], (starts, lengths, parents, depth)
    final: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    levels: dict[int, list[int]] = {}
    for i, d in enumerate(depth):  # one pass: deep trees have many levels
        levels.setdefault(d, []).append(i)
    needed = {p for p in parents if p >= 0} | set(keep)
    neutral = fast or padding_is_neutral(rec, seq, static)
    # Each seq arg cut into its nodes once (the nodes tile the row in DFS order). Under
    # autograd (the op's backward recomputes this) a split has one backward, a cat of the
    # pieces' gradients; a narrow per node would make a zero row per node and add them all
    # up, which was most of a hybrid's step on the GPU (BENCHMARKS.md, "Hybrids on fla's
    # kernels").
    pieces = {name: t.split(lengths, dim=rec.seq_args[name]) for name, t in seq.items()}
    path = (rec.name, "varlen" if fast else "padded" if neutral else "grouped")
    _RUNS[path] = _RUNS.get(path, 0) + 1
    for level in range(len(levels)):
        nodes = levels[level]
        # Without neutral padding, nodes of one length run together (no padding at all).
        groups = [nodes] if neutral else _by_length(nodes, lengths)
        for group in groups:
            if level > 0:
                init = torch.stack([final[parents[i]] for i in group])
            else:
                init = _root_init([starts[i] for i in group], root_state)
            want = [i in needed for i in group]
            level_fn = _level_varlen if fast else _level_padded
            out, fin = level_fn(rec, pieces, static, init, group, lengths, want)
            for j, i in enumerate(group):
                if want[j]:
                    final[i] = fin[j]
                outputs[i] = out[j]
    row = torch.cat([outputs[i] for i in range(len(starts))], dim=rec.output_seq_dim)
    return row, final, (starts, lengths, parents, depth)


def _roots_in_one_call(rec, seq, static, starts, lengths, root_state, keep):
    """A row of roots alone (separate sequences: packing's layout, a batch of plain
    sequences) through one variable-length call on the row as it is, as a packing trainer
    calls the kernel: no split into nodes and no concatenation back, which copied every input
    and the output once more and cost Python per node. (output row, {node: final state} for
    ``keep``), or None where the kernel's limits need several calls (the level path splits)."""
    sizes = list(lengths)
    if rec.varlen_split is not None and len(list(rec.varlen_split(seq, static, sizes))) != 1:
        return None
    want = [False] * len(sizes)
    for i in keep:  # roots hand no state to children: only the asked ones are kept
        want[i] = True
    cu, cu_cpu = _offsets(sizes, next(iter(seq.values())).device)
    extra = {} if any(want) or not takes_keyword(rec.varlen, "final") else {"final": False}
    out, fin = rec.varlen(seq, static, _root_init(list(starts), root_state), cu, cu_cpu,
                          **extra)
    return out, {i: s for i, s in enumerate(_wanted_states(fin, want)) if s is not None}


def _root_init(starts, root_state):
    """The initial states of root nodes starting at ``starts``, stacked (zeros for a root
    ``root_state`` gives none), or None where all start from zeros."""
    given = [root_state(s) if root_state is not None else None for s in starts]
    if all(g is None for g in given):
        return None
    like = next(g for g in given if g is not None)
    return torch.stack([g if g is not None else torch.zeros_like(like) for g in given])


def _by_length(nodes, lengths) -> list[list[int]]:
    groups: dict[int, list[int]] = {}
    for i in nodes:
        groups.setdefault(lengths[i], []).append(i)
    return list(groups.values())


_NEUTRAL: dict = {}  # (recurrence, static arguments, dtype, device) -> padding is neutral


def _static_key(static: dict):
    def key(v):
        if isinstance(v, torch.Tensor):
            return ("tensor", v.dtype, tuple(v.shape))
        if isinstance(v, (list, tuple)):
            return tuple(key(x) for x in v)
        return repr(v)

    return tuple(sorted((k, key(v)) for k, v in static.items()))


def padding_is_neutral(rec: Recurrence, seq: dict, static: dict) -> bool:
    """Whether tokens of ``rec.neutral`` values leave the kernel's state unchanged, as the
    padded batching of a level needs. Measured, not assumed: a kernel may transform its
    inputs before the recurrence (Mamba2 models with a ``dt`` floor clamp the padding's step
    of 0 up to a real step, which decays the state). Checked once per kernel, static
    arguments, dtype and device: two padding-only tokens run from a random state."""
    some = next(iter(seq.values()))
    key = (rec.name, _static_key(static), some.dtype, some.device.type)
    if key not in _NEUTRAL:
        with torch.no_grad():
            one = {n: t.narrow(rec.seq_args[n], 0, 1) for n, t in seq.items()}
            _, fin = rec.run(**one, **static, **{rec.initial_state: None,
                                                 rec.output_final_state: True})
            g = torch.Generator(device=fin.device).manual_seed(0)
            state = torch.randn(fin.shape, generator=g, device=fin.device).to(fin.dtype)
            pad = {n: _pad_seq(t.narrow(rec.seq_args[n], 0, 0), rec.seq_args[n], 2,
                               rec.neutral.get(n, 0.0)) for n, t in seq.items()}
            _, after = rec.run(**pad, **static, **{rec.initial_state: state,
                                                   rec.output_final_state: True})
            scale = float(state.abs().max())
            _NEUTRAL[key] = bool(torch.allclose(after.float(), state.float(), rtol=1e-5,
                                                atol=1e-6 * scale))
    return _NEUTRAL[key]


def _wanted_states(fin, want) -> list:
    """The final states of the wanted nodes (others None), copied out of ``fin`` unless all
    are wanted (a view would keep every node's state alive)."""
    if fin is None or not any(want):
        return [None] * len(want)
    if all(want):
        return list(fin.unbind(0))
    rows = [j for j, w in enumerate(want) if w]
    # views stacked, not an index tensor made on the host: copying one to the GPU waits for
    # the GPU to finish its queue (a stall per level and layer on a hybrid's step); views of
    # one unbind, whose backward is one stack (an index per row would make a zero tensor of
    # all the level's states per row under autograd)
    views = fin.unbind(0)
    kept = torch.stack([views[j] for j in rows])
    out = [None] * len(want)
    for r, j in enumerate(rows):
        out[j] = kept[r]
    return out


def _level_padded(rec, pieces, static, init, nodes, lengths, want):
    """One depth as a batch, each node right-padded with neutral tokens to the longest
    (``pieces``: each seq arg's nodes)."""
    width = max(lengths[i] for i in nodes)
    chunk = {
        name: torch.cat([
            _pad_seq(p[i], rec.seq_args[name], width, rec.neutral.get(name, 0.0))
            for i in nodes
        ])
        for name, p in pieces.items()
    }
    final = any(want)
    res = rec.run(**chunk, **static, **{rec.initial_state: init,
                                        rec.output_final_state: final})
    if final or not rec.bare_output_without_state:
        out, fin = res
    else:
        out, fin = res, None
    rows = out.split(1)  # (one backward for all rows, as for the inputs)
    return [rows[j].narrow(rec.output_seq_dim, 0, lengths[i])
            for j, i in enumerate(nodes)], _wanted_states(fin, want)


def _level_varlen(rec, pieces, static, init, nodes, lengths, want):
    """One depth through the kernel's variable-length form: nodes end to end, no padding; in
    as many calls as the kernel's limits per call need (``rec.varlen_split``); a call with no
    wanted final state asks for none (``pieces``: each seq arg's nodes)."""
    counts = [len(nodes)] if rec.varlen_split is None else \
        list(rec.varlen_split({n: p[nodes[0]] for n, p in pieces.items()}, static,
                              [lengths[i] for i in nodes]))
    if sum(counts) != len(nodes) or any(c <= 0 for c in counts):
        raise ValueError(f"{rec.name}: varlen_split gave {counts} for {len(nodes)} nodes")
    outs, fins, at = [], [], 0
    for c in counts:
        w = want[at:at + c]
        out, fin = _varlen_call(rec, pieces, static,
                                None if init is None else init[at:at + c],
                                nodes[at:at + c], lengths, any(w))
        outs += out
        fins += _wanted_states(fin, w)
        at += c
    return outs, fins


_TAKES: dict = {}  # (function, keyword) -> whether it takes it


def takes_keyword(fn, name: str) -> bool:
    """Whether ``fn`` takes the keyword ``name`` (a ``varlen`` function ``final``, an fla
    kernel ``cu_seqlens_cpu``: older ones do not); read once per function."""
    key = (fn, name)
    if key not in _TAKES:
        try:
            _TAKES[key] = name in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            _TAKES[key] = False
    return _TAKES[key]


def _offsets(sizes: list[int], device: torch.device):
    """(cumulative offsets of ``sizes`` on ``device``, the same on the host), as a
    variable-length kernel takes them."""
    cu_cpu = torch.tensor([0, *itertools.accumulate(sizes)], dtype=torch.int64)
    # Pinned: a copy from pageable memory would wait for the device's queue first.
    cu = (cu_cpu.pin_memory() if device.type == "cuda" else cu_cpu).to(device, non_blocking=True)
    return cu, cu_cpu


def _varlen_call(rec, pieces, static, init, nodes, lengths, final):
    if len(nodes) == 1:
        chunk = {name: p[nodes[0]] for name, p in pieces.items()}
    else:
        chunk = {name: torch.cat([p[i] for i in nodes], dim=rec.seq_args[name])
                 for name, p in pieces.items()}
    sizes = [lengths[i] for i in nodes]
    cu, cu_cpu = _offsets(sizes, next(iter(chunk.values())).device)
    extra = {} if final or not takes_keyword(rec.varlen, "final") else {"final": False}
    out, fin = rec.varlen(chunk, static, init, cu, cu_cpu, **extra)
    return list(out.split(sizes, dim=rec.output_seq_dim)), fin
