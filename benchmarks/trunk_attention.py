"""Tree attention alone with its leading chain (the trunk) on a dense causal kernel and the rest
on FlexAttention, against FlexAttention on the whole row (BENCHMARKS.md, "Real agent
trajectories").

    python -m benchmarks.trunk_attention --trees .data/swe200.jsonl --tasks 25,35,52,10
    python -m benchmarks.trunk_attention --dry-run       # CPU: tiny heads, forward only

Per layer at Qwen3-8B's heads, bf16, random q, k, v: causal attention at ``--causal-lengths``
on each kernel, then per tree the whole row against the split (each SDPA backend on the
trunk; ``split_cudnn_compiled`` in one graph), outputs and gradients against the whole row's.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

import treefx
from benchmarks import common, timing
from benchmarks.internals import TreeFlexAttention, attention_ops, tree_block_tensors

BLOCK = 128
EXPANDED: set = set()  # SDPA backends that refused grouped-query attention (KV expanded)


def _time(dev, fn, reps):
    """Median seconds of ``reps`` calls after one warm-up (:mod:`benchmarks.timing`)."""
    return timing.median_ms(fn, reps, dev == "cuda", warmup=1) / 1e3


def trunk_length(parent: torch.Tensor) -> int:
    """Rows ``[0, T)`` with every row's parent the row before: the leading chain."""
    n = parent.shape[0]
    breaks = torch.nonzero(parent[1:] != torch.arange(n - 1, device=parent.device))
    return int(breaks[0]) + 1 if breaks.numel() else n


def _sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend]

    def run(q, k, v):
        with sdpa_kernel([chosen]):
            try:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            except RuntimeError:  # a backend without grouped-query attention: expand
                EXPANDED.add(backend)
                r = q.shape[1] // k.shape[1]
                return F.scaled_dot_product_attention(
                    q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), is_causal=True)
    return run


def _flex_causal(dev):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False) if dev == "cuda" else flex_attention

    def run(q, k, v):
        n = q.shape[-2]
        bm = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, n, n, device=dev)
        return compiled(q, k, v, block_mask=bm, enable_gqa=True,
                        kernel_options=dict(attention_ops.STANDARD_KERNEL))
    return run


def _rest_flex(q, k, v, se, t0):
    """Rows ``[t0, N)`` (``t0`` a multiple of the block) over all keys, the tree's mask."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    kv_num, kv_idx, full_num, full_idx, se_pad = tree_block_tensors(se, BLOCK)
    first = t0 // BLOCK
    n = k.shape[-2]
    offset = se.new_full((1,), t0)

    def mask_mod(b, h, q_idx, kv_idx):
        qe = q_idx + offset[0]
        return (kv_idx <= qe) & (qe < se_pad[kv_idx])

    bm = BlockMask.from_kv_blocks(kv_num[:, :, first:], kv_idx[:, :, first:],
                                  full_num[:, :, first:], full_idx[:, :, first:],
                                  BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                  seq_lengths=(n - t0, n))
    return flex_attention(q, k, v, block_mask=bm, enable_gqa=True,
                          kernel_options=dict(attention_ops.STANDARD_KERNEL))


def _whole(q, k, v, se):
    """The whole row on FlexAttention with the tree's block mask (the usual layout; the
    interleaved one treefx's site runs under autograd differs from it by a few percent),
    through the public API so Dynamo traces it."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    kv_num, kv_idx, full_num, full_idx, se_pad = tree_block_tensors(se, BLOCK)
    n = q.shape[-2]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < se_pad[kv_idx])

    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                  mask_mod=mask_mod, seq_lengths=(n, n))
    return flex_attention(q, k, v, block_mask=bm, enable_gqa=True,
                          kernel_options=dict(attention_ops.STANDARD_KERNEL))


def treefx_op(se, n, cuda, gqa, interleave=False):
    """The op treefx's attention pass inserts (TreeFlexAttention), its block tensors built once;
    on the GPU one node of an FX graph handed to Inductor, as treefx runs it."""
    kv_num, kv_idx, full_num, full_idx, se_pad = tree_block_tensors(se, BLOCK)
    args = (kv_num, kv_idx, full_num, full_idx, se_pad, torch.zeros_like(se_pad))
    op = TreeFlexAttention(block_size=BLOCK, interleave_heads=interleave)
    if not cuda:
        return lambda q, k, v: op(q, k, v, *args)
    from torch._inductor.compile_fx import compile_fx

    compiled = {}

    def run(q, k, v):
        xs = (q, k, v, *args)
        if "fn" not in compiled:
            g = torch.fx.Graph()
            g.output((g.call_function(op, tuple(g.placeholder(f"a{i}") for i in range(len(xs)))),))
            compiled["fn"] = compile_fx(torch.fx.GraphModule({}, g), list(xs))
        return compiled["fn"](*xs)[0]

    return run


def _split_compiled(q, k, v, se, marker):
    """The split in one compiled graph: cuDNN's causal attention called as its aten op (the
    trunk's length ``marker.shape[0]``, a symbolic size), the KV heads expanded for it."""
    t0 = marker.shape[0]
    r = q.shape[1] // k.shape[1]

    def expand(x):
        b, h, n, d = x.shape
        return x[:, :, None].expand(b, h, r, n, d).reshape(b, h * r, n, d)

    trunk = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q[:, :, :t0], expand(k[:, :, :t0]), expand(v[:, :, :t0]), None, True, 0.0, True,
        False)[0]
    return torch.cat([trunk, _rest_flex(q[:, :, t0:], k, v, se, t0)], dim=2)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.trunk_attention",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", default=".data/swe200.jsonl")
    p.add_argument("--tasks", default="25,35,52,10",
                   help="line numbers in --trees; 'synth': the e2e benchmark's POR-0.75 tree")
    p.add_argument("--causal-lengths", default="8192,16384")
    p.add_argument("--backends", default="cudnn,flash,efficient")
    p.add_argument("--reps", type=int, default=5)
    common.add_run_args(p, "CPU, tiny heads, forward only")
    args = p.parse_args(argv)
    cuda = common.use_cuda(args.dry_run)
    dev = "cuda" if cuda else "cpu"
    common.bump_dynamo_limits()
    hq, hk, d, dtype = common.attention_heads(cuda)
    grad = cuda
    backend = "inductor" if cuda else "eager"
    out_path = common.resolve_out(args, "trunk_attention", cuda)
    res = {"meta": common.run_meta(cuda), "args": vars(args), "causal": {}, "trees": []}

    def rand(h, n):
        return torch.randn(1, h, n, d, device=dev, dtype=dtype, requires_grad=grad)

    def fwd_bwd(fn, *xs):
        def run():
            out = fn(*xs)
            if grad:
                out.backward(torch.ones_like(out))
        return run

    def fwd(fn, *xs):
        def run():
            with torch.no_grad():
                fn(*xs)
        return run

    def measure(fn, q, k, v, pairs, ref):
        """``fn``'s forward and forward + backward times (TFLOP/s on attended pairs: 4·d a
        pair forward, 2.5 times that backward) and its output's and gradients' relative
        difference to ``ref`` (the first variant's: None for the first, which it returns)."""
        f_s = _time(dev, fwd(fn, q, k, v), args.reps)
        b_s = _time(dev, fwd_bwd(fn, q, k, v), args.reps) if grad else None
        out, gs = fn(q, k, v), None
        if grad:
            out.backward(torch.ones_like(out))
            gs = [x.grad.clone() for x in (q, k, v)]
            for x in (q, k, v):
                x.grad = None
        ref = ref or (out.detach(), gs)
        r = {"fwd_ms": f_s * 1e3, "fwd_tflops": pairs * 4 * d / f_s / 1e12,
             "out_rel": common.norm_rel(out.detach(), ref[0])}
        if grad:
            r.update(fwd_bwd_ms=b_s * 1e3, tflops=pairs * 14 * d / b_s / 1e12,
                     bwd_tflops=pairs * 10 * d / max(b_s - f_s, 1e-9) / 1e12,
                     grad_rel=[common.norm_rel(g, h) for g, h in zip(gs, ref[1])])
        return r, ref

    def variants_row(variants, q, k, v, pairs, label, row):
        """Each variant measured (an error recorded) into ``row``, against the first."""
        ref = None
        for name, fn in variants.items():
            try:
                row[name], ref = measure(fn, q, k, v, pairs, ref)
            except Exception as e:  # a backend this torch or GPU does not have
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{label}: {name}: {json.dumps(row[name])}", flush=True)
        return row

    kernels = {"flex": _flex_causal(dev)}
    for name in args.backends.split(","):
        kernels[name] = _sdpa(name)
    lengths = [int(x) for x in args.causal_lengths.split(",")] if cuda else [256]
    for n in lengths:
        torch.manual_seed(0)
        q, k, v = rand(hq, n), rand(hk, n), rand(hk, n)
        res["causal"][str(n)] = variants_row(kernels, q, k, v, n * (n + 1) / 2 * hq,
                                             f"causal {n}", {})
        common.save_json(res, out_path)

    tasks = [x if x == "synth" else int(x) for x in args.tasks.split(",")]
    if cuda:
        lines = [x for x in tasks if x != "synth"]
        trees = {i: t for i, t in enumerate(itertools.islice(treefx.read_jsonl(args.trees),
                                                             max(lines, default=-1) + 1))
                 if i in lines}
        trees["synth"] = common.make_tree(0.75, 1.0, 151936, seed=0)
    else:  # a small synthetic tree: the dry run checks the plumbing, not the data
        tasks, trees = [0], {0: common.make_tree(0.75, 0.05, 1000, seed=3)}
    whole = torch.compile(_whole, backend=backend, dynamic=True)
    rest = torch.compile(_rest_flex, backend=backend, dynamic=True)
    split_compiled = torch.compile(_split_compiled, backend=backend, dynamic=True)
    for i in tasks:
        batch = treefx.pack(trees[i], reduction="mean")
        n = batch.num_tokens
        se = batch.subtree_end.to(dev)
        pos = batch.position_ids[0].to(dev)
        t = trunk_length(batch.parent_token)
        t0 = t // BLOCK * BLOCK
        depth = (pos + 1).double()
        pairs = float(depth.sum()) * hq
        row = {"task": i, "tokens": n, "trunk": t, "trunk_rows": t0,
               "trunk_pair_share": t0 * (t0 + 1) / 2 * hq / pairs}
        torch.manual_seed(1)
        q, k, v = rand(hq, n), rand(hk, n), rand(hk, n)
        variants = {"whole_standard": lambda q, k, v: whole(q, k, v, se)}
        for name in args.backends.split(","):
            causal = _sdpa(name)
            variants[f"split_{name}"] = (
                lambda q, k, v, causal=causal: torch.cat(
                    [causal(q[:, :, :t0], k[:, :, :t0], v[:, :, :t0]),
                     rest(q[:, :, t0:], k, v, se, t0)], dim=2))
        if cuda:
            marker = torch.empty(t0, device=dev)
            variants["split_cudnn_compiled"] = (
                lambda q, k, v: split_compiled(q, k, v, se, marker))
        variants_row(variants, q, k, v, pairs, f"task {i} ({n} tokens, trunk {t})", row)
        res["trees"].append(row)
        common.save_json(res, out_path)
    res["sdpa_backends_expanded_kv"] = sorted(EXPANDED)
    common.save_json(res, out_path)
    print(f"saved {out_path}; KV heads expanded for {sorted(EXPANDED)}")


if __name__ == "__main__":
    main()
