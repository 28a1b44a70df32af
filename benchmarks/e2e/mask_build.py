"""BlockMask building for a long tree row (default 64k tokens) on the device: treefx's
builders (eager, compiled, tensors only) against ``create_block_mask`` with the interval test
(as a user would write it), each checked to visit the same blocks."""

from __future__ import annotations

import statistics
import time
import traceback

import torch

from ..common import agent_row, counts_delta, dynamo_counts
from ..internals import tree_block_mask, tree_block_tensors, tree_mask_mod
from ..timing import repeat
from .env import BLOCK


class HandMask:
    """The block tensors a user would build by hand: ``create_block_mask`` with the interval
    test ``kv <= q < ends[kv]``, compiled (dynamic in N)."""

    def __init__(self, env):
        from torch.nn.attention.flex_attention import create_block_mask

        def blocks(ends):
            n = ends.shape[0]
            bm = create_block_mask(lambda b, h, q, kv: (kv <= q) & (q < ends[kv]), None, None,
                                   n, n, device=ends.device, BLOCK_SIZE=BLOCK)
            return bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices

        self.fn = torch.compile(blocks, backend=env.backend)

    def __call__(self, ends):
        torch._dynamo.maybe_mark_dynamic(ends, 0)
        return self.fn(ends)


def mask_build_bench(env, args, vocab) -> dict:
    """BlockMask for a 64k-token row of agent trees (POR-0.75 shape, the DFS row cut at
    65,536 tokens (2,048 in a dry run) with subtree_end clipped), built on the device."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    n = 2048 if env.dry else 65536
    se, trees = agent_row(n, 900, vocab=vocab)
    se = se.to(env.dev)
    res = {"tokens": n, "trees": len(trees), "reps": args.mask_reps}

    def interval_mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < se[kv_idx])

    tbt_compiled = torch.compile(tree_block_tensors, backend=env.backend, dynamic=False)
    tbm_compiled = torch.compile(tree_block_mask, backend=env.backend, dynamic=False)
    cbm_compiled = torch.compile(create_block_mask, backend=env.backend, dynamic=False)
    hand_mask = HandMask(env)

    def tensors_then_blockmask():
        kv_num, kv_idx, full_num, full_idx, sep = tbt_compiled(se, BLOCK)
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                        mask_mod=tree_mask_mod(sep), seq_lengths=(n, n))

    variants = {
        "tree_block_mask eager (batch.block_mask())": lambda: tree_block_mask(se, BLOCK),
        "tree_block_tensors compiled + BlockMask.from_kv_blocks": tensors_then_blockmask,
        "tree_block_mask compiled": lambda: tbm_compiled(se, BLOCK),
        "tree_block_tensors compiled (kv tensors only)": lambda: tbt_compiled(se, BLOCK),
        "create_block_mask interval test, compiled": lambda: cbm_compiled(
            interval_mask_mod, None, None, n, n, device=se.device, BLOCK_SIZE=BLOCK),
        "create_block_mask interval test, compiled, kv tensors only":
            lambda: hand_mask(se),
    }
    ref = tree_block_mask(se, BLOCK)
    for name, fn in variants.items():
        c0 = dynamo_counts()
        try:
            t0 = time.perf_counter()
            out = fn()
            env.sync()
            first = time.perf_counter() - t0
            for _ in range(5):
                fn()
            env.sync()
            times = repeat(fn, args.mask_reps, env.cuda)
            entry = {"ms_median": statistics.median(times), "ms_min": min(times),
                     "first_call_s": first}
            if hasattr(out, "kv_num_blocks"):  # same blocks as the eager reference?
                entry["blocks_match_reference"] = same_blocks(out, ref)
            res[name] = entry
        except Exception:
            res[name] = {"error": traceback.format_exc()[-3000:]}
        if "error" not in res[name]:
            res[name]["dynamo"] = counts_delta(c0, dynamo_counts())
        print(f"  mask build: {name}: {fmt_entry(res[name])}", flush=True)
    return res


def _dense_blocks(bm) -> torch.Tensor:
    nb = bm.kv_indices.shape[-1]
    d = torch.zeros(bm.kv_num_blocks.shape[-1], nb, dtype=torch.bool, device=bm.kv_indices.device)
    for num, idx in ((bm.kv_num_blocks, bm.kv_indices),
                     (bm.full_kv_num_blocks, bm.full_kv_indices)):
        if num is None:
            continue
        num, idx = num[0, 0].long(), idx[0, 0].long()
        keep = torch.arange(idx.shape[-1], device=idx.device)[None, :] < num[:, None]
        rows = torch.arange(idx.shape[0], device=idx.device)[:, None].expand_as(idx)
        d[rows[keep], idx[keep]] = True
    return d


def same_blocks(a, b) -> bool:
    """Same set of visited (partial or full) blocks (over the blocks both cover: treefx's
    tensors carry one spare, empty block after the row's, which lists and is listed by none)."""
    da, db = _dense_blocks(a), _dense_blocks(b)
    r, c = min(da.shape[0], db.shape[0]), min(da.shape[1], db.shape[1])
    rest = [d[r:].any() or d[:, c:].any() for d in (da, db)]
    return bool(torch.equal(da[:r, :c], db[:r, :c]) and not any(rest))


def fmt_entry(e: dict) -> str:
    if "error" in e:
        return "FAILED: " + e["error"].strip().splitlines()[-1][:200]
    return f"{e['ms_median']:.3f} ms (first call {e['first_call_s']:.1f} s)"
