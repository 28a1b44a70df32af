"""The tensors a part's graph takes, in its extended row's coordinates, and the host copies of
the rows its ops read on the host."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..layout import move_tensors, remember_host_row

if TYPE_CHECKING:
    from .part_plan import Part, PartPlan

__all__ = ["keep_host_rows", "part_tensors"]


def part_tensors(plan: PartPlan, part: Part, device=None, *, min_tokens: int = 2,
                 keep_labels: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """The tensors a part's graph takes, in the extended row's coordinates (see the module's
    docstring): ``input_ids`` [1, n]; ``tree_info`` [3, n] (positions, predecessor, subtree
    end); ``part_info`` [3, A] (the same for the context row, A = ``part.context_pad``; the
    padding is seen by no query); ``state_entry`` [n] (row of ``ctx_state`` a token's node
    starts from, -1: none); ``state_exit`` [X] (rows whose state is handed on; at least 2,
    repeated); ``labels`` [2, m] (predecessor row, token id; at least 2, padded with row 0);
    ``label_tokens`` (the predicted tokens, the first entries of ``labels``). On the host
    when ``device`` is None. A part of fewer than ``min_tokens`` tokens (at least 2: Dynamo
    specializes a graph to a row of one token) gets inert tokens after its own, each its own
    root that nothing reads. ``keep_labels`` (a mask over ``part.label_tokens``): predict
    only those (the trained ones, for a loss that reads no others)."""
    b = plan.batch
    s, e, a = part.start, part.end, part.context_pad
    pos = b.position_ids[0].cpu().numpy()
    parent = b.parent_token.cpu().numpy()
    se = b.subtree_end.cpu().numpy()
    ids = b.input_ids[0].cpu().numpy()
    ctx = part.context
    k = len(ctx)
    par = parent[s:e]
    # a predecessor before the part lies on the context path (ascending): its row there
    par_ext = np.where(par >= s, a + par - s,
                       np.where(par >= 0, np.searchsorted(ctx, par), -1))
    tree_info = np.stack([pos[s:e], par_ext, a + np.minimum(se[s:e], e) - s])
    p_pos = np.zeros(a, dtype=np.int64)
    p_par = np.full(a, -1, dtype=np.int64)
    p_se = np.zeros(a, dtype=np.int64)
    if k:
        p_pos[:k] = pos[ctx]
        p_par[:k] = np.arange(-1, k - 1)  # a path: each token's predecessor is the one before
        p_se[:k] = a + np.clip(se[ctx] - s, 0, e - s)
    part_info = np.stack([p_pos, p_par, p_se])
    exits_local = part.exits - s
    if len(exits_local) < 2:
        exits_local = np.concatenate([exits_local, np.full(2 - len(exits_local), e - s - 1)])
    rows, toks = part.label_rows, part.label_tokens
    if keep_labels is not None:
        rows, toks = rows[keep_labels], toks[keep_labels]
    predicted = toks
    if len(rows) < 2:
        pad = 2 - len(rows)
        rows = np.concatenate([rows, np.zeros(pad, np.int64)])
        toks = np.concatenate([toks, np.full(pad, -1)])
    labels = np.stack([rows, np.where(toks >= 0, ids[np.maximum(toks, 0)], 0)])

    own_ids, entry = ids[s:e], part.entry_of_token
    extra = max(2, min_tokens) - (e - s)
    if extra > 0:  # inert tokens: each sees only itself, nothing reads them. Their id is the
        # part's last token's, a real one: id 0 is a padding id in some models, whose zero
        # embedding row made Gemma 3n's AltUp take sqrt(0), whose backward is 0 * inf = NaN
        filler = own_ids[-1] if len(own_ids) else 0
        own_ids = np.append(own_ids, np.full(extra, filler, np.int64))
        entry = np.append(entry, np.full(extra, -1))
        rows = a + (e - s) + np.arange(extra)
        tree_info = np.concatenate(
            [tree_info, np.stack([np.zeros(extra, np.int64), np.full(extra, -1), rows + 1])],
            axis=1)

    def t(x):
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))

    host = {"input_ids": t(own_ids)[None], "tree_info": t(tree_info),
            "part_info": t(part_info), "state_entry": t(entry),
            "state_exit": t(exits_local), "labels": t(labels),
            "label_tokens": t(predicted)}
    if device is None:
        return host
    # one pinned copy per dtype, not waiting for the device's queue; the rows the part's ops
    # read on the host (its predecessors, where its states enter and leave) keep their host
    # copies, so those ops copy nothing back (treefx.ops.host_row)
    moved = dict(zip(host, move_tensors(list(host.values()), torch.device(device))))
    keep_host_rows(moved, host)
    return moved


def keep_host_rows(moved: dict, host: dict, *, pinned: bool = False) -> list:
    """Register the host copies of a part's rows that its ops read on the host (its
    predecessors, where its states enter and leave; :mod:`treefx.ops.host_row`) for their
    moved device rows, so that those ops copy nothing back (which would wait for the
    device). ``pinned``: kept until :func:`treefx.layout.forget_host_rows` of the returned
    keys (a part's backward reads them after every later part's forward)."""
    return [remember_host_row(dev, h, pinned=pinned)
            for dev, h in ((moved["tree_info"][1], host["tree_info"][1]),
                           (moved["state_entry"], host["state_entry"]),
                           (moved["state_exit"], host["state_exit"]))]
