"""Gated DeltaNet gradients in parts, one process: which setting moves them away from the
oracle (issue 37's FSDP2 hybrid check found the parts path 380x further from the oracle than
the whole-tree path on two H200s, with FSDP2, checkpointing, regional execution and Inductor
combined; one H100 without FSDP2 or checkpointing was exact)?

    python -m benchmarks.gdn_parts_check [--variants plain,ckpt,fsdp,fsdp+ckpt] \\
        [--backends inductor,eager] [--budgets 256]
    python -m benchmarks.gdn_parts_check --dry-run          # CPU: tiny model, few trees

Exit status 1 when a variant fails or its parts are more than ``FLAG`` times further from the
oracle than its whole trees.

A float32 Qwen3-Next (``benchmarks.distributed_check.EXACT_HYBRID``; TF32 off) on the check
forest (odd trees and a 6k-token agent tree), one process: the per-sequence oracle, then for
each variant (a fresh model of the same weights: ``regional`` regional execution, ``ckpt``
activation checkpointing, ``fsdp`` FSDP2 ``fully_shard`` per layer and root in a one-rank
process group; regional execution for all three; ``hold``: parts planned without recompute
parts, as under FSDP2) and backend, ``treefx.compile`` on the whole batch and ``treefx.backward`` at each
budget. Printed per parameter group: the worst max |g - g_ref| / max(max |g_ref|, 1e-3 × the
model's largest |g_ref|) (``benchmarks.distributed_check``'s rule), and with ``--floor`` the
oracle's own floor (``oracle_floor_gradients``, slow on a CPU). JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import time
import traceback
from unittest import mock

import torch

import treefx

from . import common
from .common import check_forest, odd_forest
from .distributed_check import EXACT_HYBRID, SCALE_FLOOR, _grads, _hybrid, _rel
from .fsdp import _build, _shard

VARIANTS = ("plain", "regional", "ckpt", "fsdp", "fsdp+ckpt")
# dry run: three Gated DeltaNet layers (two of them share a compiled piece regionally) and an
# attention layer, as EXACT_HYBRID, at tiny widths
DRY_HYBRID = _hybrid(32, 64, 4, 4, 2, 8, 2, 4, 8, 1024)
# a row of parts is flagged when its worst error passes this many times its whole trees' (and
# 1e-5): the bug this script found was 400x
FLAG = 10.0


def _one_rank_group(dev) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1)


@contextlib.contextmanager
def _holding(on: bool):
    """``treefx.parts.plan`` without recompute parts (what the budget cannot hold is held), as
    ``treefx.backward`` plans under FSDP2: a plan difference to tell from FSDP2 itself."""
    if not on:
        yield
        return
    from treefx import parts

    plan = parts.plan
    with mock.patch.object(parts, "plan",
                           lambda *a, **k: plan(*a, **{**k, "recompute": False})):
        yield


@contextlib.contextmanager
def _diagnostic(variant: str):
    """Regional execution changed for a diagnosis: ``noshare``, no compiled piece shared
    between layers; ``contig``, every block input that is a view at an offset copied into
    storage of its own first."""
    from treefx.run import regional

    with contextlib.ExitStack() as stack:
        if "noshare" in variant:
            key, count = regional._structure_key, iter(range(1 << 30))
            stack.enter_context(mock.patch.object(
                regional, "_structure_key", lambda gm, f: (key(gm, f), next(count))))
        if "contig" in variant:
            call = regional._call_block

            def own(x):
                if isinstance(x, torch.Tensor) and (x.storage_offset() or
                                                    not x.is_contiguous()):
                    return x.clone(memory_format=torch.contiguous_format)
                return x

            stack.enter_context(mock.patch.object(
                regional, "_call_block",
                lambda model, block, piece, ins: call(model, block, piece,
                                                      [own(x) for x in ins])))
        yield


def _errors(grads: dict, ref: dict) -> dict:
    """Per parameter group (layer index replaced by *): the worst scaled error."""
    scale = SCALE_FLOOR * max(float(r.abs().max()) for r in ref.values())
    groups: dict[str, float] = {}
    for n, r in ref.items():
        g = torch.zeros_like(r) if grads.get(n) is None else grads[n]
        key = re.sub(r"\.\d+\.", ".*.", n).replace("model.", "")
        groups[key] = max(groups.get(key, 0.0), _rel(g, r, scale))
    return groups


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.gdn_parts_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--backends", default=None,
                   help="default: inductor,eager (CPU: eager; aot-eager and flex-eager run there)")
    p.add_argument("--budgets", default=None, help="default 256 (dry run 16)")
    p.add_argument("--floor", action="store_true", help="also the oracle's own floor")
    common.add_run_args(p, "CPU: the tiny hybrid, two odd forests, eager")
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = DRY_HYBRID if args.dry_run else EXACT_HYBRID
    vocab = config["vocab_size"]
    trees = odd_forest(3, vocab) + odd_forest(5, vocab)
    if not args.dry_run:
        trees += check_forest(vocab)
    backends = (args.backends or ("inductor,eager" if dev.type == "cuda" else "eager")).split(",")
    budgets = [int(b) for b in (args.budgets or ("16" if args.dry_run else "256")).split(",")]
    common.resolve_out(args, "gdn_parts_check", dev.type == "cuda")
    t0 = time.perf_counter()

    def say(msg):
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)

    oracle = _build("qwen3_next", config, dev, False)
    treefx.reference.sequence_loss(oracle, trees, reduction="mean").backward()
    ref = {n: q.grad for n, q in oracle.named_parameters()}
    res = {**common.run_meta(dev.type == "cuda"), "config": config, "budgets": budgets,
           "tokens": sum(t.num_tokens for t in trees), "rows": {}}
    if args.floor:
        floor = treefx.verification.oracle_floor_gradients(oracle, trees, reduction="mean")
        res["rows"]["oracle floor"] = _errors(floor, ref)
    say(f"oracle ({res['tokens']} tokens)")
    for variant in args.variants.split(","):
        ckpt, fsdp = "ckpt" in variant, "fsdp" in variant
        regional = ckpt or fsdp or "regional" in variant
        hold = "hold" in variant  # plans without recompute parts, as under FSDP2
        for backend in backends:
            name = f"{variant} {backend}"
            try:
                model = _build("qwen3_next", config, dev, ckpt)
                if fsdp:
                    _one_rank_group(dev)
                    _shard(model)
                with _diagnostic(variant):
                    tm = treefx.compile(model, backend=backend, verify=False,
                                        regional=regional)
                b = treefx.pack(trees, reduction="mean").to(dev)
                treefx.tree_loss(tm(b), b).backward()
                res["rows"][f"{name} whole"] = _errors(_grads(model), ref)
                for budget in budgets:
                    with _holding(hold), _diagnostic(variant):
                        treefx.backward(tm, b, max_tokens=budget)
                    res["rows"][f"{name} parts {budget}"] = _errors(_grads(model), ref)
                say(f"{name}: done")
            except Exception:
                res["rows"][f"{name} error"] = traceback.format_exc()
                say(f"{name}: FAILED\n{traceback.format_exc()}")
            common.save_json(res, args.out)
    rows = {k: v for k, v in res["rows"].items() if isinstance(v, dict)}
    keys = sorted({k for v in rows.values() for k in v})
    width = max(map(len, keys)) + 1
    print("worst scaled gradient error per group (rows: variant, backend, whole/parts)")
    for row, v in rows.items():
        worst = max(v, key=v.get)
        print(f"{row:34s} worst {v[worst]:.2e} at {worst}")
    print("group".ljust(width) + "".join(r[:18].rjust(19) for r in rows))
    for k in keys:
        print(k.ljust(width) + "".join(f"{rows[r].get(k, float('nan')):19.2e}" for r in rows))
    flagged = [r for r in rows if " parts " in r and max(rows[r].values()) > max(
        1e-5, FLAG * max(rows.get(r.split(" parts ")[0] + " whole", {"": 0.0}).values()))]
    errors = [k for k, v in res["rows"].items() if isinstance(v, str)]
    for r in flagged:
        print(f"FLAGGED: {r} is more than {FLAG:g}x its whole trees' error")
    print(f"written to {args.out}", flush=True)
    return 1 if flagged or errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
