"""Tree attention as chains on dense variable-length kernels, against FlexAttention.

    python -m benchmarks.chain_attention                 # the e2e benchmark's POR-0.75 tree
    python -m benchmarks.chain_attention --dry-run       # CPU: tiny heads, plain torch kernels

A depth-first row splits into chains: maximal runs of rows each the child of the row before
(with children laid out largest subtree first, a chain is a path of first children). A
chain's rows see the chain's rows before them (causal attention within the chain) and all
of the chain's ancestors (the path from the root to the chain's first row's parent), so tree
attention is two variable-length pieces over the chains:

- ``own``: each chain over its own rows, causal: q, k and v are the row itself, the
  sequences the chains' boundaries (nothing gathered);
- ``cross``: each chain's rows over its ancestors' keys, all seen: the keys gathered per
  chain (the ancestors' rows, ``sum(ancestors)`` rows in all), no mask;

merged by their log-sum-exps. Each piece's backward, given the merged output and
log-sum-exp, is that piece's share of the gradients (the ancestors' key gradients
scatter-added back). Variants timed, forward and forward + backward, per layer of an
8B-shaped model (32 query heads, 8 KV heads, head_dim 128, bf16), random q, k, v:

- ``flex``: the whole row on FlexAttention with the tree's block mask (treefx's kernel);
- ``chains_cudnn``: the two pieces on cuDNN's variable-length ("nested") attention;
- ``chains_flash``: one piece on FlashAttention-2's variable-length kernel, each chain's keys
  its ancestors then its own rows (causal aligned bottom-right, as FlashAttention >= 2.1 does).

Every variant's output and gradients are compared with a float32 computation chain by chain.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import torch

import treefx
from benchmarks import common
from benchmarks.internals import intervals
from benchmarks.trunk_attention import _time, _whole


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


class Plan:
    """The pieces' index tensors for one row, on ``dev``."""

    def __init__(self, parent: np.ndarray, dev):
        starts, ends, anc = chains(parent)
        lens = ends - starts
        self.n = len(parent)
        self.chains = len(starts)
        cum = np.append(starts, self.n).astype(np.int32)
        self.own_cum = torch.tensor(cum, device=dev)
        self.own_max = int(lens.max())
        cross = [i for i in range(len(starts)) if len(anc[i])]
        self.cross_rows = torch.tensor(np.concatenate([np.arange(starts[i], ends[i])
                                                       for i in cross]), device=dev)
        self.cross_cum_q = torch.tensor(np.concatenate([[0], np.cumsum(lens[cross])]),
                                        dtype=torch.int32, device=dev)
        self.cross_keys = torch.tensor(np.concatenate([anc[i] for i in cross]), device=dev)
        self.cross_cum_k = torch.tensor(np.concatenate([[0], np.cumsum([len(anc[i])
                                                                        for i in cross])]),
                                        dtype=torch.int32, device=dev)
        self.cross_max_q = int(lens[cross].max())
        self.cross_max_k = int(max(len(anc[i]) for i in cross))
        # one piece: each chain's keys its ancestors, then its own rows
        both = [np.concatenate([anc[i], np.arange(starts[i], ends[i])])
                for i in range(len(starts))]
        self.flash_keys = torch.tensor(np.concatenate(both), device=dev)
        self.flash_cum_k = torch.tensor(np.concatenate([[0], np.cumsum([len(b) for b in both])]),
                                        dtype=torch.int32, device=dev)
        self.flash_max_k = int(max(len(b) for b in both))
        self.gathered = int(sum(len(a) for a in anc))


# -- the variable-length kernels: cuDNN's / FlashAttention's, or plain torch on the CPU -----

def _ref_fwd(q, k, v, cq, ck, causal, scale):
    """Plain torch, sequence by sequence: (out [T, H, D], lse [T, H] float32)."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    lse = q.new_zeros(q.shape[:2], dtype=torch.float32)
    for i in range(len(cq) - 1):
        a, b, c, d = int(cq[i]), int(cq[i + 1]), int(ck[i]), int(ck[i + 1])
        qs = q[a:b].transpose(0, 1).float()
        ks = k[c:d].repeat_interleave(group, 1).transpose(0, 1).float()
        vs = v[c:d].repeat_interleave(group, 1).transpose(0, 1).float()
        s = qs @ ks.transpose(-1, -2) * scale
        if causal:  # bottom-right: the last query sees every key
            m, nk = b - a, d - c
            s = s.masked_fill(torch.arange(nk) > torch.arange(m)[:, None] + (nk - m),
                              float("-inf"))
        l_ = torch.logsumexp(s, -1)
        out[a:b] = (torch.exp(s - l_[..., None]) @ vs).transpose(0, 1).to(q.dtype)
        lse[a:b] = l_.transpose(0, 1)
    return out, lse


def _ref_bwd(g, q, k, v, o, lse, cq, ck, causal, scale):
    group = q.shape[1] // k.shape[1]
    dq, dk, dv = (torch.zeros_like(x, dtype=torch.float32) for x in (q, k, v))
    for i in range(len(cq) - 1):
        a, b, c, d = int(cq[i]), int(cq[i + 1]), int(ck[i]), int(ck[i + 1])
        qs = q[a:b].transpose(0, 1).float()
        ks = k[c:d].repeat_interleave(group, 1).transpose(0, 1).float()
        vs = v[c:d].repeat_interleave(group, 1).transpose(0, 1).float()
        gs, os_ = g[a:b].transpose(0, 1).float(), o[a:b].transpose(0, 1).float()
        s = qs @ ks.transpose(-1, -2) * scale
        if causal:
            m, nk = b - a, d - c
            s = s.masked_fill(torch.arange(nk) > torch.arange(m)[:, None] + (nk - m),
                              float("-inf"))
        p = torch.exp(s - lse[a:b].transpose(0, 1)[..., None])
        dsum = (gs * os_).sum(-1, keepdim=True)
        ds = p * (gs @ vs.transpose(-1, -2) - dsum)
        dq[a:b] += (ds @ ks * scale).transpose(0, 1)
        h, nk = k.shape[1], d - c
        dk[c:d] += (ds.transpose(-1, -2) @ qs * scale).view(h, group, nk, -1).sum(1).transpose(0, 1)
        dv[c:d] += (p.transpose(-1, -2) @ gs).view(h, group, nk, -1).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def cudnn_fwd(q, k, v, cq, ck, mq, mk, causal, scale):
    if not q.is_cuda:
        return _ref_fwd(q, k, v, cq.cpu(), ck.cpu(), causal, scale)
    r = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cq, ck, mq, mk, True, 0.0, causal,
                                                False, scale=scale)
    return r[0], r[1].reshape(q.shape[0], q.shape[1])


def cudnn_bwd(g, q, k, v, o, lse, cq, ck, mq, mk, causal, scale):
    if not q.is_cuda:
        return _ref_bwd(g, q, k, v, o, lse, cq.cpu(), ck.cpu(), causal, scale)
    empty = q.new_empty(0)
    return torch.ops.aten._cudnn_attention_backward(
        g.contiguous(), q, k, v, o.contiguous(), lse.reshape(*lse.shape, 1).contiguous(),
        empty, empty, None, cq, ck, mq, mk, 0.0, causal, scale=scale)


class ChainsCudnn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, scale):
        """q [T, Hq, D], k, v [T, Hk, D] (one row's tokens first)."""
        o1, l1 = cudnn_fwd(q, k, v, plan.own_cum, plan.own_cum, plan.own_max, plan.own_max,
                           True, scale)
        qc = q[plan.cross_rows]
        kc, vc = k[plan.cross_keys], v[plan.cross_keys]
        o2, l2 = cudnn_fwd(qc, kc, vc, plan.cross_cum_q, plan.cross_cum_k, plan.cross_max_q,
                           plan.cross_max_k, False, scale)
        l1c = l1[plan.cross_rows]
        lse_c = torch.logaddexp(l1c, l2)
        merged = (o1[plan.cross_rows].float() * torch.exp(l1c - lse_c)[..., None]
                  + o2.float() * torch.exp(l2 - lse_c)[..., None]).to(q.dtype)
        out = o1.index_copy(0, plan.cross_rows, merged)
        lse = l1.index_copy(0, plan.cross_rows, lse_c)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        g = g.contiguous()
        dq, dk, dv = cudnn_bwd(g, q, k, v, out, lse, plan.own_cum, plan.own_cum, plan.own_max,
                               plan.own_max, True, scale)
        r = plan.cross_rows
        dqc, dkc, dvc = cudnn_bwd(g[r], q[r], k[plan.cross_keys], v[plan.cross_keys], out[r],
                                  lse[r], plan.cross_cum_q, plan.cross_cum_k, plan.cross_max_q,
                                  plan.cross_max_k, False, scale)
        dq = dq.index_add(0, r, dqc)
        dk = dk.index_add(0, plan.cross_keys, dkc)
        dv = dv.index_add(0, plan.cross_keys, dvc)
        return dq, dk, dv, None, None


class ChainsFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, scale):
        kc, vc = k[plan.flash_keys], v[plan.flash_keys]
        if q.is_cuda:
            o, lse = torch.ops.aten._flash_attention_forward(
                q, kc, vc, plan.own_cum, plan.flash_cum_k, plan.own_max, plan.flash_max_k, 0.0,
                True, False, scale=scale)[:2]
        else:
            o, lse = _ref_fwd(q, kc, vc, plan.own_cum.cpu(), plan.flash_cum_k.cpu(), True, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.plan, ctx.scale = plan, scale
        return o

    @staticmethod
    def backward(ctx, g):
        q, k, v, o, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        kc, vc = k[plan.flash_keys], v[plan.flash_keys]
        if q.is_cuda:
            unused = q.new_empty(0)
            rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
            dq, dkc, dvc = torch.ops.aten._flash_attention_backward(
                g.contiguous(), q, kc, vc, o, lse, plan.own_cum, plan.flash_cum_k, plan.own_max,
                plan.flash_max_k, 0.0, True, rng, unused, scale=scale)
        else:
            dq, dkc, dvc = _ref_bwd(g, q, kc, vc, o, lse, plan.own_cum.cpu(),
                                    plan.flash_cum_k.cpu(), True, scale)
        return (dq, torch.zeros_like(k).index_add(0, plan.flash_keys, dkc),
                torch.zeros_like(v).index_add(0, plan.flash_keys, dvc), None, None)


def reference(q, k, v, plan, starts, ends, anc, grad):
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


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.chain_attention",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--seeds", default="0", help="synthetic trees at POR 0.75 (e2e's is seed 0)")
    common.add_run_args(p, "CPU, tiny heads, plain torch kernels, forward and backward")
    args = p.parse_args(argv)
    cuda = common.use_cuda(args.dry_run)
    dev = "cuda" if cuda else "cpu"
    common.bump_dynamo_limits()
    hq, hk, d, dtype = common.attention_heads(cuda)
    out_path = common.resolve_out(args, "chain_attention", cuda)
    res = {"meta": common.run_meta(cuda), "args": vars(args), "trees": []}
    whole = torch.compile(_whole, backend="inductor" if cuda else "eager", dynamic=True)
    for seed in [int(s) for s in args.seeds.split(",")]:
        tree = common.make_tree(0.75, 1.0 if cuda else 0.05, 1000, seed=seed)
        batch = treefx.pack(tree, reduction="mean")
        parent = batch.parent_token.numpy()
        n = len(parent)
        plan = Plan(parent, dev)
        starts, ends, anc = chains(parent)
        pairs = float((batch.position_ids[0].double() + 1).sum()) * hq
        row = {"seed": seed, "tokens": n, "chains": plan.chains, "gathered_keys": plan.gathered,
               "pairs_per_head": pairs / hq}
        print(json.dumps(row), flush=True)
        torch.manual_seed(seed)
        q = torch.randn(n, hq, d, device=dev, dtype=dtype)
        k = torch.randn(n, hk, d, device=dev, dtype=dtype)
        v = torch.randn(n, hk, d, device=dev, dtype=dtype)
        grad = torch.randn(n, hq, d, device=dev, dtype=dtype)
        ref = reference(q, k, v, plan, starts, ends, anc, grad)
        se = batch.subtree_end.to(dev)
        scale = 1 / math.sqrt(d)
        variants = {}
        if cuda:
            from benchmarks.attention import treefx_op

            site = treefx_op(se, n, True, True, interleave=True)
            variants["treefx_site_interleaved"] = (
                lambda q, k, v: site(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None])[0].transpose(0, 1))
            try:
                import time as _t
                from cudnn.flex_attention import create_mask_plan, flex_attn_func
                mf = torch.tensor(intervals.tree_intervals(parent)[None], device=dev)
                row["nfunc"] = int(mf.shape[1])
                qs = q[None].requires_grad_()
                t0 = _t.perf_counter()
                cplan = create_mask_plan(mf, qs, k[None], v[None])
                torch.cuda.synchronize()
                row["cudnn_plan_first_s"] = _t.perf_counter() - t0
                t0 = _t.perf_counter()
                cplan = create_mask_plan(mf, qs, k[None], v[None])
                torch.cuda.synchronize()
                row["cudnn_plan_s"] = _t.perf_counter() - t0
                t0 = _t.perf_counter()
                o = flex_attn_func(qs, k[None], v[None], mask_plan=cplan)
                torch.cuda.synchronize()
                row["cudnn_first_fwd_s"] = _t.perf_counter() - t0
                t0 = _t.perf_counter()
                o.backward(grad[None])
                torch.cuda.synchronize()
                row["cudnn_first_bwd_s"] = _t.perf_counter() - t0
                print(json.dumps(row), flush=True)
                variants["cudnn_flex"] = (lambda q, k, v: flex_attn_func(
                    q[None], k[None], v[None], mask_plan=cplan)[0])
            except Exception as e:
                import traceback
                traceback.print_exc()
                row["cudnn_flex_error"] = f"{type(e).__name__}: {str(e)[:600]}"
        variants.update({
            "flex": lambda q, k, v: _whole(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], se)[0].transpose(0, 1)
            if not cuda else whole(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                   v.transpose(0, 1)[None], se)[0].transpose(0, 1),
            "chains_cudnn": lambda q, k, v: ChainsCudnn.apply(q, k, v, plan, scale),
            "chains_flash": lambda q, k, v: ChainsFlash.apply(q, k, v, plan, scale),
        })
        for name, fn in variants.items():
            r = {}
            try:
                xs = [x.clone().requires_grad_() for x in (q, k, v)]
                o = fn(*xs)
                o.backward(grad)
                r["out_rel"] = common.norm_rel(o.detach(), ref[0])
                r["grad_rel"] = [common.norm_rel(x.grad, g) for x, g in zip(xs, ref[1:])]
                if cuda:
                    def f(xs=xs):
                        with torch.no_grad():
                            fn(*xs)

                    def fb(xs=xs):
                        fn(*xs).backward(grad)
                    fs = _time(dev, f, args.reps)
                    bs = _time(dev, fb, args.reps)
                    r.update(fwd_ms=fs * 1e3, fwd_bwd_ms=bs * 1e3,
                             tflops=pairs * 14 * d / bs / 1e12)
            except Exception as e:
                r["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            row[name] = r
            print(f"seed {seed}: {name}: {json.dumps(r)}", flush=True)
        res["trees"].append(row)
        common.save_json(res, out_path)
    print(f"saved {out_path}")


if __name__ == "__main__":
    main()
