"""Where a bf16 tree run turns non-finite: the oracle, the eager rewrite or the inductor one.

    python -m benchmarks.nan_probe --model nemotron_h

Builds the zoo's tiny model in bf16 on the GPU and runs treefx.verify's default probe forest
through the per-sequence oracle, treefx's eager backend and its inductor backend (verify off),
printing whether each one's log-probs are finite and, for the tree runs, the first non-finite
DFS token.

    python -m benchmarks.nan_probe --model gemma4_unified --grads --dtype float32

``--grads``: the first-call check's gradient comparison instead (``verify_compiled`` on the
probe forest, the row unpadded and padded with inert tokens to ``--pad-to`` as a first call
pads it to its batch's length), through the eager and the inductor backends: each run's
log-prob error, worst parameter, and every parameter whose tree gradient is not finite.

    python -m benchmarks.nan_probe --model gemma4_unified --plain --dtype float32

``--grads --regional``: the inductor backend, the row unpadded, with the whole graph compiled
(``regional=False``) and layer by layer (``regional=True``; ``--only-regional``: that one
alone); ``--no-interleave`` with either: ``interleave_heads=False``. ``--inductor KEY=VALUE``
sets an Inductor option first (``split_reductions=False``, ``nan_asserts=True``: the first
kernel whose output holds a NaN/inf raises, naming its buffer).

``--plain``: no treefx at all: the model on each of the probe forest's sequences through
``torch.compile`` (Inductor; dynamic shapes, then static), its mean loss's gradients, every
parameter whose gradient is not finite, against the model run eagerly. Tells an Inductor
issue from treefx's rewrite.
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
    p.add_argument("--grads", action="store_true")
    p.add_argument("--plain", action="store_true")
    p.add_argument("--no-interleave", action="store_true",
                   help="--grads: interleave_heads=False (the KV heads not laid out along the "
                        "row)")
    p.add_argument("--regional", action="store_true",
                   help="--grads: the inductor backend unpadded, regional=False then True")
    p.add_argument("--only-regional", action="store_true",
                   help="--grads --regional: regional=True alone")
    p.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                   help="set torch._inductor.config KEY (dotted) to the Python literal VALUE "
                        "before compiling, e.g. split_reductions=False or nan_asserts=True "
                        "(repeatable)")
    p.add_argument("--pad-to", type=int, default=1151,
                   help="--grads: the padded row's length (gpu_check's families forest: 1151)")
    args = p.parse_args(argv)
    _set_inductor(args.inductor)
    if args.grads:
        return _grads(args)
    if args.plain:
        return _plain(args)
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


def _set_inductor(settings) -> None:
    """``KEY=VALUE`` pairs into ``torch._inductor.config`` (a dotted key reaches a section)."""
    import ast

    import torch._inductor.config as cfg
    for item in settings:
        key, _, value = item.partition("=")
        *path, leaf = key.split(".")
        obj = cfg
        for part in path:
            obj = getattr(obj, part)
        if not hasattr(obj, leaf):
            raise SystemExit(f"--inductor {item}: torch._inductor.config has no {key}")
        setattr(obj, leaf, ast.literal_eval(value))
        print(f"inductor config {key} = {getattr(obj, leaf)!r}", flush=True)


def _plain(args) -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    model = zoo.build_model(args.model).to(dev, getattr(torch, args.dtype))
    trees = verification.probe_forest(verification.probe_vocab_size(model), min_tokens=257)
    seqs = [s for t in trees for s in t.sequences]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    variants = [("eager", None)] + ([("inductor dynamic", True), ("inductor static", False)]
                                    if dev == "cuda" else [])
    for name, dynamic in variants:
        torch._dynamo.reset()
        run = model if dynamic is None else torch.compile(model, dynamic=dynamic)
        model.zero_grad(set_to_none=True)
        try:
            for s in seqs[:4]:  # the first few sequences: a handful of lengths
                ids = torch.tensor([s], device=dev)
                logits = run(input_ids=ids).logits
                loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
                loss.backward()
            bad = [n for n, p in named if p.grad is not None and not torch.isfinite(p.grad).all()]
            print(f"{name}: {len(seqs[:4])} sequences of {[len(s) for s in seqs[:4]]} tokens; "
                  f"non-finite gradients: {bad or 'none'}", flush=True)
        except Exception as e:
            print(f"{name}: {type(e).__name__}: {str(e)[:600]}", flush=True)


def _grads(args) -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    model = zoo.build_model(args.model).to(dev, getattr(torch, args.dtype))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    variants = [(b, pad, None) for b in (("eager", "inductor") if dev == "cuda" else ("eager",))
                for pad in (None, args.pad_to)]
    if args.regional:  # the inductor backend, unpadded, whole graph against regional
        variants = [("inductor" if dev == "cuda" else "aot-eager", None, r)
                    for r in ((True,) if args.only_regional else (False, True))]
    for backend, pad, regional in variants:
        if True:
            torch._dynamo.reset()
            tm = treefx.compile(model, backend=backend, verify=False, regional=regional,
                                interleave_heads=False if args.no_interleave else None)
            grads = {}

            def tree_run(batch, params, tm=tm):
                out = tm(batch)
                loss = treefx.tree_loss(out, batch)
                g = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
                grads.update((n, x) for (n, _), x in zip(params, g))
                return out.token_logprobs, list(g)

            try:
                rep = verification.verify_compiled(tm, grads=True, pad_to=pad, params="all",
                                                   raise_on_failure=False, tree_run=tree_run)
                bad = [n for n, _ in named
                       if grads.get(n) is not None and not torch.isfinite(grads[n]).all()]
                print(f"{backend} pad_to={pad} regional={regional}: {rep}"
                      f"\n  non-finite tree gradients: {bad or 'none'}", flush=True)
            except Exception as e:  # a failure of one variant does not stop the others
                print(f"{backend} pad_to={pad} regional={regional}: {type(e).__name__}: "
                      f"{str(e)[:600]}", flush=True)


if __name__ == "__main__":
    main()
