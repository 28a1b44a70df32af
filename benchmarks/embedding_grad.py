"""The input embedding's weight gradient at an 8B model's shape: Inductor's decomposition (a
float32 [vocab, D] buffer zero-filled, an atomic scatter-add, a cast to the weight's dtype)
against ATen's own kernel, which :func:`treefx.ops.embedding.embedding` calls as it is.

    python -m benchmarks.embedding_grad          # GPU: vocab 151,936, width 4,096, bf16
    python -m benchmarks.embedding_grad --dry-run  # CPU: tiny shapes, float32

The ids are the e2e benchmark's POR-0.75 tree's (17,187 tokens, drawn from the vocabulary as
that benchmark draws them); the upstream gradient random. Per dtype: the median of ``--reps``
calls after warm-up (CUDA events), and the largest difference between the two results
relative to the largest entry (both sum each id's rows in float32 and round once on CUDA).
"""

from __future__ import annotations

import argparse

import torch

import treefx
from benchmarks import common
from benchmarks.timing import median_ms


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.embedding_grad",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=20)
    common.add_run_args(p, "CPU, tiny shapes, float32")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    dev = "cuda" if cuda else "cpu"
    vocab, width = (151936, 4096) if cuda else (1000, 64)
    tree = common.make_tree(0.75, 1.0 if cuda else 0.05, vocab, seed=0)
    ids = treefx.pack(tree).input_ids.to(dev)
    n = ids.numel()
    dtypes = (torch.bfloat16, torch.float32) if cuda else (torch.float32,)

    def aten(g):
        return torch.ops.aten.embedding_dense_backward(g, ids, vocab, -1, False)

    inductor = torch.compile(aten, dynamic=False)
    rows = {}
    for dtype in dtypes:
        g = torch.randn(1, n, width, device=dev, dtype=dtype)
        a, b = aten(g), inductor(g)
        scale = float(a.float().abs().max())
        diff = float((a.float() - b.float()).abs().max()) / scale
        row = {"aten_ms": median_ms(lambda: aten(g), args.reps, cuda, warmup=3),
               "inductor_ms": median_ms(lambda: inductor(g), args.reps, cuda, warmup=3),
               "max_diff_relative": diff}
        rows[str(dtype).removeprefix("torch.")] = row
        print(f"{dtype}: ATen {row['aten_ms']:.3f} ms, Inductor's decomposition "
              f"{row['inductor_ms']:.3f} ms, results differ by {diff:.1e} of the largest entry",
              flush=True)
        del g, a, b
    common.save_json({"meta": common.run_meta(cuda), "vocab": vocab, "width": width,
                      "tokens": n, "rows": rows},
                     common.resolve_out(args, "embedding_grad", cuda))


if __name__ == "__main__":
    main()
