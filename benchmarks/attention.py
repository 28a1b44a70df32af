"""Tree attention alone, forward + backward, against SDPA causal on the same number of attended
(q, k) pairs, in TFLOP/s.

    python -m benchmarks.attention              # GPU, ~2-3 min
    python -m benchmarks.attention --dry-run    # CPU, tiny, checks

Cases per size N (bf16, 16 heads, head_dim 128, batch 1):
- flex_tree:        compiled ``flex_attention`` with ``treefx.layout.tree_block_mask`` (the
                    BlockMask of ``kv <= q < subtree_end[kv]`` from per-block min/max) on a row
                    of synthetic agent trees (POR-0.75 shape) cut at N tokens;
- sdpa_causal_Leq:  SDPA causal (flash forced; also cuDNN and the default choice) at the length
                    L_eq whose causal pair count L(L+1)/2 equals the tree's attended pairs;
- flex_causal_N:    compiled ``flex_attention`` with a causal ``create_block_mask`` at N, and
                    sdpa_causal_N, for reference;
- with --extras: flex_causal_Leq and flex_tree_treefx_op (``TreeFlexAttention``, the op
                    treefx's attention pass inserts, compiled).

FLOP convention: forward F = 4 * pairs * head_dim * heads (QK^T and PV, 2 FLOPs per
multiply-add, attended pairs only); backward = 2.5 F; forward+backward = 3.5 F
(--fwd-bwd-factor). Each case reports forward, backward (= fwd+bwd - fwd) and fwd+bwd times
(CUDA events, median of --reps after --warmup) and TFLOP/s. Ratios between cases do not depend
on the convention. The block mask is built once, outside the timing (``benchmarks.e2e`` times
building it).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import traceback

import torch
import torch.nn.functional as F

import treefx

from . import common
from .internals import (
    TreeFlexAttention,
    block_indices,
    dense_tree_mask,
    heads_to_row,
    interleaved_block_mask,
    row_to_heads,
    tree_block_mask,
    tree_block_tensors,
    tree_mask_mod,
)
from .timing import repeat

BLOCK = 128


def tree_row(n: int, scale: float = 1.0, vocab: int = 32000):
    """``subtree_end`` of a DFS row of agent trees (POR-0.75 shape: 4 rollouts) cut at ``n``
    tokens (ends clipped to n: still a valid forest layout), and the trees."""
    return common.agent_row(n, 700, scale, vocab)


def pairs_of(se: torch.Tensor) -> int:
    """Visible (q, k) pairs of the tree mask: key k is seen by queries k .. subtree_end[k]-1."""
    return int((se - torch.arange(se.numel(), device=se.device)).sum())


def backward_balance(se: torch.Tensor, kv_heads: int, sms: int, block: int = BLOCK) -> dict:
    """A model (not a measurement) of the FlexAttention backward's load balance: one program
    per (kv head, key block) for dK/dV whose work is its column length (query blocks that see
    the key block), then one per query block for dQ (its row length), launched in grid order
    (heads outer, blocks inner) onto ``sms`` multiprocessors, one program each at a time.
    Returns each mask's makespan over the ideal (total work / sms), in grid order, with the
    heads interleaved along the row (:func:`heads_interleaved`) and longest first, and the
    column lengths."""
    import heapq

    kv_num, kv_idx, full_num, full_idx, _ = tree_block_tensors(se.cpu(), block)
    nb = kv_num.shape[-1]
    vis = torch.zeros(nb, nb, dtype=torch.bool)
    for num, idx in ((kv_num, kv_idx), (full_num, full_idx)):
        cols = torch.arange(nb)[None, :] < num[0, 0][:, None].long()
        vis[torch.arange(nb)[:, None].expand(nb, nb)[cols], idx[0, 0].long()[cols]] = True
    col, row = vis.sum(0).tolist(), vis.sum(1).tolist()
    work = (col + row) * kv_heads

    def makespan(order):
        free = [0] * sms
        for w in order:
            heapq.heappush(free, heapq.heappop(free) + w)
        return max(free)

    ideal = sum(work) / sms
    return {"column_max": max(col), "column_mean": sum(col) / nb, "row_max": max(row),
            "grid_order_vs_ideal": makespan(work) / ideal,
            "heads_interleaved_vs_ideal": makespan(  # heads_interleaved(): blocks outer
                [c for c in col for _ in range(kv_heads)]
                + [r_ for r_ in row for _ in range(kv_heads)]) / ideal,
            "longest_first_vs_ideal": makespan(sorted(work, reverse=True)) / ideal}


def l_equivalent(pairs: int) -> int:
    """L with L(L+1)/2 closest to ``pairs``."""
    return max(1, round((math.sqrt(1 + 8 * pairs) - 1) / 2))


class Timer:
    """:func:`benchmarks.timing.repeat` on this run's device."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __call__(self, fn, reps: int, warmup: int) -> list[float]:
        return repeat(fn, reps, self.cuda, warmup)


def qkv(length, heads, kv_heads, d, dtype, dev, seed=0, grad=True):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(1, heads, length, d, dtype=dtype, device=dev, generator=g)
    k = torch.randn(1, kv_heads, length, d, dtype=dtype, device=dev, generator=g)
    v = torch.randn(1, kv_heads, length, d, dtype=dtype, device=dev, generator=g)
    do = torch.randn(1, heads, length, d, dtype=dtype, device=dev, generator=g)
    return [t.requires_grad_(grad) for t in (q, k, v)] + [do]


def run_case(name, attn, length, pairs, args, env, timer, res_n):
    """Time forward and forward+backward of ``attn(q, k, v)`` at ``length``; FLOPs from
    ``pairs``."""
    entry = {"length": length, "pairs": pairs}
    try:
        q, k, v, do = qkv(length, args.heads, args.kv_heads, args.head_dim, env["dtype"],
                          env["dev"], grad=env["backward"])
        t0 = time.perf_counter()
        out = attn(q, k, v)  # first call: compiles
        if env["cuda"]:
            torch.cuda.synchronize()
        entry["first_call_s"] = time.perf_counter() - t0
        del out

        def fwd():
            attn(q, k, v)

        def fwd_bwd():
            o = attn(q, k, v)
            torch.autograd.grad(o, (q, k, v), do)

        f = timer(fwd, args.reps, args.warmup)
        entry["fwd_ms"] = statistics.median(f)
        if env["backward"]:
            fb = timer(fwd_bwd, args.reps, args.warmup)
            entry["fwd_bwd_ms"] = statistics.median(fb)
            entry["bwd_ms"] = entry["fwd_bwd_ms"] - entry["fwd_ms"]
        flops = 4.0 * pairs * args.head_dim * args.heads
        entry["fwd_tflops"] = flops / (entry["fwd_ms"] * 1e-3) / 1e12
        if "fwd_bwd_ms" in entry:
            entry["fwd_bwd_tflops"] = (args.fwd_bwd_factor * flops
                                       / (entry["fwd_bwd_ms"] * 1e-3) / 1e12)
            if entry["bwd_ms"] > 0:
                entry["bwd_tflops"] = ((args.fwd_bwd_factor - 1) * flops
                                       / (entry["bwd_ms"] * 1e-3) / 1e12)
    except Exception as e:
        entry["error"] = traceback.format_exc()[-3000:]
        if env["cuda"] and "out of memory" in str(e).lower():
            torch.cuda.empty_cache()
    res_n[name] = entry
    msg = entry.get("error", "").strip().splitlines()[-1][:200] if "error" in entry else (
        f"fwd {entry['fwd_ms']:.3f} ms ({entry['fwd_tflops']:.0f} TFLOP/s)"
        + (f", fwd+bwd {entry['fwd_bwd_ms']:.3f} ms ({entry['fwd_bwd_tflops']:.0f} TFLOP/s)"
           if "fwd_bwd_ms" in entry else ""))
    print(f"  N={res_n['tokens']:6d} {name:24s} L={length:6d}: {msg}", flush=True)


def sdpa_fn(backend_name, gqa):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}

    def attn(q, k, v):
        kw = {"enable_gqa": True} if gqa else {}
        if backend_name == "default":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
        with sdpa_kernel([getattr(SDPBackend, backends[backend_name])]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
    return attn


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_run_args(p, "CPU, float32, tiny: flex forward checked against dense SDPA")
    p.add_argument("--tokens", default="16384,65536", help="tree row lengths N")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16, help="< heads: GQA (enable_gqa)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--fwd-bwd-factor", type=float, default=3.5,
                   help="fwd+bwd FLOPs / fwd FLOPs (3.5: backward = 2.5x forward)")
    p.add_argument("--scale", type=float, default=1.0, help="tree token lengths multiplier")
    p.add_argument("--extras", action="store_true",
                   help="also flex causal at L_eq and TreeFlexAttention (more compilations)")
    p.add_argument("--e2e-trees", default="",
                   help="also: tree attention on benchmarks.e2e's trees at these PORs in several block "
                        "layouts, beside the packed baseline's attention (e.g. 0.75)")
    p.add_argument("--kernel-sweep", action="store_true",
                   help="with --e2e-trees: FlexAttention kernel options (tile sizes, TMA, "
                        "max-autotune) on the tree and packed masks, each checked against "
                        "the default kernel's output and gradients")
    p.add_argument("--sweep-autotune", action="store_true",
                   help="with --kernel-sweep: also max-autotune (several minutes)")
    p.add_argument("--layouts", action="store_true", default=None,
                   help="with --e2e-trees: the block-layout variants (default: on unless "
                        "--kernel-sweep)")
    args = p.parse_args(argv)

    cuda = common.use_cuda(args.dry_run)
    common.bump_dynamo_limits(accumulated=None)
    if not cuda and not args.dry_run:
        p.error("no CUDA device: use --dry-run on the CPU")
    if args.dry_run:
        args.tokens, args.heads, args.kv_heads, args.head_dim = "512,1024", 2, 2, 16
        args.reps, args.warmup = 3, 1
    env = {"cuda": cuda, "dev": "cuda" if cuda else "cpu",
           "dtype": torch.bfloat16 if cuda else torch.float32,
           "backward": cuda}  # FlexAttention has no CPU backward
    gqa = args.kv_heads != args.heads
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if cuda:
        flex = torch.compile(flex_attention, dynamic=False)
    else:
        flex = flex_attention  # eager flex forward on the CPU (a reference path)

    def flex_with(bm):
        def attn(q, k, v):
            return flex(q, k, v, block_mask=bm, enable_gqa=gqa)
        return attn

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    common.resolve_out(args, "attention", cuda)
    res = {
        "meta": common.run_meta(cuda),
        "config": vars(args),
        "convention": (f"fwd FLOPs = 4*pairs*head_dim*heads; fwd+bwd = {args.fwd_bwd_factor} x "
                       f"fwd; bwd = {args.fwd_bwd_factor - 1} x fwd; pairs = attended (q,k) "
                       f"pairs only; batch 1, dtype {env['dtype']}"),
        "sizes": {},
    }
    timer = Timer(cuda)
    res["e2e_trees"] = {}
    if args.e2e_trees:
        e2e_tree_variants(args, env, timer, res, flex, gqa)
        common.save_json(res, args.out)
    for n in [int(x) for x in args.tokens.split(",") if x]:
        se_cpu, trees = tree_row(n, args.scale * (0.1 if args.dry_run else 1.0))
        se = se_cpu.to(env["dev"])
        pairs = pairs_of(se_cpu)
        leq = l_equivalent(pairs)
        r = {"tokens": n, "trees": len(trees), "tree_pairs": pairs, "L_eq": leq,
             "causal_pairs_N": n * (n + 1) // 2,
             "tree_density_vs_causal": pairs / (n * (n + 1) / 2)}
        res["sizes"][str(n)] = r
        print(f"N={n}: {len(trees)} trees, {pairs} attended pairs = "
              f"{r['tree_density_vs_causal']:.3f} of causal; L_eq = {leq}", flush=True)
        try:
            bm_tree = tree_block_mask(se, BLOCK)
            nblocks = int(bm_tree.kv_num_blocks.sum()) + int(bm_tree.full_kv_num_blocks.sum())
            r["tree_blocks_visited"] = nblocks
            r["tree_blocks_full"] = int(bm_tree.full_kv_num_blocks.sum())
            nb = -(-n // BLOCK)
            r["causal_blocks_visited"] = nb * (nb + 1) // 2
        except Exception:
            r["tree_block_mask_error"] = traceback.format_exc()[-3000:]
            bm_tree = None
        bm_causal = {}

        def causal_mask(length):
            if length not in bm_causal:
                bm_causal[length] = create_block_mask(causal, None, None, length, length,
                                                      device=env["dev"], BLOCK_SIZE=BLOCK)
            return bm_causal[length]

        cases = {}
        if bm_tree is not None:
            cases["flex_tree"] = (flex_with(bm_tree), n, pairs)
        cases["flex_causal_N"] = (flex_with(causal_mask(n)), n, n * (n + 1) // 2)
        for b in ("flash", "cudnn", "default"):
            if cuda or b == "default":
                cases[f"sdpa_{b}_causal_Leq"] = (sdpa_fn(b, gqa), leq, leq * (leq + 1) // 2)
        cases["sdpa_default_causal_N"] = (sdpa_fn("default", gqa), n, n * (n + 1) // 2)
        if args.extras:
            cases["flex_causal_Leq"] = (flex_with(causal_mask(leq)), leq, leq * (leq + 1) // 2)
            cases["flex_tree_treefx_op"] = (treefx_op(se, n, cuda, gqa), n, pairs)
        for name, (attn, length, pr) in cases.items():
            run_case(name, attn, length, pr, args, env, timer, r)
        if args.dry_run:
            r["checks"] = dry_checks(se, n, args, flex_with, bm_tree, gqa)
            print(f"  checks: {r['checks']}", flush=True)
        ref = r.get("sdpa_flash_causal_Leq") or r.get("sdpa_default_causal_Leq") or {}
        key = "fwd_bwd_tflops" if "fwd_bwd_tflops" in ref else "fwd_tflops"
        for name in ("flex_tree", "flex_causal_N"):
            if key in r.get(name, {}) and key in ref:
                r[f"{name}_vs_sdpa_Leq_{key}"] = r[name][key] / ref[key]
        if key in r.get("flex_tree", {}) and key in r.get("flex_causal_N", {}):
            r[f"flex_tree_vs_flex_causal_N_{key}"] = r["flex_tree"][key] / r["flex_causal_N"][key]
        if cuda:
            torch.cuda.empty_cache()
        common.save_json(res, args.out)

    print_table(res)
    common.save_json(res, args.out)
    print(f"JSON: {args.out}")
    return res


def _block_mask(kv_num, kv_idx, full_num, full_idx, se_pad, n, block):
    from torch.nn.attention.flex_attention import BlockMask

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
                                    mask_mod=tree_mask_mod(se_pad), seq_lengths=(n, n))


def _diagonal_only(se, block):
    """Block tensors with every off-diagonal visited block marked full and only diagonal
    blocks partial. WRONG attention (partial blocks computed as full): timing only, to
    measure what the partial blocks' masking costs."""
    kv_num, kv_idx, full_num, full_idx, se_pad = tree_block_tensors(se, block)
    nb = kv_num.shape[-1]
    b = torch.arange(nb, device=se.device)
    vis = torch.zeros(nb, nb, dtype=torch.bool, device=se.device)
    for num, idx in ((kv_num, kv_idx), (full_num, full_idx)):
        cols = torch.arange(nb, device=se.device)[None, :] < num[0, 0][:, None].long()
        rows = b[:, None].expand(nb, nb)[cols]
        vis[rows, idx[0, 0].long()[cols]] = True
    diag = b[None, :] == b[:, None]
    full = vis & ~diag

    return (*block_indices(diag), *block_indices(full), se_pad)


# Kernel tile sizes for a 64-token sparse block (forward BLOCK_M/N, backward M1/N1, M2/N2).
_KO64 = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64,
         "BLOCK_N2": 32}


def e2e_tree_variants(args, env, timer, res, flex, gqa):
    """Tree attention on the end-to-end benchmark's trees (``--e2e-trees``), in several block
    layouts, beside the packed baseline's document-masked attention on the same sequences:
    how efficient tree attention is per attended pair, and what its partial blocks cost."""

    def save():  # after every case: a run stopped at its time limit keeps what it measured
        common.save_json(res, args.out)

    for por in [float(x) for x in args.e2e_trees.split(",") if x]:
        tree = common.make_tree(por, args.scale * (0.03 if args.dry_run else 1.0), 32000)
        batch = treefx.pack(tree)
        se = batch.subtree_end.to(env["dev"])
        n = batch.num_tokens
        lens = list(tree.sequence_lengths)
        ends = torch.tensor([e for ln, e in zip(lens, torch.tensor(lens).cumsum(0).tolist())
                             for _ in range(ln)], device=env["dev"])
        r = {"tokens": n, "baseline_tokens": len(ends), "tree_pairs": pairs_of(se.cpu()),
             "baseline_pairs": pairs_of(ends.cpu()), "por": tree.por}
        res["e2e_trees"][f"por{por:g}"] = r
        print(f"e2e tree POR {tree.por:.3f}: {n} tokens, {r['tree_pairs']} pairs; packed "
              f"{len(ends)} tokens, {r['baseline_pairs']} pairs", flush=True)
        sms = (torch.cuda.get_device_properties(0).multi_processor_count if env["cuda"]
               else 132)
        r["backward_balance_model"] = {
            name: backward_balance(s_, args.kv_heads, sms) for name, s_ in (("tree", se),
                                                                            ("packed", ends))}
        print(f"  backward load-balance model ({sms} SMs): {r['backward_balance_model']}",
              flush=True)

        def flex_bm(bm, ko=None):
            def attn(q, k, v):
                return flex(q, k, v, block_mask=bm, enable_gqa=gqa,
                            **({"kernel_options": ko} if ko else {}))
            return attn

        if args.kernel_sweep:
            kernel_sweep(se, ends, args, env, timer, r, gqa, save)
        if not (args.layouts if args.layouts is not None else not args.kernel_sweep):
            continue
        cases = {}
        for block, ko in ((128, None), (64, _KO64)):
            try:
                t = tree_block_tensors(se, block)
                cases[f"tree_b{block}"] = (flex_bm(_block_mask(*t, n, block), ko), n,
                                           r["tree_pairs"])
                r[f"tree_b{block}_blocks"] = {"partial": int(t[0].sum()), "full": int(t[2].sum())}
            except Exception:
                r[f"tree_b{block}_error"] = traceback.format_exc()[-2000:]
        inter = heads_interleaved(se, args.kv_heads)
        cases["tree_b128_heads_interleaved"] = (lambda q, k, v: inter(q, k, v, flex), n,
                                                r["tree_pairs"])
        cases["TIMING_ONLY_interleave_copies"] = (interleave_copies(se, args.kv_heads), n,
                                                  r["tree_pairs"])
        for il in (False, True):
            cases["treefx_op" + ("_interleaved" if il else "")] = (
                treefx_op(se, n, env["cuda"], gqa, interleave=il), n, r["tree_pairs"])
        t = tree_block_tensors(se, 128, full=False)
        cases["tree_b128_all_partial"] = (flex_bm(_block_mask(*t, n, 128)), n, r["tree_pairs"])
        t = _diagonal_only(se, 128)
        cases["TIMING_ONLY_tree_b128_partial_as_full"] = (flex_bm(_block_mask(*t, n, 128)), n,
                                                          r["tree_pairs"])
        t = tree_block_tensors(ends, 128)
        cases["packed_doc_b128"] = (flex_bm(_block_mask(*t, len(ends), 128)), len(ends),
                                    r["baseline_pairs"])
        for name, (attn, length, pr) in cases.items():
            run_case(name, attn, length, pr, args, env, timer, r)
        tf = {k: v.get("fwd_bwd_tflops") or v.get("fwd_tflops") for k, v in r.items()
              if isinstance(v, dict) and ("fwd_tflops" in v)}
        if tf.get("packed_doc_b128"):
            r["tflops_vs_packed"] = {k: v / tf["packed_doc_b128"] for k, v in tf.items()}
            print(f"  TFLOP/s relative to packed: {r['tflops_vs_packed']}", flush=True)


# FlexAttention kernel options tried by --kernel-sweep. Tile sizes are left to
# --sweep-autotune (max-autotune searches them: forward BLOCK_M/N, backward BLOCK_M1/N1/M2/N2,
# stages, warps); torch's Hopper default for bf16, head_dim 128 is forward 128x64 (3 stages,
# 8 warps), backward 64/128/128/64 (3 stages, 8 warps).
SWEEP = {
    "default": {},
    "rows_safe": {"ROWS_GUARANTEED_SAFE": True},  # every tree row attends itself
    "tma": {"USE_TMA": True},
    "rows_safe_tma": {"ROWS_GUARANTEED_SAFE": True, "USE_TMA": True},
}


def kernel_sweep(se, ends, args, env, timer, r, gqa, save):
    """Tree (and packed) attention under several FlexAttention kernel options and under
    ``max-autotune``: time each, and check each against the default kernel (max abs
    difference of the output and of dq, dk, dv on the same inputs)."""
    from torch.nn.attention.flex_attention import flex_attention

    if env["cuda"]:
        flex = torch.compile(flex_attention, dynamic=False)
        tuned = torch.compile(flex_attention, dynamic=False, mode="max-autotune-no-cudagraphs")
    else:  # --dry-run: the plumbing only (eager; kernel options are ignored there)
        flex = tuned = flex_attention
    n, m = se.numel(), ends.numel()
    masks = {"tree": (_block_mask(*tree_block_tensors(se, 128), n, 128), n, r["tree_pairs"]),
             "packed": (_block_mask(*tree_block_tensors(ends, 128), m, 128), m,
                        r["baseline_pairs"])}
    plan = [("tree", name, ko, flex) for name, ko in SWEEP.items()]
    plan += [("packed", "default", None, flex)]
    if args.sweep_autotune:
        plan += [("tree", "max_autotune", None, tuned), ("packed", "max_autotune", None, tuned)]
    ref = {}
    r["kernel_sweep"] = sweep = {"tokens": n}
    for mask_name, name, ko, fn in plan:
        bm, length, pairs = masks[mask_name]

        def attn(q, k, v, bm=bm, ko=ko, fn=fn):
            return fn(q, k, v, block_mask=bm, enable_gqa=gqa,
                      **({"kernel_options": ko} if ko else {}))

        label = f"{mask_name}_{name}"
        run_case(label, attn, length, pairs, args, env, timer, sweep)
        if "error" in sweep[label]:
            continue
        try:
            q, k, v, do = qkv(length, args.heads, args.kv_heads, args.head_dim, env["dtype"],
                              env["dev"], seed=3, grad=env["backward"])
            out = attn(q, k, v)
            got = [out.detach()]
            if env["backward"]:
                got += torch.autograd.grad(out, (q, k, v), do)
            if name == "default":
                ref[mask_name] = got
            else:
                sweep[label]["max_abs_diff_vs_default"] = [
                    (a.float() - b.float()).abs().max().item()
                    for a, b in zip(got, ref[mask_name])]
        except Exception:
            sweep[label]["check_error"] = traceback.format_exc()[-1500:]
        save()
    base = sweep.get("tree_default", {}).get("fwd_bwd_ms")
    if base:
        print("  kernel sweep, tree fwd+bwd relative to the default kernel: " + ", ".join(
            f"{k}={v['fwd_bwd_ms'] / base:.3f}" for k, v in sweep.items()
            if isinstance(v, dict) and v.get("fwd_bwd_ms") and k.startswith("tree")),
            flush=True)


def heads_interleaved(se: torch.Tensor, kv_heads: int, block: int = BLOCK):
    """Tree attention with the KV heads interleaved along the row at block granularity: row
    block ``b * kv_heads + g`` holds block ``b`` of KV head ``g``. FlexAttention's backward
    launches its programs head by head, so in the usual layout the long-running programs of the
    shared-prefix key blocks of the last heads start last (``backward_balance``); interleaved,
    every head's first blocks launch first. Returns ``attn(q, k, v, flex)`` on the usual
    [1, H, N, D] tensors, built from treefx's own pieces (``interleave_block_tensors``, the
    row permutation, the mask_mod of ``TreeFlexAttention(interleave_heads=True)``); the
    permutation copies are inside it (timed with the attention, eager ops here; compiled into
    the surrounding kernels in ``treefx_op(..., interleave=True)``)."""
    from torch.nn.attention.flex_attention import BlockMask

    n = se.numel()
    kv_num, kv_idx, full_num, full_idx, se_pad = tree_block_tensors(se, block)
    nb, hk = kv_num.shape[-1], kv_heads
    pos_pad = torch.zeros_like(se_pad)  # no model mask: positions unused
    length = nb * hk * block
    cache = {}

    def attn(q, k, v, flex):
        gq = q.shape[1] // hk
        if gq not in cache:
            op = TreeFlexAttention(block_size=block, interleave_heads=True)
            mods = op._interleaved_mask_mod(hk, gq)
            std = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx,
                                           BLOCK_SIZE=block, seq_lengths=(n, n))
            cache[gq] = interleaved_block_mask(
                std, hk, length, lambda b, h, qi, ki: mods(b, h, qi, ki, se_pad, pos_pad))
        o = flex(*(heads_to_row(x, hk, nb, block) for x in (q, k, v)), block_mask=cache[gq],
                 enable_gqa=gq > 1)
        return row_to_heads(o, hk, nb, block, n)

    return attn


def interleave_copies(se: torch.Tensor, kv_heads: int, block: int = BLOCK):
    """TIMING ONLY: the row permutation of q, k, v and back, without attention (its cost in
    ``heads_interleaved``)."""
    n = se.numel()
    nb = -(-n // block)

    def attn(q, k, v):
        rows = [heads_to_row(x, kv_heads, nb, block) for x in (q, k, v)]
        mixed = rows[0] + rows[1].repeat_interleave(rows[0].shape[1] // rows[1].shape[1], 1) \
            + rows[2].repeat_interleave(rows[0].shape[1] // rows[2].shape[1], 1)
        return row_to_heads(mixed, kv_heads, nb, block, n)

    return attn


def treefx_op(se, n, cuda, gqa, interleave=False):
    """The op treefx's attention pass inserts (TreeFlexAttention; KV heads shared natively, as
    the pass gives them), compiled, with its block tensors built once."""
    kv_num, kv_idx, full_num, full_idx, se_pad = tree_block_tensors(se, BLOCK)
    pos_pad = torch.zeros_like(se_pad)  # no model mask: positions unused
    op = TreeFlexAttention(block_size=BLOCK, interleave_heads=interleave)

    def call(q, k, v):
        return op(q, k, v, kv_num, kv_idx, full_num, full_idx, se_pad, pos_pad)

    if not cuda:
        return call
    # As treefx runs it: one node of an FX graph handed to Inductor (Dynamo does not trace
    # into the op; AOTAutograd does, with the permutation copies next to the attention).
    from torch._inductor.compile_fx import compile_fx

    compiled = {}

    def run(q, k, v):
        args = (q, k, v, kv_num, kv_idx, full_num, full_idx, se_pad, pos_pad)
        if "fn" not in compiled:
            g = torch.fx.Graph()
            phs = [g.placeholder(f"a{i}") for i in range(len(args))]
            g.output((g.call_function(op, tuple(phs)),))
            compiled["fn"] = compile_fx(torch.fx.GraphModule({}, g), list(args))
        return compiled["fn"](*args)[0]

    return run


def dry_checks(se, n, args, flex_with, bm_tree, gqa) -> dict:
    """CPU: flex forward with the tree BlockMask (and TreeFlexAttention) equals SDPA with the
    dense tree mask; the pair count equals the dense mask's."""
    q, k, v, _ = qkv(n, args.heads, args.kv_heads, args.head_dim, torch.float32, "cpu", seed=1,
                      grad=False)
    dense = dense_tree_mask(se)
    out = {"pairs_match_dense": pairs_of(se) == int(dense.sum())}
    with torch.no_grad():
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense,
                                             **({"enable_gqa": True} if gqa else {}))
        if bm_tree is not None:
            got = flex_with(bm_tree)(q, k, v)
            out["flex_tree_vs_dense_max_abs"] = (got - ref).abs().max().item()
            from torch.nn.attention.flex_attention import flex_attention

            got = heads_interleaved(se, args.kv_heads)(q, k, v, flex_attention)
            out["heads_interleaved_vs_dense_max_abs"] = (got - ref).abs().max().item()
        for il, key in ((False, "treefx_op"), (True, "treefx_op_interleaved")):
            try:
                out[f"{key}_vs_dense_max_abs"] = (
                    treefx_op(se, n, False, gqa, interleave=il)(q, k, v) - ref).abs().max().item()
            except Exception:
                out[f"{key}_error"] = traceback.format_exc()[-1500:]
    return out


def print_table(res):
    print()
    m = res["meta"]
    print(f"device {m['device']} | torch {m['torch']} | triton {m['triton']} | {res['convention']}")
    hdr = (f"{'N':>6s} {'case':24s} {'L':>6s} {'pairs':>12s} {'fwd ms':>8s} {'fwd TF/s':>8s} "
           f"{'bwd ms':>8s} {'bwd TF/s':>8s} {'f+b ms':>8s} {'f+b TF/s':>8s}")
    print(hdr)
    print("-" * len(hdr))

    def f(v, fmt):
        width = int("0" + fmt.split(".")[0].rstrip("dfe"))
        return format(v, fmt) if v is not None else "-".rjust(width)

    for n, r in res["sizes"].items():
        for name, e in r.items():
            if not isinstance(e, dict) or "length" not in e:
                continue
            if "error" in e:
                print(f"{n:>6s} {name:24s} {e['length']:6d} FAILED: "
                      f"{e['error'].strip().splitlines()[-1][:150]}")
                continue
            print(f"{n:>6s} {name:24s} {e['length']:6d} {e['pairs']:12d} "
                  f"{f(e.get('fwd_ms'), '8.3f')} {f(e.get('fwd_tflops'), '8.1f')} "
                  f"{f(e.get('bwd_ms'), '8.3f')} {f(e.get('bwd_tflops'), '8.1f')} "
                  f"{f(e.get('fwd_bwd_ms'), '8.3f')} {f(e.get('fwd_bwd_tflops'), '8.1f')}")
        extra = {k: v for k, v in r.items() if k.endswith("_tflops") and not isinstance(v, dict)}
        if extra:
            print(f"{'':>6s} ratios: " + ", ".join(f"{k} = {v:.2f}" for k, v in extra.items()))
        print(f"{'':>6s} tree: {r['tree_pairs']} pairs ({r['tree_density_vs_causal']:.3f} of "
              f"causal), blocks visited {r.get('tree_blocks_visited')} (full "
              f"{r.get('tree_blocks_full')}) vs causal {r.get('causal_blocks_visited')}")


if __name__ == "__main__":
    main()
