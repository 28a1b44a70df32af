"""Trees larger than the token budget: ``treefx.backward`` (redundancy-free parts) against the
whole tree in one step, ``treefx.partition`` and one step per sequence (BENCHMARKS.md, "Trees
larger than memory").

    python -m benchmarks.parts                       # GPU: 8B-shaped layers, bf16
    python -m benchmarks.parts --dry-run             # CPU: a tiny model, eager backend
    python -m benchmarks.parts --checkpointing --budget 16384   # every layer checkpointed

Qwen3 with 8B-shaped layers (``--layers``), bf16, ``treefx.compile(model, logits=False)``; a
synthetic agent tree of at least 4× ``--budget`` tokens. Per method: the median step over
``--reps`` after a warm-up, peak memory, tokens, loss and gradients against the whole step.
First, exactness in float32 against the per-sequence oracle (``--exactness-models``).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

import treefx
from benchmarks import common

SHAPE_8B = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936,
                tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=1024, tie_word_embeddings=False)


def _sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def _timed(dev, fn, reps: int, model, accumulate: bool = False):
    """Median time of ``reps`` steps after one warm-up (compiles); each step starts without
    gradients (so each allocates its own, like a training step after optimizer.zero_grad), or
    with ``accumulate`` from zero gradients already allocated (a micro-batch of gradient
    accumulation): ``peak_gib`` is the peak allocated during a step, weights, gradients and
    all, and ``step_gib`` that minus what was allocated before it."""
    fn()  # warm-up: compiles
    times, peaks, base = [], [], 0
    for _ in range(reps):
        model.zero_grad(set_to_none=not accumulate)
        _sync(dev)
        if dev == "cuda":
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
        if dev == "cuda":
            peaks.append(torch.cuda.max_memory_allocated())
    peak = max(peaks) / 2**30 if peaks else None
    return out, {"step_s": statistics.median(times), "times_s": times, "peak_gib": peak,
                 "step_gib": (max(peaks) - base) / 2**30 if peaks else None}


def _grads(model, device=None):
    out = {n: p.grad.detach().float().to(device or p.grad.device, copy=True)
           for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _grad_diff(a, b) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-30))
               for k in b)


def _ckpt(on: bool) -> dict:
    # Hugging Face checkpoints only in training mode (these configs have no dropout)
    return {"checkpointing": "nonreentrant", "train": True} if on else {}


def _labels_step(model, batch):
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 labels=batch["labels"]).loss


def exactness(dev: str, backend: str, checkpointing: bool = False,
              models=("qwen3", "mistral", "qwen3_next", "gemma2", "gpt_oss"),
              step: bool = False) -> list[dict]:
    """float32: treefx.backward against the oracle, tiny Qwen3, Mistral (a window of 24),
    Qwen3-Next (conv and Gated DeltaNet state across parts), Gemma 2 (a softcap of 0.5 and a
    window) and gpt-oss (sinks, alternating windows). ``step``: through a ``@treefx.step``
    function (Hugging Face's loss with ``labels=``) instead of the compiled model."""
    rows = []
    trees = treefx.synth.odd_forest(0, 1024) + [treefx.synth.agent_tree(
        1, vocab_size=1024, rollouts=2, **common.scaled_lengths(0.2))]
    hybrid = dict(num_hidden_layers=4, num_experts=0, mlp_only_layers=[0, 1, 2, 3],
                  linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_conv_kernel_dim=4,
                  layer_types=["linear_attention", "full_attention"] * 2)
    scored = dict(num_hidden_layers=2, sliding_window=24, attn="eager")
    cases = {"qwen3": {"num_hidden_layers": 2},
             "mistral": {"num_hidden_layers": 2, "sliding_window": 24},
             "qwen3_next": hybrid,
             # scores the model transforms itself: a softcap and a window; sinks and
             # alternating windows
             "gemma2": dict(scored, attn_logit_softcapping=0.5, final_logit_softcapping=None),
             "gpt_oss": dict(scored, num_local_experts=4, num_experts_per_tok=2)}
    for model_type in models:
        model = common.hf_model(model_type, dev=dev, **_ckpt(checkpointing), **TINY,
                                **cases[model_type])
        if dev == "cuda" and getattr(model.config, "_experts_implementation", None) not in (
                None, "eager"):
            # as in gpu_check: float32 experts on the GPU go through transformers'
            # grouped-matmul fallback, whose backward AOTAutograd cannot trace (a Python
            # branch on the group sizes, GuardOnDataDependentSymNode), whole trees or parts
            model.set_experts_implementation("batched_mm")
        ref = treefx.reference.sequence_loss(model, trees, reduction="mean")
        ref.backward()
        g_ref = _grads(model)
        if step:
            fn = treefx.step(_labels_step, backend=backend)
            run = functools.partial(treefx.backward, fn, model=model)
        else:
            tm = treefx.compile(model, backend=backend, verify=False, logits=False)
            run = functools.partial(treefx.backward, tm)
        n = treefx.pack(trees).num_tokens
        for budget in (64, 300, n):
            loss = run(trees, max_tokens=budget)
            rows.append({"model": model_type, "step": step, "budget": budget, "tokens": n,
                         "loss_err": abs(float(loss) - float(ref.detach())),
                         "grad_rel_err": _grad_diff(_grads(model), g_ref)})
            print(f"exactness {model_type:10s}{' step' if step else ''} budget {budget:5d}: "
                  f"loss err "
                  f"{rows[-1]['loss_err']:.2e}, grad rel err {rows[-1]['grad_rel_err']:.2e}",
                  flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=int, default=8192, help="max_tokens per part")
    p.add_argument("--scale", type=float, default=2.0, help="agent tree length multiplier")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--methods",
                   default="whole,parts,budget_step,budget_step_acc,partition,sequences")
    p.add_argument("--no-exactness", action="store_true")
    p.add_argument("--exactness-models", default="qwen3,mistral,qwen3_next,gemma2,gpt_oss")
    p.add_argument("--step", action="store_true",
                   help="the exactness check through a @treefx.step function (HF labels=)")
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing on every layer (non-reentrant)")
    common.add_run_args(p, "CPU, a tiny model, the eager backend")
    args = p.parse_args(argv)
    cuda = common.use_cuda(args.dry_run)
    dev = "cuda" if cuda else "cpu"
    backend = "inductor" if cuda else "eager"
    common.bump_dynamo_limits()
    res = {"meta": common.run_meta(cuda), "args": vars(args)}
    if not args.no_exactness:
        res["exactness"] = exactness(dev, backend, args.checkpointing,
                                     args.exactness_models.split(","), args.step)
    if not [m for m in args.methods.split(",") if m]:  # the exactness check only
        common.save_json(res, common.resolve_out(args, "parts", cuda))
        return
    shape, dtype = (SHAPE_8B, torch.bfloat16) if cuda else (TINY, torch.float32)
    budget = args.budget if cuda else 320
    scale = args.scale if cuda else 0.08
    vocab = shape["vocab_size"]
    tree = common.make_tree(0.75, scale, vocab, seed=3)
    res["tree"] = {"tokens": tree.num_tokens, "sequences": tree.num_sequences,
                   "sequence_tokens": tree.num_baseline_tokens,
                   "longest_sequence": int(tree.sequence_lengths.max()), "budget": budget}
    print(f"tree: {tree.num_tokens} tokens ({tree.num_tokens / budget:.1f}x the budget "
          f"{budget}), {tree.num_sequences} sequences, {tree.num_baseline_tokens} sequence "
          f"tokens, longest {int(tree.sequence_lengths.max())}", flush=True)
    model = common.hf_model("qwen3", dev=dev, dtype=dtype, on_device=cuda,
                            num_hidden_layers=args.layers, **_ckpt(args.checkpointing), **shape)
    tm = treefx.compile(model, backend=backend, verify=False, logits=False)
    batch = treefx.pack(tree, reduction="mean").to(dev)
    plan = treefx.parts.plan(treefx.pack(tree, reduction="mean"), budget)
    res["plan"] = {"parts": plan.num_parts, "sizes": [q.num_tokens for q in plan.parts],
                   "peak_held_tokens": plan.peak_held_tokens()}
    print(f"plan: {plan.num_parts} parts, peak held {plan.peak_held_tokens()} tokens",
          flush=True)
    methods = args.methods.split(",")
    out, grads = {}, {}

    def whole():
        o = tm(batch)
        loss = treefx.tree_loss(o, batch)
        loss.backward()
        return loss.detach()

    def in_parts():
        return treefx.backward(tm, tree, max_tokens=budget)

    groups = treefx.partition_ids(tree, max(budget, int(tree.sequence_lengths.max())))
    part_trees = [tree.subtree(g) for g in groups]
    part_batches = [treefx.pack(t, reduction="mean", num_sequences=tree.num_sequences).to(dev)
                    for t in part_trees]
    largest = max(range(len(part_batches)), key=lambda i: part_batches[i].num_tokens)

    def run_batches(batches):
        total = 0.0
        for b in batches:
            loss = treefx.tree_loss(tm(b), b)
            loss.backward()
            total += float(loss.detach())
        return total

    def budget_step():
        return run_batches([part_batches[largest]])

    seq_trees = [treefx.Tree.from_sequences([tree.sequence(i)])
                 for i in range(tree.num_sequences)]
    seq_batches = [treefx.pack(t, reduction="mean", num_sequences=tree.num_sequences).to(dev)
                   for t in seq_trees]
    fns = {"whole": whole, "parts": in_parts, "budget_step": budget_step,
           "budget_step_acc": budget_step,
           "partition": lambda: run_batches(part_batches),
           "sequences": lambda: run_batches(seq_batches)}
    tokens = {"whole": tree.num_tokens, "parts": tree.num_tokens,
              "budget_step": part_batches[largest].num_tokens,
              "budget_step_acc": part_batches[largest].num_tokens,
              "partition": sum(b.num_tokens for b in part_batches),
              "sequences": tree.num_baseline_tokens}
    for name in methods:
        model.zero_grad(set_to_none=True)
        try:
            loss, stats = _timed(dev, fns[name], args.reps, model,
                                 accumulate=name.endswith("_acc"))
        except torch.OutOfMemoryError as e:
            out[name] = {"error": f"out of memory: {str(e)[:200]}"}
            print(f"{name}: out of memory", flush=True)
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            continue
        g = _grads(model, "cpu")  # the last step's
        if name == "whole":
            grads["whole"] = g
        elif "whole" in grads and not name.startswith("budget_step"):
            stats["grad_rel_diff_vs_whole"] = _grad_diff(g, grads["whole"])
        del g
        if dev == "cuda":
            torch.cuda.empty_cache()
        stats.update(loss=float(loss), tokens=tokens[name])
        out[name] = stats
        peak = f"{stats['peak_gib']:.1f} GiB" if stats["peak_gib"] is not None else "-"
        print(f"{name:12s} {stats['step_s'] * 1e3:9.1f} ms  peak {peak:>9s}  step "
              f"{stats['step_gib'] or 0:.1f} GiB  tokens "
              f"{tokens[name]:7d}  loss {stats['loss']:.5f}", flush=True)
    for name, st in out.items():
        if "grad_rel_diff_vs_whole" in st:
            print(f"{name}: gradients vs whole step (bf16), largest relative difference "
                  f"{st['grad_rel_diff_vs_whole']:.2e}", flush=True)
    res["methods"] = out
    if "parts" in out and "whole" in out and "step_s" in out.get("whole", {}):
        res["parts_vs_whole_time"] = out["parts"]["step_s"] / out["whole"]["step_s"]
    if "parts" in out and "budget_step" in out and cuda:
        res["parts_vs_budget_step_memory"] = out["parts"]["peak_gib"] / \
            out["budget_step"]["peak_gib"]
        res["parts_vs_budget_step_step_memory"] = out["parts"]["step_gib"] / \
            out["budget_step"]["step_gib"]
    if "parts" in out and "budget_step_acc" in out and cuda:
        res["parts_vs_budget_step_acc_memory"] = out["parts"]["peak_gib"] / \
            out["budget_step_acc"]["peak_gib"]
    print({k: v for k, v in res.items() if k.startswith("parts_vs")}, flush=True)
    common.save_json(res, common.resolve_out(args, "parts", cuda))


if __name__ == "__main__":
    main()
