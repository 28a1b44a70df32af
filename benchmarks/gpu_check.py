"""GPU exactness of the inductor backend against the per-branch oracle, and a first timing.

    PYTHONPATH=. python benchmarks/gpu_check.py --out results.json

Cases (each runs even if another fails; failures are recorded with their traceback):
- qwen3-fp32: HF Qwen3, float32, TF32 off, inductor (FlexAttention + Triton) vs the oracle;
- qwen3-bf16: the same weights in bf16 through treefx vs the float32 oracle, beside the error
  of the plain bf16 per-branch run vs the same oracle (the error bf16 training has anyway);
- mistral-window: sliding window 64, the lifted mask_mod on long sequences;
- recompiles: 20 trees of different sizes through one compiled model;
- timing: one training step on a POR ~0.75 agent tree, treefx vs one sequence at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import timed  # noqa: E402

import treefx  # noqa: E402
from treefx import synth  # noqa: E402

# A dry run of the script's logic works on the CPU (eager backend); the numbers that count are
# from CUDA with the inductor backend.
DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "inductor" if DEV == "cuda" else "eager"
COMPILE_KW = {"backend": BACKEND}  # every treefx.compile / treefx.step here (--interleave-heads)


def hf_model(model_type: str, dtype=torch.float32, seed=0, **cfg):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(DEV, dtype)


SMALL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, head_dim=32)


def small_trees(vocab):
    from trees import odd_forest

    forest = odd_forest(0, vocab)
    agent = synth.agent_tree(1, vocab_size=vocab, rollouts=3, system_len=(300, 600),
                             think_len=(50, 400), tool_len=(50, 500))
    return [forest[0], forest[1], agent]


def grads_of(model):
    g = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
         if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return g


def compare(tree_model, ref_model, trees, reduction):
    """Max abs log-prob error, loss rel. error, max rel. gradient error (tree vs oracle)."""
    batch = treefx.pack(trees, reduction=reduction).to(DEV)
    out = tree_model(batch)
    loss = treefx.tree_loss(out, batch)
    loss.backward()
    g_tree = grads_of(tree_model.model)
    ref_lp = treefx.reference.sequence_logprobs(ref_model, trees)
    ref_loss = treefx.reference.sequence_loss(ref_model, trees, reduction=reduction)
    ref_loss.backward()
    g_ref = grads_of(ref_model)
    lp_err = max(
        (out.token_logprobs[batch.sequence_index(i)[1:]].float() - lp.float()).abs().max().item()
        for i, lp in enumerate(ref_lp) if lp.numel()
    )
    grad_err = max(((g_tree[n] - g).norm() / g.norm().clamp_min(1e-30)).item()
                   for n, g in g_ref.items())
    return {
        "tokens": batch.num_tokens,
        "max_abs_logprob_err": lp_err,
        "loss_rel_err": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        "max_rel_grad_err": grad_err,
    }


def case_qwen3_fp32(res):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = hf_model("qwen3", **SMALL)
    tm = treefx.compile(model, **COMPILE_KW)
    trees = small_trees(SMALL["vocab_size"])
    for red in ("sum", "mean"):
        res[f"qwen3-fp32-{red}"] = compare(tm, model, trees, red)
    res["qwen3-fp32-compilations"] = tm.num_compilations


class PerBranch(torch.nn.Module):
    """The plain model run per sequence, shaped like a TreeModel for compare()."""

    def __init__(self, m):
        super().__init__()
        self.model = m

    def forward(self, batch):
        lps = treefx.reference.sequence_logprobs(self.model, batch.trees)
        tl = torch.zeros(batch.num_tokens, device=DEV)
        for i, lp in enumerate(lps):
            tl = tl.index_put((batch.sequence_index(i)[1:],), lp.float())
        return treefx.TreeOutput(None, tl)


def case_qwen3_bf16(res):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = hf_model("qwen3", **SMALL)
    low = hf_model("qwen3", torch.bfloat16, **SMALL)
    low.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()})
    trees = small_trees(SMALL["vocab_size"])
    tm = treefx.compile(low, **COMPILE_KW)
    res["qwen3-bf16-tree-vs-fp32-oracle"] = compare(tm, ref, trees, "mean")

    res["qwen3-bf16-perbranch-vs-fp32-oracle"] = compare(PerBranch(low), ref, trees, "mean")


def case_mistral_window(res):
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = dict(SMALL, sliding_window=64)
    model = hf_model("mistral", **cfg)
    tm = treefx.compile(model, **COMPILE_KW)
    res["mistral-window64-fp32"] = compare(tm, model, small_trees(cfg["vocab_size"]), "mean")


def case_recompiles(res):
    model = hf_model("qwen3", torch.bfloat16, **SMALL)
    tm = treefx.compile(model, **COMPILE_KW)
    sizes = []
    for seed in range(20):
        tree = synth.agent_tree(100 + seed, vocab_size=SMALL["vocab_size"],
                                rollouts=1 + seed % 4)
        batch = treefx.pack(tree).to(DEV)
        sizes.append(batch.num_tokens)
        treefx.tree_loss(tm(batch), batch).backward()
    res["recompiles"] = {"sizes": sizes, "compilations": tm.num_compilations}


def case_recompiles_wide(res):
    """Tree sizes from 71 to ~20k tokens on a hidden-1024 model, where Inductor's size
    heuristics have thresholds inside that range (mix-order reductions at 5,120 tokens):
    graphs compiled for a stream of training steps, then of forwards without autograd."""
    model = hf_model("qwen3", torch.bfloat16, **{**SMALL, "hidden_size": 1024,
                                                  "intermediate_size": 2048,
                                                  "num_hidden_layers": 2, "head_dim": 64,
                                                  "num_attention_heads": 16,
                                                  "num_key_value_heads": 8})
    few = [treefx.Tree.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6], [7]]),
           treefx.Tree.from_sequences([[9] * 40, [9] * 20 + [8] * 24])]
    streams = [few] + [[synth.agent_tree(200 + i, vocab_size=SMALL["vocab_size"],
                                         rollouts=1 + i % 4)] * (1 + i % 3) for i in range(11)]
    tm = treefx.compile(model, **COMPILE_KW)
    for mode in ("training", "no-grad"):
        sizes, counts = [], []
        for trees in streams:
            batch = treefx.pack(trees).to(DEV)
            sizes.append(batch.num_tokens)
            if mode == "training":
                treefx.tree_loss(tm(batch), batch).backward()
            else:
                with torch.no_grad():
                    tm(batch)
            counts.append(tm.num_compilations)
        res[f"recompiles-wide-{mode}"] = {"sizes": sizes, "compilations_after_each": counts}
        print(f"  {mode}: sizes {sizes} compilations {counts}", flush=True)


def _time(fn, reps=5):
    fn()
    if DEV != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    return statistics.median(timed(fn, True)[1] for _ in range(reps))


def case_timing(res):
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
               num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    model = hf_model("qwen3", torch.bfloat16, **cfg)
    tree = synth.agent_tree(7, vocab_size=32000, rollouts=4, target_por=0.75)
    tm = treefx.compile(model, **COMPILE_KW)

    def tree_step():
        batch = treefx.pack(tree, reduction="mean").to(DEV)  # layout and mask included
        treefx.tree_loss(tm(batch), batch).backward()
        model.zero_grad(set_to_none=True)

    def one_by_one():
        treefx.reference.sequence_loss(model, tree, reduction="mean").backward()
        model.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    tree_step()
    compile_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    t_tree = _time(tree_step)
    mem_tree = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    t_seq = _time(one_by_one)
    mem_seq = torch.cuda.max_memory_allocated() / 2**30
    res["timing"] = {
        "tree": repr(tree), "bound": tree.bound, "first_step_s": compile_s,
        "tree_ms": t_tree, "one_by_one_ms": t_seq, "speedup": t_seq / t_tree,
        "tree_peak_gib": mem_tree, "one_by_one_peak_gib": mem_seq,
        "compilations": tm.num_compilations,
    }


def hf_labels_step(model, batch):
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 labels=batch["labels"]).loss


def case_step_fp32(res):
    """@treefx.step with a Hugging Face labels= loss (fused projection + tree cross-entropy)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = hf_model("qwen3", **SMALL)
    step = treefx.step(hf_labels_step, **COMPILE_KW)
    trees = small_trees(SMALL["vocab_size"])
    batch = treefx.pack(trees).to(DEV)
    loss = step(model, batch)
    loss.backward()
    g_tree = grads_of(model)
    ref = treefx.reference.sequence_loss(model, trees, reduction="mean")
    ref.backward()
    g_ref = grads_of(model)
    res["step-hf-labels-fp32"] = {
        "loss_rel_err": abs(loss.item() - ref.item()) / abs(ref.item()),
        "max_rel_grad_err": max(((g_tree[n] - g).norm() / g.norm().clamp_min(1e-30)).item()
                                for n, g in g_ref.items()),
        "loss_rewrite": [r.note for r in step.contexts[0].log if r.pass_name == "loss"],
    }


def case_loss_memory(res):
    """Peak memory of one training step: logits materialized (compile + tree_loss) vs the
    fused chunked loss (@treefx.step), Qwen3 with a 151k vocabulary, bf16."""
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
               num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    model = hf_model("qwen3", torch.bfloat16, **cfg)
    tree = synth.agent_tree(3, vocab_size=cfg["vocab_size"], rollouts=8, target_por=0.75)
    batch = treefx.pack(tree, reduction="mean").to(DEV)
    tm = treefx.compile(model, **COMPILE_KW)
    step = treefx.step(hf_labels_step, **COMPILE_KW)
    out = {"tree": repr(tree), "vocab": cfg["vocab_size"]}
    for name, fn in (
        ("logits-materialized", lambda: treefx.tree_loss(tm(batch), batch)),
        ("fused-chunked", lambda: step(model, batch)),
    ):
        fn().backward()  # compile
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = fn()
        loss.backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        out[name] = {"loss": loss.item(),
                     "peak_gib_above_start": (torch.cuda.max_memory_allocated() - base) / 2**30,
                     "ms": _time(lambda: (fn().backward(), model.zero_grad(set_to_none=True)))}
    res["loss-memory"] = out


def hybrid_models(dtype=torch.float32) -> dict:
    """A pure-torch GDN + attention hybrid and HF Qwen3-Next (GDN + attention) from configs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from treefx.models import tiny_hybrid

    torch.manual_seed(0)
    models = {"tiny_hybrid": tiny_hybrid(("gdn", "attention"), vocab_size=1024, dim=128,
                                         n_heads=8, n_kv_heads=4).to(DEV, dtype)}
    cfg = AutoConfig.for_model(
        "qwen3_next", vocab_size=1024, hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
        linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"], num_experts=0,
        mlp_only_layers=[0, 1])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    models["qwen3_next"] = AutoModelForCausalLM.from_config(cfg).to(DEV, dtype)
    only = os.environ.get("TREEFX_HYBRID_MODELS")  # e.g. "qwen3_next"
    return {k: v for k, v in models.items() if not only or k in only.split(",")}


def _kernels() -> dict:
    """Which recurrences have a variable-length fast path (fla) in this environment."""
    from treefx.recurrence import _REGISTRY

    return {name: rec.varlen is not None for name, rec in _REGISTRY.items()
            if "gated_delta" in name}


def case_hybrid_fp32(res):
    """Hybrid models on the inductor backend: FlexAttention, tree conv1d, and the recurrence
    as a traced custom op (per tree depth: fla's varlen kernel when installed, else the torch
    kernel padded), against the oracle (the same model, same kernels, each sequence alone)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    res["hybrid-varlen-fast-path"] = _kernels()
    trees = small_trees(1024)
    for name, model in hybrid_models().items():
        tm = treefx.compile(model, **COMPILE_KW)
        res[f"hybrid-{name}-fp32"] = compare(tm, model, trees, "mean")


def case_hybrid_bf16(res):
    """bf16 hybrids through treefx vs the float32 oracle, beside the plain bf16 per-branch run
    vs the same oracle."""
    torch.backends.cuda.matmul.allow_tf32 = False
    trees = small_trees(1024)
    refs = hybrid_models()
    for name, low in hybrid_models(torch.bfloat16).items():
        tm = treefx.compile(low, **COMPILE_KW)
        res[f"hybrid-{name}-bf16-tree-vs-fp32-oracle"] = compare(tm, refs[name], trees, "mean")
        res[f"hybrid-{name}-bf16-perbranch-vs-fp32-oracle"] = compare(
            PerBranch(low), refs[name], trees, "mean")


def _forward_err(tm, model, trees) -> dict:
    """Forward only, without autograd: max abs log-prob error against the oracle."""
    batch = treefx.pack(trees).to(DEV)
    with torch.no_grad():
        out = tm(batch)
        ref = treefx.reference.sequence_logprobs(model, trees)
    err = max((out.token_logprobs[batch.sequence_index(i)[1:]].float() - lp.float())
              .abs().max().item() for i, lp in enumerate(ref) if lp.numel())
    return {"tokens": batch.num_tokens, "max_abs_logprob_err": err}


def case_inference(res):
    """Forward without autograd (evaluation, RL reference log-probs): the inference graph,
    where Inductor may fuse the mask's padded tree tensors into the attention kernel."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = hf_model("qwen3", **SMALL)
    few = [treefx.Tree.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6], [7]]),
           treefx.Tree.from_sequences([[9] * 40, [9] * 20 + [8] * 24])]
    for label, trees in (("tiny", few), ("small-trees", small_trees(SMALL["vocab_size"]))):
        tm = treefx.compile(model, **COMPILE_KW)
        res[f"inference-qwen3-{label}"] = _forward_err(tm, model, trees)


def case_small_sizes(res):
    """Training steps on rows of 50 to 1,000 tokens (two sequences sharing a prefix): which
    sizes compile a graph of their own. Run with TORCH_LOGS=recompiles to see the guard that
    failed."""
    model = hf_model("qwen3", torch.bfloat16, **SMALL)
    tm = treefx.compile(model, **COMPILE_KW)
    sizes, counts = [], []
    for n in (50, 100, 128, 200, 256, 300, 600, 1000):
        a = n // 2
        b = n - a - n // 4
        tree = treefx.Tree.from_sequences([[3] * a + [4] * b, [3] * a + [5] * (n - a - b)])
        batch = treefx.pack(tree).to(DEV)
        assert batch.num_tokens == n
        treefx.tree_loss(tm(batch), batch).backward()
        sizes.append(n)
        counts.append(tm.num_compilations)
        print(f"  small-sizes: {n} tokens -> {tm.num_compilations} compilations", flush=True)
        res["small-sizes"] = {"sizes": sizes, "compilations_after_each": counts}


def case_short_rows(res):
    """Rows of one attention block or less, and exactly one and two blocks, without autograd
    (Inductor's decoding-kernel choice and its one-block reduction bug) and with it. (The
    variant-by-variant run that located both bugs: results/gpu_short_rows_h200.json.)"""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = hf_model("qwen3", **SMALL)
    few = [treefx.Tree.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6], [7]]),
           treefx.Tree.from_sequences([[9] * 40, [9] * 20 + [8] * 24])]
    block = [treefx.Tree.from_sequences([[5] * 60 + [6] * 20, [5] * 60 + [7] * 48])]
    two = [treefx.Tree.from_sequences([[3] * 100 + [4] * 60, [3] * 100 + [2] * 96])]
    tm = treefx.compile(model, **COMPILE_KW)
    for label, trees in (("71", few), ("128", block), ("256", two)):
        assert treefx.pack(trees).num_tokens == int(label)
        try:
            res[f"short-{label}-no-grad"] = _forward_err(tm, model, trees)
        except Exception:
            res[f"short-{label}-no-grad-error"] = _short_tb(traceback.format_exc(),
                                                            f"short-{label}-no-grad")
    for label, trees in (("71", few), ("128", block)):
        try:
            res[f"short-{label}-training"] = compare(tm, model, trees, "mean")
        except Exception:
            res[f"short-{label}-training-error"] = _short_tb(traceback.format_exc(),
                                                             f"short-{label}-training")
        model.zero_grad(set_to_none=True)
    res["short-compilations"] = tm.num_compilations


def case_hybrid_forward(res):
    """Forward only (log-probs) of the hybrids against the oracle: with fla installed this
    checks the varlen fast path (per-node initial states, cu_seqlens) where fla refuses its
    backward (Triton < 3.7.1 on Hopper)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    res["hybrid-varlen-fast-path"] = _kernels()
    trees = small_trees(1024)
    for dtype in (torch.float32, torch.bfloat16):
        for name, model in hybrid_models(dtype).items():
            tm = treefx.compile(model, **COMPILE_KW)
            key = f"hybrid-{name}-forward-{str(dtype)[6:]}"
            res[key] = _forward_err(tm, model, trees)
            print(f"  {key}: {res[key]}", flush=True)  # a run stopped at its limit keeps it


def case_small_trees(res):
    """Trees shorter than one 128-token attention block (and a little longer), inductor."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = hf_model("qwen3", **SMALL)
    few = [treefx.Tree.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6], [7]]),
           treefx.Tree.from_sequences([[9] * 40, [9] * 20 + [8] * 24])]
    from trees import odd_forest

    for label, trees in (("tiny", few), ("odd-forest", odd_forest(3, 1024)),
                         ("block-plus", few + odd_forest(4, 1024))):
        tm = treefx.compile(model, **COMPILE_KW)
        try:
            res[f"small-{label}"] = compare(tm, model, trees, "mean")
        except Exception:
            res[f"small-{label}-error"] = _short_tb(traceback.format_exc(), label)


CASES = {
    "small-trees": case_small_trees,
    "hybrid-fp32": case_hybrid_fp32,
    "hybrid-bf16": case_hybrid_bf16,
    "hybrid-forward": case_hybrid_forward,
    "inference": case_inference,
    "short-rows": case_short_rows,
    "step-fp32": case_step_fp32,
    "loss-memory": case_loss_memory,
    "qwen3-fp32": case_qwen3_fp32,
    "qwen3-bf16": case_qwen3_bf16,
    "mistral-window": case_mistral_window,
    "recompiles": case_recompiles,
    "recompiles-wide": case_recompiles_wide,
    "small-sizes": case_small_sizes,
    "timing": case_timing,
}


ERR_DIR = None


def _short_tb(tb: str, label: str) -> str:
    """The traceback's head and the lines naming errors (the whole of it goes to a file)."""
    if ERR_DIR:
        with open(os.path.join(ERR_DIR, f"{label}.traceback.txt"), "w") as f:
            f.write(tb)
    if len(tb) < 8000:
        return tb
    named = [ln for ln in tb.splitlines() if "Error" in ln or "Exception" in ln][:20]
    return tb[:1500] + "\n...\n" + "\n".join(ln[:500] for ln in named) + "\n...\n" + tb[-1500:]


def main():
    global ERR_DIR
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--err-dir", default=None, help="write full tracebacks here")
    p.add_argument("--tma", action="store_true",
                   help="FlexAttention kernel option USE_TMA on (treefx leaves it off)")
    p.add_argument("--interleave-heads", choices=("auto", "on", "off"), default="auto",
                   help="treefx.compile(..., interleave_heads=None/True/False) everywhere")
    args = p.parse_args()
    ERR_DIR = args.err_dir
    COMPILE_KW["interleave_heads"] = {"auto": None, "on": True, "off": False}[
        args.interleave_heads]
    if args.tma:
        from treefx.ops import attention

        attention._STANDARD_KERNEL["USE_TMA"] = True
    import transformers

    try:
        import triton
    except ImportError:
        triton = None
    res = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "tma": args.tma,
           "interleave_heads": args.interleave_heads,
           "torch": torch.__version__,
           "triton": getattr(triton, "__version__", None), "transformers": transformers.__version__}
    for name in args.cases.split(","):
        t0 = time.perf_counter()
        try:
            CASES[name](res)
            status = "ok"
        except Exception:
            res[f"{name}-error"] = _short_tb(traceback.format_exc(), name)
            status = "FAILED"
        print(f"{name}: {status} in {time.perf_counter() - t0:.1f}s", flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if not k.endswith("error")}, indent=1))
    for k, v in res.items():
        if k.endswith("error"):
            msgs = [ln for ln in v.splitlines() if "Error" in ln or "error:" in ln]
            print(f"--- {k}\n" + "\n".join(m[:400] for m in msgs[-6:]))


if __name__ == "__main__":
    main()
