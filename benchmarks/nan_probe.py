"""Where a bf16 tree run turns non-finite: the oracle, the eager rewrite or the inductor one.

    python -m benchmarks.nan_probe --model nemotron_h

Builds the zoo's tiny model in bf16 on the GPU and runs treefx.verify's default probe forest
through the per-sequence oracle, treefx's eager backend and its inductor backend (verify off),
printing whether each one's log-probs are finite and, for the tree runs, the first non-finite
DFS token.
"""

from __future__ import annotations

import argparse

import torch

import treefx
from treefx import verification
from treefx.tools import zoo


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.nan_probe")
    p.add_argument("--model", default="nemotron_h")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = zoo.build_model(args.model).to(dev, getattr(torch, args.dtype))
    # The first-call check's forest: more than two 128-token blocks, every id of the vocabulary.
    trees = verification.probe_forest(model.config.vocab_size, min_tokens=257)
    lps = treefx.reference.sequence_logprobs(model, trees)
    print("oracle finite:", all(bool(torch.isfinite(lp).all()) for lp in lps), flush=True)
    for backend in ("eager", "inductor") if dev == "cuda" else ("eager",):
        torch._dynamo.reset()
        tm = treefx.compile(model, backend=backend, verify=False)
        with torch.no_grad():
            out = tm(treefx.pack(trees).to(dev))
        bad = (~torch.isfinite(out.token_logprobs)).nonzero()
        print(f"{backend}: finite={bad.numel() == 0}",
              f"first bad DFS token {bad[0].tolist()}" if bad.numel() else "", flush=True)


if __name__ == "__main__":
    main()
