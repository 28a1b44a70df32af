"""The trunk split (:mod:`treefx.ops.attention.trunk`), or with ``--intervals`` the interval op,
across the zoo's model families on the CPU, each against every sequence run alone
(``treefx.verify``; docs/performance.md has the results)."""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

SAMPLE = ("qwen3,llama,mistral,gemma,gemma2,phi3,qwen2,granite,olmo2,cohere,starcoder2,gpt2,"
          "gpt_neox,falcon,stablelm,phi,glm,mixtral,qwen3_moe,olmoe,deepseek_v3,"
          "smollm3,exaone4,hunyuan_v1_dense,arcee,seed_oss,ministral")


def comb(vocab: int, exclude) -> list:
    """A trunk of 70 tokens with leaves off it (the layout puts the trunk first)."""
    import treefx

    tokens = np.array([t for t in range(vocab) if t not in set(exclude)])
    rng = np.random.default_rng(0)
    t = rng.choice(tokens, 70).tolist()
    leaf = rng.choice(tokens, 10).tolist()
    return [treefx.Tree.from_sequences([t[:40] + leaf[:9], t[:60] + leaf[9:], t, t[:20]])]


def run(model_type: str, checkpointing: bool = False) -> dict:
    import torch

    import treefx
    from treefx.tools import zoo

    t0 = time.perf_counter()
    try:
        model = zoo.build_model(model_type, torch.float32, checkpointing=checkpointing)
    except Exception as e:  # noqa: BLE001  (a config the zoo cannot build here)
        return {"model": model_type, "status": "config failed", "error": str(e)[:200]}
    exclude = zoo.special_token_ids(model.config)
    try:
        tm = treefx.compile(model, backend="flex-eager", block_size=16, verify=False)
        reps = [treefx.verify(tm, trees, raise_on_failure=False)
                for trees in (zoo.probe_forest(zoo.VOCAB, exclude), comb(zoo.VOCAB, exclude))]
    except Exception as e:  # noqa: BLE001  (refused: an error, not a wrong result)
        return {"model": model_type, "status": "refused", "error": str(e)[:300]}
    notes = [r.note for c in tm.contexts for r in c.log if r.pass_name == "attention"]
    return {"model": model_type, "status": "exact" if all(r.passed for r in reps) else "WRONG",
            "split_sites": sum("dense causal kernel" in n for n in notes),
            "interval_sites": sum("interval-mask" in n for n in notes),
            "sites": len(notes), "logprob_err": max(r.max_logprob_error for r in reps),
            "grad_err": max(r.max_grad_error for r in reps),
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.trunk_zoo",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=SAMPLE)
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing on every layer (train mode, dropout 0)")
    p.add_argument("--intervals", action="store_true",
                   help="the sites on cuDNN's interval-mask op (plain torch here) instead")
    p.add_argument("--out", default=None, help="JSON results")
    args = p.parse_args(argv)
    os.environ["TREEFX_TRUNK_ATTENTION"] = "1"
    if args.intervals:
        os.environ["TREEFX_CUDNN_ATTENTION"] = "1"
    rows = []
    for m in args.models.split(","):
        r = run(m, args.checkpointing)
        rows.append(r)
        print(json.dumps(r), flush=True)
    summary = {s: sum(r["status"] == s for r in rows) for s in {r["status"] for r in rows}}
    print("summary:", summary, "split in", sum(r.get("split_sites", 0) > 0 for r in rows),
          "families; on intervals in", sum(r.get("interval_sites", 0) > 0 for r in rows))
    out = {"rows": rows, "summary": summary}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
