"""Which calls of a ``treefx.backward`` step make the host wait for the GPU: one step under
``torch.cuda.set_sync_debug_mode("warn")``, each synchronizing call's stack printed once (the
same tiny-shape model as :mod:`benchmarks.parts`' exactness check, on the GPU).

    python -m benchmarks.parts_syncs
"""

from __future__ import annotations

import traceback
import warnings

import torch

import treefx
from benchmarks import common
from benchmarks.parts import TINY


def main():
    common.bump_dynamo_limits()
    model = common.hf_model("qwen3", dev="cuda", num_hidden_layers=2, **TINY)
    tm = treefx.compile(model, backend="inductor", verify=False, logits=False)
    tree = common.make_tree(0.75, 0.2, TINY["vocab_size"], seed=3)
    budget = max(64, tree.num_tokens // 4)
    for _ in range(2):
        treefx.backward(tm, tree, max_tokens=budget)
    torch.cuda.synchronize()
    seen = {}
    def show(message, category, filename, lineno, file=None, line=None):
        stack = "".join(traceback.format_stack(limit=16)[:-3])
        seen.setdefault(stack, [0, str(message)[:120]])[0] += 1

    with warnings.catch_warnings():  # restores warnings.showwarning on leaving
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            treefx.backward(tm, tree, max_tokens=budget)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    plan = treefx.parts.plan(treefx.pack(tree), budget)
    print(f"{plan.num_parts} parts; {sum(c for c, _ in seen.values())} synchronizing calls")
    for stack, (count, msg) in seen.items():
        print(f"--- {count}x {msg}\n{stack}")


if __name__ == "__main__":
    main()
