"""Where a ``treefx.backward`` step spends its time beyond the whole-tree step: the same model
and tree as :mod:`benchmarks.parts`, one profiled step (CUDA kernels and host), summarized.

    python -m benchmarks.parts_profile [--budget 8192] [--scale 2.0] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import treefx
from benchmarks import common
from benchmarks.parts import SHAPE_8B


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--budget", type=int, default=8192)
    p.add_argument("--scale", type=float, default=2.0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    common.bump_dynamo_limits()
    tree = common.make_tree(0.75, args.scale, SHAPE_8B["vocab_size"], seed=3)
    model = common.hf_model("qwen3", dev="cuda", dtype=torch.bfloat16, on_device=True,
                            num_hidden_layers=args.layers, **SHAPE_8B)
    tm = treefx.compile(model, backend="inductor", verify=False, logits=False)
    for _ in range(2):
        treefx.backward(tm, tree, max_tokens=args.budget)
    torch.cuda.synchronize()
    res = {"meta": common.run_meta(True), "args": vars(args)}
    t0 = time.perf_counter()
    treefx.backward(tm, tree, max_tokens=args.budget)
    host_done = time.perf_counter() - t0
    torch.cuda.synchronize()
    res["step_s"] = time.perf_counter() - t0
    res["host_returned_s"] = host_done
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        treefx.backward(tm, tree, max_tokens=args.budget)
        torch.cuda.synchronize()
    events = prof.key_averages()
    cuda_total = sum(e.self_device_time_total for e in events) / 1e6
    res["gpu_busy_s"] = cuda_total
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:25]
    res["top_kernels"] = [(e.key[:90], e.count, round(e.self_device_time_total / 1e3, 2))
                          for e in top]
    cpu = sorted(events, key=lambda e: -e.cpu_time_total)[:25]
    res["top_host"] = [(e.key[:90], e.count, round(e.cpu_time_total / 1e3, 2)) for e in cpu]
    print(json.dumps(res, indent=1, default=str))
    common.save_json(res, args.out or common.default_out("parts_profile", True))


if __name__ == "__main__":
    main()
