"""Gated DeltaNet gradients in parts, one process: where does the error against the oracle
come from (issue 37's FSDP2 hybrid check found the parts path 380x further from the oracle
than the whole-tree path on two H200s)?

    python -m benchmarks.gdn_parts_check [--budgets 256,100000] [--backends auto,eager]

A float32 Qwen3-Next (``benchmarks.distributed_check.EXACT_HYBRID``; TF32 off) on the check
forest (odd trees and a 6k-token agent tree), one process, no FSDP: the per-sequence oracle and
its own floor (``oracle_floor_gradients``), then ``treefx.compile`` (regional with
``--checkpointing``) on the whole batch and
``treefx.backward`` at each budget, with each backend. Printed per Gated DeltaNet parameter
(``A_log``, ``dt_bias``, the conv and projections of the first linear-attention layer): max
|g - g_ref| / max |g_ref|, and the floor's. JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

import treefx

from .common import check_forest, odd_forest
from .distributed_check import EXACT_HYBRID
from .fsdp import _build


def _rel(a, r) -> float:
    return float((a.double() - r.double()).abs().max() / r.double().abs().max().clamp_min(1e-30))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.gdn_parts_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default="256,100000")
    p.add_argument("--backends", default="auto,eager")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vocab = EXACT_HYBRID["vocab_size"]
    trees = odd_forest(3, vocab) + odd_forest(5, vocab) + check_forest(vocab)
    t0 = time.perf_counter()
    model = _build("qwen3_next", EXACT_HYBRID, dev, args.checkpointing)
    oracle = copy.deepcopy(model)
    treefx.reference.sequence_loss(oracle, trees, reduction="mean").backward()
    floor = treefx.verification.oracle_floor_gradients(oracle, trees, reduction="mean")
    ref = {n: q.grad for n, q in oracle.named_parameters()}
    names = [n for n in ref if "linear_attn" in n and (
        "A_log" in n or "dt_bias" in n or ".layers.0." in n)]
    print(f"[{time.perf_counter() - t0:6.1f}s] oracle and floor", flush=True)
    rows = {"floor": {n: _rel(floor[n], ref[n]) for n in names}}
    for backend in args.backends.split(","):
        # a checkpointed HF model captures regionally (its whole-graph capture breaks on
        # requires_grad_)
        tm = treefx.compile(model, backend=backend, verify=False, regional=args.checkpointing)
        model.zero_grad(set_to_none=True)
        b = treefx.pack(trees, reduction="mean").to(dev)
        treefx.tree_loss(tm(b), b).backward()
        rows[f"{backend} whole"] = {n: _rel(q.grad, ref[n]) for n, q in model.named_parameters()
                                    if n in names}
        for budget in map(int, args.budgets.split(",")):
            model.zero_grad(set_to_none=True)
            treefx.backward(tm, b, max_tokens=budget)
            rows[f"{backend} parts {budget}"] = {
                n: _rel(q.grad, ref[n]) for n, q in model.named_parameters() if n in names}
        print(f"[{time.perf_counter() - t0:6.1f}s] {backend} done", flush=True)
    cols = list(rows)
    print("parameter".ljust(44) + "".join(c[:16].rjust(17) for c in cols))
    for n in names:
        print(n[:44].ljust(44) + "".join(f"{rows[c][n]:17.2e}" for c in cols))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(dev), "torch": torch.__version__, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
