"""The fused per-token log-probability op (``treefx.ops.logprobs.fast``) at an 8B model's output
shape: its backward over vocabulary slices (each slice of the weight's gradient one matrix
product, written once) against the token-chunked backward it replaced (every chunk of ~900
tokens added a [vocab, hidden] float32 product into the weight's gradient).

    python -m benchmarks.logprobs                    # GPU: hidden 4096, vocab 151,936, bf16
    python -m benchmarks.logprobs --dry-run          # CPU: tiny shapes

Per token count: the median time of forward + backward over ``--reps`` (after a warm-up), the
peak memory above the inputs, and each backward's gradients against a float32 computation of
the same bf16 inputs (relative Frobenius error, so both are judged on the same scale).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks import common
from treefx.ops.cross_entropy import fast as ce
from treefx.ops.logprobs import fast as lp_ops


def _token_chunked_backward(grad, h, weight, ids, parent, lse):
    """The replaced backward (no bias): chunks of tokens over the whole vocabulary, the
    weight's gradient summed in float32 chunk by chunk."""
    acc = torch.float32
    g = torch.where(parent >= 0, grad.float(), torch.zeros_like(grad, dtype=acc))
    dh = torch.zeros(h.shape, dtype=acc, device=h.device)
    dw = torch.zeros(weight.shape, dtype=acc, device=h.device)
    tokens = torch.nonzero(g).reshape(-1)
    step = max(1, ce.CHUNK_ELEMENTS // weight.shape[0])
    for s in range(0, tokens.shape[0], step):
        t = tokens[s:s + step]
        rows = parent[t]
        hc = h[rows]
        logits = F.linear(hc, weight).float()
        gt = g[t]
        d = torch.exp(logits - lse[t, None]) * -gt[:, None]
        d.scatter_add_(1, ids[t, None], gt[:, None])
        dc = d.to(weight.dtype)
        dh.index_add_(0, rows, (dc @ weight).float())
        dw += (dc.t() @ hc).float()
    return dh.to(h.dtype), dw.to(weight.dtype)


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def run_case(n: int, hidden: int, vocab: int, dev: str, dtype, reps: int) -> dict:
    g = torch.Generator(device=dev).manual_seed(n)
    h = torch.randn(n, hidden, device=dev, dtype=dtype, generator=g)
    w = (torch.randn(vocab, hidden, device=dev, dtype=dtype, generator=g) / hidden ** 0.5)
    ids = torch.randint(0, vocab, (n,), device=dev, generator=g)
    parent = torch.arange(n, device=dev) - 1
    upstream = torch.randn(n, device=dev, generator=g)
    lp, lse = torch.ops.treefx.linear_tree_logprobs(h, w, None, ids, parent)

    def new():
        return lp_ops._backward(upstream, h, w, None, ids, parent, lse, True, True, False)[:2]

    def old():
        return _token_chunked_backward(upstream, h, w, ids, parent, lse)

    out = {"tokens": n}
    ref = _token_chunked_backward(upstream, h.float(), w.float(), ids, parent, lse)
    for name, fn in (("vocab_slices", new), ("token_chunks", old)):
        dh, dw = fn()
        out[f"{name}_dh_err"], out[f"{name}_dw_err"] = _rel(dh, ref[0]), _rel(dw, ref[1])
        del dh, dw
        times = []
        for _ in range(reps + 1):
            if dev == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            r = fn()
            if dev == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            del r
        out[f"{name}_ms"] = statistics.median(times[1:]) * 1e3
        if dev == "cuda":
            out[f"{name}_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        print(f"{n:6d} tokens {name:13s} {out[f'{name}_ms']:8.1f} ms  d/dh err "
              f"{out[f'{name}_dh_err']:.2e}  d/dW err {out[f'{name}_dw_err']:.2e}", flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="883,8192,35530")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--profile", type=int, default=0,
                   help="also print the top kernels of the new backward at this many tokens")
    common.add_run_args(p, "CPU, tiny shapes")
    args = p.parse_args(argv)
    cuda = common.use_cuda(args.dry_run)
    dev = "cuda" if cuda else "cpu"
    hidden, vocab = (4096, 151936) if cuda else (64, 1024)
    tokens = [int(x) for x in args.tokens.split(",")] if cuda else [50, 300]
    res = {"meta": common.run_meta(cuda), "args": vars(args), "hidden": hidden, "vocab": vocab,
           "cases": [run_case(n, hidden, vocab, dev, torch.bfloat16, args.reps)
                     for n in tokens]}
    if args.profile and cuda:
        res["profile"] = profile_backward(args.profile, hidden, vocab)
    common.save_json(res, common.resolve_out(args, "logprobs", cuda))


def profile_backward(n: int, hidden: int, vocab: int) -> list:
    from torch.profiler import ProfilerActivity, profile

    h = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5
    ids = torch.randint(0, vocab, (n,), device="cuda")
    parent = torch.arange(n, device="cuda") - 1
    up = torch.randn(n, device="cuda")
    _, lse = torch.ops.treefx.linear_tree_logprobs(h, w, None, ids, parent)
    for _ in range(2):
        lp_ops._backward(up, h, w, None, ids, parent, lse, True, True, False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        lp_ops._backward(up, h, w, None, ids, parent, lse, True, True, False)
        torch.cuda.synchronize()
    ev = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    top = [(e.key[:80], e.count, round(e.self_device_time_total / 1e3, 2))
           for e in sorted(ev, key=lambda e: -e.self_device_time_total)[:15]]
    for row in top:
        print("profile", n, row, flush=True)
    return top


if __name__ == "__main__":
    main()
