"""``python -m benchmarks.e2e``: arguments, trees, then each model size (see the package
docstring for what it measures)."""

from __future__ import annotations

import argparse
import time
import traceback

import torch

from .. import common
from . import run
from .dry_checks import print_dry_checks
from .env import ARCH_SHAPES, Env
from .methods import EXTRA_METHODS, HYBRID_METHODS, METHODS
from .report import conventions, print_table, summarize, tree_info


def parse_args(argv=None):
    from . import __doc__ as doc

    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e",
                                description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_run_args(p, "CPU, tiny float32 model and trees, eager backends, exactness checks")
    p.add_argument("--hidden", default="1024,2048", help="comma-separated hidden sizes")
    p.add_argument("--por", default="0.3,0.5,0.75,0.85", help="target POR of each tree")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiplies all token lengths (tree size ~ proportional)")
    p.add_argument("--methods", default=None,
                   help=f"subset of {METHODS}, plus opt-in {EXTRA_METHODS} (default: "
                        f"{','.join(METHODS)}; for the hybrids {','.join(HYBRID_METHODS)})")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16,
                   help="attention heads of the qwen3 model (head_dim 128; "
                        "Qwen3-8B: --hidden 4096 --heads 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="its key/value heads")
    p.add_argument("--arch", choices=("qwen3", "qwen3_next", "qwen3_5"), default="qwen3",
                   help="qwen3 (attention; --hidden), or Qwen3-Next-80B-A3B's and Qwen3.5's "
                        "layer shapes (Gated DeltaNet + attention, 3:1; env.ARCH_SHAPES)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--mask-reps", type=int, default=0,
                   help="accepted and ignored (retired in issue 67: benchmarks/README.md)")
    p.add_argument("--stream", type=int, default=0,
                   help="accepted and ignored (retired in issue 67: benchmarks/README.md)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true",
                   help="also profile each measured step: GPU time by kernel kind")
    p.add_argument("--pack-budget", type=int, default=0,
                   help="packed_reset: micro-batches of at most max(N, longest sequence) "
                        "tokens (first-fit decreasing), gradients accumulated, as trainers "
                        "pack; 0: every sequence in one row")
    p.add_argument("--budget", type=float, default=480.0,
                   help="seconds; measurements not started by then are skipped (recorded)")
    p.add_argument("--quick", action="store_true",
                   help="hidden 1024 only, 1 warm-up + 3 reps")
    args = p.parse_args(argv)
    if args.methods is None:
        args.methods = ",".join(HYBRID_METHODS if args.arch in ARCH_SHAPES else METHODS)
    args.methods = [m for m in args.methods.split(",") if m]
    for m in args.methods:
        if m not in METHODS + EXTRA_METHODS:
            p.error(f"unknown method {m!r}; choose from {METHODS + EXTRA_METHODS}")
    args.hiddens = [int(h) for h in args.hidden.split(",") if h]
    if args.quick:
        args.hiddens = args.hiddens[:1]
        args.warmup, args.reps = 1, 3
    if args.dry_run:
        args.hiddens = args.hiddens[:1]
        args.warmup, args.reps = 1, 2
        args.vocab = 256
    if not torch.cuda.is_available() and not args.dry_run:
        p.error("no CUDA device: use --dry-run on the CPU")
    return args


def main(argv=None):
    args = parse_args(argv)
    t_start = run.START = time.perf_counter()
    deadline = t_start + args.budget
    env = Env(args)
    common.resolve_out(args, "e2e", env.cuda)
    common.bump_dynamo_limits()
    if env.cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    res = {"meta": common.run_meta(env.cuda),
           "config": {k: v for k, v in vars(args).items() if k != "hiddens"},
           "conventions": conventions(args, env), "trees": {}, "models": {}, "runs": {}}
    m = res["meta"]
    print(f"device: {m['device']}; torch {m['torch']}; transformers {m['transformers']}; "
          f"backend {env.backend}; dtype {env.dtype}", flush=True)

    trees = {}
    t0 = time.perf_counter()
    for por in [float(x) for x in args.por.split(",") if x]:
        label = f"por{por:g}"
        try:
            trees[label] = common.make_tree(por, args.scale * (0.03 if args.dry_run else 1.0),
                                            args.vocab, args.seed)
            res["trees"][label] = tree_info(trees[label])
        except Exception:
            res["trees"][label] = {"error": traceback.format_exc()[-2000:]}
        print(f"tree {label}: {res['trees'][label]}", flush=True)
    print(f"trees made in {time.perf_counter() - t0:.1f} s", flush=True)
    common.save_json(res, args.out)

    for hidden in args.hiddens:
        try:
            run.run_hidden(env, args, hidden, trees, res, deadline)
        except Exception:
            res.setdefault("errors", {})[f"hidden{hidden}"] = traceback.format_exc()[-4000:]
            print(f"hidden {hidden}: FAILED\n{traceback.format_exc()[-2000:]}", flush=True)
        common.save_json(res, args.out)

    res["summary"] = summarize(res)
    res["total_s"] = time.perf_counter() - t_start
    common.save_json(res, args.out)
    if env.dry and "dry_run_checks" in res:
        print_dry_checks(res["dry_run_checks"])
    print_table(res, res["summary"])
    print(f"total {res['total_s']:.0f} s; JSON: {args.out}")
    return res
