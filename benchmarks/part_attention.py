"""Tree attention alone, forward and backward, over a whole tree and over its redundancy-free
parts (``treefx.parts.plan``), with FlexAttention kernel-option variants for the parts.

    python -m benchmarks.part_attention                  # GPU: 8B-shaped attention, bf16
    python -m benchmarks.part_attention --dry-run        # CPU: tiny heads, forward only

The tree and the plan are those of ``python -m benchmarks.parts --budget B --scale S``.
Per layer of an 8B-shaped model (32 query heads, 8 KV heads, head_dim 128, bf16): random
q, k, v for the row; ``whole``: the tree attention over the row; each variant: every part's
queries over ``[context; part]`` with its kernel options (the context keys and values are
leaves that receive gradients, as in ``treefx.backward``). Both through the public
FlexAttention API with the block masks treefx's sites build (``TreeFlexAttention``,
``TreePartFlexAttention``), so Dynamo traces them; the kernels are the same.
Reported: the median time of ``--reps`` passes (forward + backward of all parts), after a
warm-up pass that compiles, and the parts' time over the whole row's. This is where the
parts' step differs from the whole step at 16k (benchmarks/HISTORY.md, "Trees larger than
memory").
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

import treefx
from benchmarks import common
from benchmarks.internals import attention_ops, tree_block_tensors

VARIANTS = {
    "default": {},
    "fwd64": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64},
    "fwd64-dq64": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "bwd_BLOCK_M2": 64,
                   "bwd_BLOCK_N2": 64},
    "dkdv-m32": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64},
    "warps4": {"num_warps": 4},
}


def _time(dev, fn, reps):
    fn()
    times = []
    for _ in range(reps):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _whole(q, k, v, se, pos, kernel_options):
    """The whole row's tree attention, through the public FlexAttention API (the kernel
    treefx's sites run; Dynamo traces this form, not the operator call the sites make)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    kv_num, kv_idx, full_num, full_idx, se_pad = tree_block_tensors(se, 128)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < se_pad[kv_idx])

    n = q.shape[-2]
    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=128,
                                  mask_mod=mask_mod, seq_lengths=(n, n))
    return flex_attention(q, k, v, block_mask=bm, enable_gqa=True,
                          kernel_options={**attention_ops.STANDARD_KERNEL, **kernel_options})


def _part(q, k, v, kc, vc, se_ext, kernel_options):
    """A part's queries over [context; own] keys, as :class:`TreePartFlexAttention` builds
    it: the extended row's block mask with its query blocks cut to the part's."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    a, n = kc.shape[-2], q.shape[-2]
    keys, values = torch.cat([kc, k], dim=-2), torch.cat([vc, v], dim=-2)
    kv_num, kv_idx, full_num, full_idx, se_pad = tree_block_tensors(se_ext, 128)
    first = a // 128
    offset = se_ext.new_full((1,), a)  # a tensor: the mask reads no Python size

    def mask_mod(b, h, q_idx, kv_idx):
        qe = q_idx + offset[0]
        return (kv_idx <= qe) & (qe < se_pad[kv_idx])

    bm = BlockMask.from_kv_blocks(kv_num[:, :, first:], kv_idx[:, :, first:],
                                  full_num[:, :, first:], full_idx[:, :, first:],
                                  BLOCK_SIZE=128, mask_mod=mask_mod, seq_lengths=(n, a + n))
    return flex_attention(q, keys, values, block_mask=bm, enable_gqa=True,
                          kernel_options={**attention_ops.STANDARD_KERNEL, **kernel_options})


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.part_attention",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=int, default=16384)
    p.add_argument("--scale", type=float, default=4.0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--variants", default=",".join(VARIANTS))
    common.add_run_args(p, "CPU, tiny heads, forward only")
    args = p.parse_args(argv)
    cuda = common.use_cuda(args.dry_run)
    dev = "cuda" if cuda else "cpu"
    common.bump_dynamo_limits()
    hq, hk, d, dtype = common.attention_heads(cuda)
    budget, scale = (args.budget, args.scale) if cuda else (320, 0.08)
    tree = common.make_tree(0.75, scale, 151936, seed=3)
    batch = treefx.pack(tree, reduction="mean")
    plan = treefx.parts.plan(batch, budget)
    n = batch.num_tokens
    print(f"tree {n} tokens, {plan.num_parts} parts (budget {budget})", flush=True)
    res = {"meta": common.run_meta(cuda), "args": vars(args), "tokens": n,
           "parts": [[q.num_tokens, q.context_pad] for q in plan.parts]}
    grad = cuda  # no FlexAttention backward on the CPU
    torch.manual_seed(0)

    def rand(h, rows):
        return torch.randn(1, h, rows, d, device=dev, dtype=dtype, requires_grad=grad)

    q, k, v = rand(hq, n), rand(hk, n), rand(hk, n)
    se = batch.subtree_end.to(dev)
    pos = batch.position_ids[0].to(dev)
    backend = "inductor" if cuda else "eager"

    whole = torch.compile(functools.partial(_whole, kernel_options={}), backend=backend,
                          dynamic=True)

    def run_whole():
        out = whole(q, k, v, se, pos)
        if grad:
            out.sum().backward()

    res["whole_s"] = _time(dev, run_whole, args.reps)
    print(f"whole: {res['whole_s'] * 1e3:.1f} ms", flush=True)
    # Each part's inputs, in the extended row's coordinates (treefx.parts.part_tensors).
    inputs = []
    for part in plan.parts:
        t = treefx.parts.part_tensors(plan, part, dev)
        a, m = part.context_pad, part.num_tokens
        se_ext = torch.cat([t["part_info"][2], t["tree_info"][2]])
        pos_ext = torch.cat([t["part_info"][0], t["tree_info"][0]])
        inputs.append((rand(hq, t["input_ids"].shape[1]), rand(hk, t["input_ids"].shape[1]),
                       rand(hk, t["input_ids"].shape[1]), rand(hk, a), rand(hk, a), se_ext,
                       pos_ext, m))
    res["variants"] = {}
    for name in args.variants.split(","):
        torch._dynamo.reset()
        fn = torch.compile(functools.partial(_part, kernel_options=VARIANTS[name]),
                           backend=backend, dynamic=True)

        def run_parts():
            for qi, ki, vi, kc, vc, se_ext, _, _ in inputs:
                out = fn(qi, ki, vi, kc, vc, se_ext)
                if grad:
                    out.sum().backward()

        try:
            s = _time(dev, run_parts, args.reps)
            res["variants"][name] = {"parts_s": s, "ratio": s / res["whole_s"]}
            print(f"{name}: {s * 1e3:.1f} ms, {s / res['whole_s']:.3f}x the whole row",
                  flush=True)
        except Exception as e:  # an option this torch's kernel does not take
            res["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{name}: {res['variants'][name]['error']}", flush=True)
        common.save_json(res, common.resolve_out(args, "part_attention", cuda))
    print(json.dumps(res["variants"], indent=1))


if __name__ == "__main__":
    main()
