"""The tree conv1d's two forms on one device: the gather over every token
(``treefx.ops.conv.tree_causal_conv1d``, compiled by Inductor as the traced graphs used to run
it) against the row's conv fixed at node boundaries (``tree_causal_conv1d_fast``, the opaque op
they run now): forward + backward time, and both against a float64 run of the reference.

    python -m benchmarks.conv_check [--channels 8192] [--por 0.75] [--out RESULT.json]

The default shape is Qwen3-Next's conv (16 key heads and 32 value heads of 128 channels:
2 x 2,048 + 4,096 = 8,192 channels, width 4) on the e2e benchmark's POR 0.75 tree.
"""

from __future__ import annotations

import argparse
import json

import torch

import treefx
from treefx.ops.conv import boundary_taps, tree_causal_conv1d, tree_causal_conv1d_fast

from .common import make_tree
from .timing import median_ms


def _step(fn, x, w, b, parent, probe):
    out = fn(x, w, b, parent)
    return torch.autograd.grad((out.float() * probe).sum(), (x, w, b))


def _time(fn, args, reps: int) -> float:
    """Median milliseconds of ``reps`` calls after two warm-ups (:mod:`benchmarks.timing`)."""
    return median_ms(lambda: fn(*args), reps, True, warmup=2)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--channels", type=int, default=8192)
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--por", type=float, default=0.75)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda", help="cpu: a dry run (errors, no timing)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dev = args.device
    batch = treefx.pack(make_tree(args.por, 1.0, 32000)).to(dev)
    n, c, k = batch.num_tokens, args.channels, args.width
    parent = batch.parent_token
    g = torch.Generator(device=dev).manual_seed(0)
    # [B, C, N] as a transposed view of [B, N, C], as the model's projection hands it over
    x64 = torch.randn(1, n, c, dtype=torch.float64, device=dev, generator=g).transpose(1, 2)
    w64 = torch.randn(c, 1, k, dtype=torch.float64, device=dev, generator=g) / k
    b64 = torch.randn(c, dtype=torch.float64, device=dev, generator=g)
    probe = torch.randn(1, c, n, dtype=torch.float32, device=dev, generator=g)
    pos, _ = boundary_taps(parent.cpu().numpy(), k)
    res = {"tokens": n, "channels": c, "width": k, "boundary_tokens": int(len(pos)),
           "device": torch.cuda.get_device_name() if dev == "cuda" else dev}

    def leaf(t, dtype):
        return t.detach().to(dtype).requires_grad_()

    ref64 = _step(tree_causal_conv1d, *(leaf(t, torch.float64) for t in (x64, w64, b64)),
                  parent, probe.double())
    compiled = torch.compile(tree_causal_conv1d, dynamic=True)
    fast = torch.compile(tree_causal_conv1d_fast, dynamic=True)
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        ins = [leaf(t, dtype) for t in (x64, w64, b64)]
        for form, fn in (("gather_inductor", compiled), ("boundary_inductor", fast),
                         ("boundary_eager", tree_causal_conv1d_fast)):
            got = _step(fn, *ins, parent, probe)
            err = max(float((a.double() - r).abs().max() / r.abs().max())
                      for a, r in zip(got, ref64))
            ms = _time(_step, (fn, *ins, parent, probe), args.reps) if dev == "cuda" else 0.0
            res[f"{form}_{name}"] = {"fwd_bwd_ms": ms, "max_rel_err_vs_float64": err}
            print(f"{form:18} {name:9} fwd+bwd {ms:7.3f} ms  max error vs float64 {err:.2e}",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
