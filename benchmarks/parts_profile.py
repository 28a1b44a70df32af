"""Where a ``treefx.backward`` step spends its time beyond the whole-tree step: the same model
and tree as :mod:`benchmarks.parts`, one profiled step of each (CUDA kernels and host),
summarized.

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
    batch = treefx.pack(tree, reduction="mean").to("cuda")

    def whole():
        treefx.tree_loss(tm(batch), batch).backward()

    def parts():
        treefx.backward(tm, tree, max_tokens=args.budget)

    from torch.profiler import ProfilerActivity, profile

    res = {"meta": common.run_meta(True), "args": vars(args)}
    for name, step in (("parts", parts), ("whole", whole)):
        for _ in range(2):
            step()
            model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        host_done = time.perf_counter() - t0
        torch.cuda.synchronize()
        r = {"step_s": time.perf_counter() - t0, "host_returned_s": host_done}
        model.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        events = prof.key_averages()
        # kernels only (device time of CPU-side ops would count each kernel twice)
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        r["gpu_busy_s"] = sum(e.self_device_time_total for e in kernels) / 1e6
        top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:30]
        r["top_kernels"] = [(e.key[:90], e.count, round(e.self_device_time_total / 1e3, 2))
                            for e in top]
        cpu = sorted(events, key=lambda e: -e.cpu_time_total)[:25]
        r["top_host"] = [(e.key[:90], e.count, round(e.cpu_time_total / 1e3, 2)) for e in cpu]
        res[name] = r
    print(json.dumps(res, indent=1, default=str))
    common.save_json(res, args.out or common.default_out("parts_profile", True))


if __name__ == "__main__":
    main()
