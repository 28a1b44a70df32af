"""Tree attention alone at Qwen3-8B's heads: treefx's FlexAttention site, FlexAttention in the
usual layout and cuDNN's interval-mask kernels, each against a float32 computation chain by
chain (BENCHMARKS.md [att-1]; retired variants: benchmarks/README.md)."""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch

import treefx
from benchmarks import common
from benchmarks.internals import TreeFlexAttention, attention_ops, intervals, tree_block_tensors

BLOCK = 128


def _whole(q, k, v, se):
    """The whole row on FlexAttention with the tree's block mask (the usual layout, not the
    interleaved one treefx's site runs under autograd), through the public API so Dynamo
    traces it."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    kv_num, kv_idx, full_num, full_idx, se_pad = tree_block_tensors(se, BLOCK)
    n = q.shape[-2]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < se_pad[kv_idx])

    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                  mask_mod=mask_mod, seq_lengths=(n, n))
    return flex_attention(q, k, v, block_mask=bm, enable_gqa=True,
                          kernel_options=dict(attention_ops.STANDARD_KERNEL))


def treefx_site(se):
    """The op treefx's attention pass inserts (TreeFlexAttention, KV heads interleaved), its
    block tensors built once, as one node of an FX graph handed to Inductor (the GPU)."""
    from torch._inductor.compile_fx import compile_fx

    kv_num, kv_idx, full_num, full_idx, se_pad = tree_block_tensors(se, BLOCK)
    args = (kv_num, kv_idx, full_num, full_idx, se_pad, torch.zeros_like(se_pad))
    op = TreeFlexAttention(block_size=BLOCK, interleave_heads=True)
    compiled = {}

    def run(q, k, v):
        xs = (q, k, v, *args)
        if "fn" not in compiled:
            g = torch.fx.Graph()
            g.output((g.call_function(op, tuple(g.placeholder(f"a{i}") for i in range(len(xs)))),))
            compiled["fn"] = compile_fx(torch.fx.GraphModule({}, g), list(xs))
        return compiled["fn"](*xs)[0]

    return run


def chains(parent: np.ndarray):
    """(starts, ends, ancestors): each chain's rows ``[start, end)`` and the rows it sees
    before them (the path from the root to its first row's parent), in row order."""
    n = len(parent)
    starts = np.concatenate([[0], np.flatnonzero(parent[1:] != np.arange(n - 1)) + 1])
    ends = np.append(starts[1:], n)
    chain_of = np.searchsorted(starts, np.arange(n), side="right") - 1
    ancestors = []
    for s in starts:
        segs, r = [], int(parent[s])
        while r >= 0:
            c = int(starts[chain_of[r]])
            segs.append(np.arange(c, r + 1))
            r = int(parent[c])
        ancestors.append(np.concatenate(segs[::-1]) if segs else np.zeros(0, np.int64))
    return starts, ends, ancestors


def reference(q, k, v, starts, ends, anc, grad):
    """float32, chain by chain: (out, dq, dk, dv) for the output gradient ``grad``."""
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    out = torch.zeros_like(qf)
    group = q.shape[1] // k.shape[1]
    scale = 1 / math.sqrt(q.shape[-1])
    for s, e, a in zip(starts, ends, anc):
        keys = torch.tensor(np.concatenate([a, np.arange(s, e)]), device=q.device)
        qs = qf[s:e].transpose(0, 1)
        ks = kf[keys].repeat_interleave(group, 1).transpose(0, 1)
        vs = vf[keys].repeat_interleave(group, 1).transpose(0, 1)
        sc = qs @ ks.transpose(-1, -2) * scale
        m, nk = e - s, len(keys)
        sc = sc.masked_fill(torch.arange(nk, device=q.device)
                            > torch.arange(m, device=q.device)[:, None] + (nk - m), float("-inf"))
        o = (torch.softmax(sc, -1) @ vs).transpose(0, 1)
        (o * grad[s:e].float()).sum().backward()
        out[s:e] = o.detach()
    return out.detach(), qf.grad, kf.grad, vf.grad


def _heads(q, k, v):
    return (x.transpose(0, 1)[None] for x in (q, k, v))


def _rows(o):
    return o[0].transpose(0, 1)


def _cudnn(row, q, k, v, grad, parent):
    """cuDNN's interval-mask kernels (``cudnn.flex_attention``): the variant; first times in row."""
    from cudnn.flex_attention import create_mask_plan, flex_attn_func

    mf = torch.tensor(intervals.tree_intervals(parent)[None], device=q.device)
    row["nfunc"] = int(mf.shape[1])
    qs = q[None].requires_grad_()

    def secs(key, fn):
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        row[key] = time.perf_counter() - t0
        return out

    secs("cudnn_plan_first_s", lambda: create_mask_plan(mf, qs, k[None], v[None]))
    plan = secs("cudnn_plan_s", lambda: create_mask_plan(mf, qs, k[None], v[None]))
    o = secs("cudnn_first_fwd_s", lambda: flex_attn_func(qs, k[None], v[None], mask_plan=plan))
    secs("cudnn_first_bwd_s", lambda: o.backward(grad[None]))
    return lambda q, k, v: flex_attn_func(q[None], k[None], v[None], mask_plan=plan)[0]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.chain_attention",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--seeds", default="0", help="synthetic trees at POR 0.75 (e2e's is seed 0)")
    common.add_run_args(p, "CPU, tiny heads, FlexAttention forward only")
    args = p.parse_args(argv)
    cuda = common.use_cuda(args.dry_run)
    dev = "cuda" if cuda else "cpu"
    common.bump_dynamo_limits()
    # Qwen3-8B's heads in bf16 on the GPU, tiny float32 ones for a dry run
    hq, hk, d, dtype = (32, 8, 128, torch.bfloat16) if cuda else (4, 2, 16, torch.float32)
    out_path = common.resolve_out(args, "chain_attention", cuda)
    res = {"meta": common.run_meta(cuda), "args": vars(args), "trees": []}
    whole = torch.compile(_whole, backend="inductor" if cuda else "eager", dynamic=True)
    for seed in [int(s) for s in args.seeds.split(",")]:
        tree = common.make_tree(0.75, 1.0 if cuda else 0.05, 1000, seed=seed)
        batch = treefx.pack(tree, reduction="mean")
        parent = batch.parent_token.numpy()
        n = len(parent)
        starts, ends, anc = chains(parent)
        pairs = float((batch.position_ids[0].double() + 1).sum()) * hq
        row = {"seed": seed, "tokens": n, "chains": len(starts), "pairs_per_head": pairs / hq}
        print(json.dumps(row), flush=True)
        torch.manual_seed(seed)
        q = torch.randn(n, hq, d, device=dev, dtype=dtype)
        k = torch.randn(n, hk, d, device=dev, dtype=dtype)
        v = torch.randn(n, hk, d, device=dev, dtype=dtype)
        grad = torch.randn(n, hq, d, device=dev, dtype=dtype)
        ref = reference(q, k, v, starts, ends, anc, grad)
        se = batch.subtree_end.to(dev)
        flex = whole if cuda else _whole
        variants = {"flex": lambda q, k, v: _rows(flex(*_heads(q, k, v), se))}
        if cuda:
            site = treefx_site(se)
            variants["treefx_site_interleaved"] = lambda q, k, v: _rows(site(*_heads(q, k, v)))
            try:
                variants["cudnn_flex"] = _cudnn(row, q, k, v, grad, parent)
            except Exception as e:
                row["cudnn_flex_error"] = f"{type(e).__name__}: {str(e)[:600]}"
        for name, fn in variants.items():
            r = {}
            try:
                xs = [x.clone().requires_grad_(cuda) for x in (q, k, v)]
                with torch.set_grad_enabled(cuda):  # FlexAttention has no backward on the CPU
                    o = fn(*xs)
                r["out_rel"] = common.norm_rel(o.detach(), ref[0])
                if cuda:
                    o.backward(grad)
                    r["grad_rel"] = [common.norm_rel(x.grad, g) for x, g in zip(xs, ref[1:])]
                    fs = common.median_ms(lambda xs=xs: torch.no_grad()(fn)(*xs), args.reps,
                                          cuda, warmup=1)
                    bs = common.median_ms(lambda xs=xs: fn(*xs).backward(grad), args.reps,
                                          cuda, warmup=1)
                    r.update(fwd_ms=fs, fwd_bwd_ms=bs, tflops=pairs * 14 * d / bs / 1e9)
            except Exception as e:
                r["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            row[name] = r
            print(f"seed {seed}: {name}: {json.dumps(r)}", flush=True)
        res["trees"].append(row)
        common.save_json(res, out_path)
    print(f"saved {out_path}")


if __name__ == "__main__":
    main()
