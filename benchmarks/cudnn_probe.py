"""What torch's cuDNN attention ops take and return on this machine (a probe for
:mod:`treefx.ops.attention.trunk`): the forward's outputs, and which spellings of the backward
call run and agree with autograd through SDPA's cuDNN backend. Each backward variant runs in
its own process (a wrong call can crash the process).

    python -m benchmarks.cudnn_probe
"""

from __future__ import annotations

import faulthandler
import subprocess
import sys

import torch
import torch.nn.functional as F

faulthandler.enable()


def inputs(hq=8, hk=8, n=640, d=128):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, hq, n, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(1, hk, n, d, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(1, hk, n, d, device="cuda", generator=g, dtype=torch.bfloat16)
    go = torch.randn(1, hq, n, d, device="cuda", generator=g, dtype=torch.bfloat16)
    return q, k, v, go


def show():
    q, k, v, go = inputs()
    outs = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True,
                                                              False, scale=None)
    for i, o in enumerate(outs):
        if isinstance(o, torch.Tensor):
            print(i, tuple(o.shape), o.dtype, o.device, o.stride(), flush=True)
        else:
            print(i, type(o).__name__, o, flush=True)
    print(torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default._schema)
    for hk in (8, 2):
        try:
            q, k, v, _ = inputs(hk=hk)
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0,
                                                                     True, False)[0]
            ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(8 // hk, 1),
                                                 v.float().repeat_interleave(8 // hk, 1),
                                                 is_causal=True)
            err = float((out.float() - ref).norm() / ref.norm())
            print(f"forward kv heads {hk}: rel err {err:.2e}")
        except Exception as e:
            print(f"forward kv heads {hk}: {type(e).__name__}: {str(e)[:200]}")


def variant(name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, go = inputs()
    xs = [x.detach().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o = F.scaled_dot_product_attention(*xs, is_causal=True)
    want = torch.autograd.grad(o, xs, go)
    out, lse, csq, csk, mq, mk, seed, off, _ = \
        torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)
    empty = q.new_empty(0)
    n = q.shape[2]
    args = {
        "forward_outputs": (seed, off, None, csq, csk, mq, mk),
        "forward_philox_none_rest": (seed, off, None, None, None, n, n),
        "empty_philox": (empty, empty, None, None, None, n, n),
    }[name]
    got = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        go, q, k, v, out, lse, args[0], args[1], args[2], args[3], args[4], args[5], args[6],
        0.0, True, scale=None)
    errs = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, want)]
    print(f"{name}: rel err vs autograd {errs}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        variant(sys.argv[1])
    else:
        show()
        for name in ("forward_outputs", "forward_philox_none_rest", "empty_philox"):
            r = subprocess.run([sys.executable, "-m", "benchmarks.cudnn_probe", name],
                               capture_output=True, text=True, timeout=120)
            print(f"--- {name}: rc {r.returncode}\n{r.stdout[-1500:]}{r.stderr[-1500:]}",
                  flush=True)
