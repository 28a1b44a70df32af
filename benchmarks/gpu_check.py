"""GPU exactness of the inductor backend against the per-sequence oracle (``treefx.verify``),
case by case (BENCHMARKS.md, "Exactness on the GPU" and "Model families"; the cases retired in
issue 67: benchmarks/README.md)."""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch
import torch.nn.functional as F

import treefx
from treefx import synth

from . import common
from .common import check_forest, tiny_forest

# Set by configure(): CUDA with the inductor backend for the numbers that count; the CPU with
# the eager backend checks the script's logic (--dry-run, or no GPU).
DEV = "cpu"
BACKEND = "eager"
DRY_RUN = False
COMPILE_KW = {"backend": BACKEND}  # every treefx.compile / treefx.step here

SMALL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, head_dim=32)
# --dry-run: the same shapes of trees through a tiny model
TINY = dict(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8)
DRY_RUN_CASES = "qwen3-fp32,qwen3-bf16,inference"


def configure(cuda: bool) -> None:
    global DEV, BACKEND
    DEV = "cuda" if cuda else "cpu"
    BACKEND = "inductor" if cuda else "eager"
    COMPILE_KW["backend"] = BACKEND


def hf_model(model_type: str, dtype=torch.float32, seed=0, **cfg):
    return common.hf_model(model_type, dev=DEV, dtype=dtype, seed=seed, **cfg)


def compare(tree_model, trees, reduction="mean", reference=None, grads=True):
    """``treefx.verify``: the tree model against the per-sequence oracle (``reference``: run
    the oracle on that module instead, e.g. the float32 copy of a bf16 model), log-probs and
    every gradient (``grads=False``: the forward alone, without autograd)."""
    rep = treefx.verify(tree_model, trees, reduction=reduction, reference=reference,
                        grads=grads, raise_on_failure=False)
    return common.report_dict(rep)


def case_qwen3_fp32(res):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = hf_model("qwen3", **SMALL)
    tm = treefx.compile(model, **COMPILE_KW)
    trees = check_forest(SMALL["vocab_size"], small=DRY_RUN)
    for red in ("sum", "mean"):
        res[f"qwen3-fp32-{red}"] = compare(tm, trees, red)
    res["qwen3-fp32-compilations"] = tm.num_compilations


def case_qwen3_bf16(res):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = hf_model("qwen3", **SMALL)
    low = _bf16_copy(ref, SMALL)
    trees = check_forest(SMALL["vocab_size"], small=DRY_RUN)
    tm = treefx.compile(low, **COMPILE_KW)
    res["qwen3-bf16-tree-vs-fp32-oracle"] = compare(tm, trees, "mean", reference=ref)
    # the input embedding's gradient by ATen's kernel (compiler/lower/whole.py, finish)
    res["qwen3-bf16-embedding-op"] = [r.after for c in tm.contexts for r in c.log
                                      if r.pass_name == "embedding"]

    res["qwen3-bf16-perbranch-vs-fp32-oracle"] = common.oracle_vs_oracle(low, ref, trees, "mean")


def case_inference(res):
    """Forward without autograd (evaluation, RL reference log-probs): the inference graph,
    where Inductor may fuse the mask's padded tree tensors into the attention kernel."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = hf_model("qwen3", **SMALL)
    for label, trees in (("tiny", tiny_forest()),
                         ("small-trees", check_forest(SMALL["vocab_size"], small=DRY_RUN))):
        tm = treefx.compile(model, **COMPILE_KW)
        res[f"inference-qwen3-{label}"] = compare(tm, trees, grads=False)


def case_short_rows(res):
    """Rows of one attention block or less, and exactly one and two blocks, without autograd
    (Inductor's decoding-kernel choice and its one-block reduction bug) and with it."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = hf_model("qwen3", **SMALL)
    few = tiny_forest()
    block = [treefx.Tree.from_sequences([[5] * 60 + [6] * 20, [5] * 60 + [7] * 48])]
    two = [treefx.Tree.from_sequences([[3] * 100 + [4] * 60, [3] * 100 + [2] * 96])]
    tm = treefx.compile(model, **COMPILE_KW)
    for label, trees in (("71", few), ("128", block), ("256", two)):
        assert treefx.pack(trees).num_tokens == int(label)
        try:
            res[f"short-{label}-no-grad"] = compare(tm, trees, grads=False)
        except Exception:
            res[f"short-{label}-no-grad-error"] = _short_tb(traceback.format_exc(),
                                                            f"short-{label}-no-grad")
    for label, trees in (("71", few), ("128", block)):
        try:
            res[f"short-{label}-training"] = compare(tm, trees, "mean")
        except Exception:
            res[f"short-{label}-training-error"] = _short_tb(traceback.format_exc(),
                                                             f"short-{label}-training")
        model.zero_grad(set_to_none=True)
    res["short-compilations"] = tm.num_compilations


# Model families with their own attention or state; "<type>-flex": the model built with
# attn_implementation="flex_attention" (its oracle the model itself, through it).
FAMILIES = ("deepseek_v3", "gpt_oss", "gemma2", "qwen3_5_moe", "nemotron_h", "granite_swa",
            "mamba", "jamba", "gpt_neo", "mpt", "falcon", "llama4_text", "bloom", "xglm", "mvp",
            "qwen3-flex", "mistral-flex", "gemma2-flex", "minimax", "deepseek_v32", "glm_moe_dsa",
            "gemma4_unified")
# On top of the zoo's tiny configs: ALiBi on for Falcon; tables longer than the agent tree's
# row; GPT-Neo's heads at FlexAttention's minimum of 16 dimensions.
FAMILY_CONFIG = {"falcon": dict(alibi=True),
                 "gpt_neo": dict(max_position_embeddings=4096, hidden_size=64, num_heads=4),
                 "mpt": dict(max_seq_len=4096), "xglm": dict(max_position_embeddings=4096),
                 "mvp": dict(max_position_embeddings=4096)}


def _family_trees(model) -> list:
    """The zoo's probe forest and a ~1,800-token agent tree, over ids the model treats plainly."""
    import numpy as np

    from treefx.tools import zoo

    exclude = zoo.special_token_ids(model.config)
    allowed = np.array([t for t in range(zoo.VOCAB) if t not in exclude])
    agent = synth.agent_tree(2, vocab_size=10**6, rollouts=2, **common.scaled_lengths(
        0.1 if DRY_RUN else 0.5))
    seqs = [allowed[np.asarray(s) % len(allowed)].tolist() for s in agent.sequences]
    return [*zoo.probe_forest(zoo.VOCAB, exclude), treefx.Tree.from_sequences(seqs)]


def case_families(res):
    """Each family's tiny zoo model through the inductor backend: float32 against the oracle,
    bf16 against the float32 oracle (beside the bf16 per-branch run) and the bf16 oracle."""
    import copy

    from treefx.tools import zoo

    torch.backends.cuda.matmul.allow_tf32 = False
    only = os.environ.get("TREEFX_FAMILIES")
    for mt in (only.split(",") if only else FAMILIES):
        t0 = time.perf_counter()
        try:
            torch._dynamo.reset()
            base, _, impl = mt.partition("-")
            ref = zoo.build_model(base, **FAMILY_CONFIG.get(base, {})).to(DEV)
            if impl:
                ref.set_attn_implementation("flex_attention")
            elif mt in ("gemma2", "gpt_oss"):
                # Hugging Face's SDPA path drops softcapping and sinks (transformers 5.17
                # builds Gemma 2 with it by default): the eager form is the model.
                ref.set_attn_implementation("eager")
            trees = _family_trees(ref)
            res[f"family-{mt}-tokens"] = sum(t.num_tokens for t in trees)
            res[f"family-{mt}-attn"] = ref.config._attn_implementation
            fp32 = ref
            if DEV == "cuda" and getattr(ref.config, "_experts_implementation", None) not in (
                    None, "eager"):
                # float32 experts: transformers' grouped-matmul fallback's backward does not
                # trace, its per-expert loop breaks the graph: batched matmuls
                fp32 = copy.deepcopy(ref)
                fp32.set_experts_implementation("batched_mm")
                res[f"family-{mt}-fp32-experts"] = "batched_mm"
            tm = treefx.compile(fp32, **COMPILE_KW)
            res[f"family-{mt}-fp32"] = compare(tm, trees, "mean")
            low = copy.deepcopy(ref).to(torch.bfloat16)
            tml = treefx.compile(low, **COMPILE_KW)
            res[f"family-{mt}-bf16-tree-vs-fp32-oracle"] = compare(tml, trees, "mean",
                                                                  reference=ref)
            # The product's own bf16 check: the bf16 oracle, its floor (treefx.verify).
            res[f"family-{mt}-bf16-tree-vs-bf16-oracle"] = compare(tml, trees, "mean")
            res[f"family-{mt}-bf16-perbranch-vs-fp32-oracle"] = common.oracle_vs_oracle(
                low, ref, trees, "mean")
        except Exception:
            res[f"family-{mt}-error"] = _short_tb(traceback.format_exc(), f"family-{mt}")
        res[f"family-{mt}-seconds"] = round(time.perf_counter() - t0, 1)
        print(f"  family {mt}: {time.perf_counter() - t0:.0f} s", flush=True)
        for key, value in res.items():  # a run stopped at its limit keeps the families done
            if key.startswith(f"family-{mt}-") and key != f"family-{mt}-seconds":
                print(f"    {key}: {str(value)[:600]}", flush=True)


def _grad_run(fn, xs, go, rows=None):
    """``fn(*xs)`` on detached copies: [output (``rows`` of it), *input gradients for ``go``]."""
    xs = [x.detach().clone().requires_grad_() for x in xs]
    out = fn(*xs)
    grads = torch.autograd.grad(out, xs, go.to(out.dtype))
    out = out.detach() if rows is None else out.detach()[:, :, :rows]
    return [out.double(), *(x.double() for x in grads)]


def _trunk_op_errors(dtype, n=1000, t=700, hq=8, hk=2, d=128):
    """The trunk op alone (:mod:`treefx.ops.attention.trunk`) on a row whose first ``t`` rows
    are a chain, in ``dtype`` against float64 causal attention, beside FlexAttention's."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from treefx.ops.attention import trunk

    g = torch.Generator(device=DEV).manual_seed(0)
    parent = torch.cat([torch.arange(-1, t - 1), torch.full((n - t,), -1)]).to(DEV)
    t0 = trunk.trunk_rows(parent, 0, 128)[0]
    x64 = [torch.randn(1, h, n, d, device=DEV, generator=g, dtype=torch.float64)
           for h in (hq, hk, hk)]
    go = torch.randn(1, hq, n, d, device=DEV, generator=g, dtype=torch.float64)
    go[:, :, t0:] = 0

    def run(fn, xs):
        return _grad_run(fn, xs, go, t0)

    ref = run(lambda q, k, v: F.pad(F.scaled_dot_product_attention(
        q[:, :, :t0], k[:, :, :t0].repeat_interleave(hq // hk, 1),
        v[:, :, :t0].repeat_interleave(hq // hk, 1), is_causal=True), (0, 0, 0, n - t0)), x64)
    low = [x.to(dtype) for x in x64]
    got = run(lambda q, k, v: trunk.trunk_attention(q, k, v, parent), low)

    names = ("out", "dq", "dk", "dv")
    out = {"trunk_rows": t0, "trunk_op": dict(zip(names, map(common.norm_rel, got, ref)))}
    # a part's rows under a context of ``seen`` rows (padded to a block): the chain sees it all
    a, seen = 256, 200
    kc64, vc64 = (torch.randn(1, hk, a, d, device=DEV, generator=g, dtype=torch.float64)
                  for _ in range(2))
    par_part = parent.clone()
    par_part[0] = seen - 1
    par_part[1:t] += a
    mask = torch.ones(t0, seen + t0, dtype=torch.bool, device=DEV)
    mask[:, seen:] = torch.ones(t0, t0, dtype=torch.bool, device=DEV).tril()

    def ref_ctx(q, k, v, kc, vc):
        keys = torch.cat([kc[:, :, :seen], k[:, :, :t0]], 2).repeat_interleave(hq // hk, 1)
        values = torch.cat([vc[:, :, :seen], v[:, :, :t0]], 2).repeat_interleave(hq // hk, 1)
        return F.pad(F.scaled_dot_product_attention(q[:, :, :t0], keys, values, attn_mask=mask),
                     (0, 0, 0, n - t0))

    ref_c = run(ref_ctx, [*x64, kc64, vc64])
    got_c = run(lambda q, k, v, kc, vc: trunk.trunk_attention(q, k, v, par_part, a, None, 128,
                                                                kc, vc),
                [x.to(dtype) for x in (*x64, kc64, vc64)])
    names_c = ("out", "dq", "dk", "dv", "dk_context", "dv_context")
    out["trunk_op_with_context"] = dict(zip(names_c, map(common.norm_rel, got_c, ref_c)))
    if DEV == "cuda":  # FlexAttention has no backward on the CPU
        bm = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, n, n, device=DEV)
        flex = torch.compile(flex_attention)
        fl = run(lambda q, k, v: flex(q, k, v, block_mask=bm, enable_gqa=True), low)
        out["flex"] = dict(zip(names, map(common.norm_rel, fl, ref)))
    return out


def _parts_check(res, label, ref, low, tm, trees, note):
    """``treefx.backward`` in parts of a third of the tree against the whole tree in one step
    (the same bf16 model) and against the float32 oracle (``ref`` per sequence), and how many
    of the part graph's sites' notes name ``note``."""
    from treefx.run.parts import runners

    batch = treefx.pack(trees, reduction="mean")
    loss_parts = treefx.backward(tm, trees, max_tokens=batch.num_tokens // 3)
    g_parts = common.grads_of(low)
    loss = treefx.tree_loss(tm(batch.to(DEV)), batch.to(DEV))
    loss.backward()
    g_whole = common.grads_of(low)
    ref_loss, g_ref = common.oracle(ref, trees)
    log = [r.note for r in runners(tm)[0].engine.contexts[-1].log if r.pass_name == "attention"]
    res[f"{label}-parts-vs-whole"] = {
        "loss_rel": abs(loss_parts.item() - loss.item()) / abs(loss.item()),
        "max_rel_grad_err": common.max_rel_grad_err(g_parts, g_whole)}
    res[f"{label}-parts-vs-fp32-oracle"] = {
        "loss_rel": abs(loss_parts.item() - ref_loss) / abs(ref_loss),
        "max_rel_grad_err": common.max_rel_grad_err(g_parts, g_ref),
        "part_sites": len(log), "part_sites_noted": sum(note in n for n in log)}


def _interval_op_errors(dtype, hq=8, hk=2, d=128):
    """The interval op alone (:mod:`treefx.ops.attention.intervals`) on odd forests and a
    comb, in ``dtype`` against float64 dense tree attention, beside FlexAttention's site."""
    from benchmarks.real_trees import comb_tree
    from treefx.mask import dense_tree_mask
    from treefx.ops.attention import intervals, tree_attention_dense
    from treefx.tools.synth import odd_forest

    batch = treefx.pack([comb_tree(7, 1024, 6, 0.3)] + odd_forest(3, 1024)).to(DEV)
    n = batch.num_tokens
    g = torch.Generator(device=DEV).manual_seed(0)
    x64 = [torch.randn(1, h, n, d, device=DEV, generator=g, dtype=torch.float64)
           for h in (hq, hk, hk)]
    go = torch.randn(1, hq, n, d, device=DEV, generator=g, dtype=torch.float64)

    def run(fn, xs):
        return _grad_run(fn, xs, go)

    dense = dense_tree_mask(batch.subtree_end)
    ref = run(lambda q, k, v: tree_attention_dense(q, k, v, dense, None, enable_gqa=True), x64)
    low = [x.to(dtype) for x in x64]
    names = ("out", "dq", "dk", "dv")

    got = run(lambda q, k, v: intervals.tree_interval_attention(q, k, v, batch.parent_token),
              low)
    out = {"tokens": n, "intervals": int(intervals.tree_intervals(
        batch.parent_token.cpu().numpy()).shape[0]),
        "cudnn": intervals.wanted(*low), "op": dict(zip(names, map(common.norm_rel, got, ref)))}
    if DEV == "cuda":  # FlexAttention has no backward on the CPU
        from benchmarks.chain_attention import treefx_site

        fl = run(treefx_site(batch.subtree_end), low)
        out["flex"] = dict(zip(names, map(common.norm_rel, fl, ref)))
    out["parts"] = _part_interval_errors(batch, x64, go, low[0].dtype)
    return out


def _part_interval_errors(batch, x64, go, dtype) -> dict:
    """The op with a part's context first (parts of a fifth of the batch): each part's output
    and gradients (the context's keys and values too) in ``dtype`` against float64 dense
    attention under the part's mask; the worst part's relative errors."""
    from treefx import parts
    from treefx.mask import dense_tree_mask
    from treefx.ops.attention import intervals

    plan = parts.plan(batch.to("cpu"), batch.num_tokens // 5)
    worst: dict = {}
    with_context = 0
    for part in plan.parts:
        t = parts.part_tensors(plan, part, DEV)
        a, s, e = t["part_info"].shape[1], part.start, part.end
        n = t["tree_info"].shape[1]
        if n != e - s:  # a part padded with inert tokens: too short to matter here
            continue
        with_context += bool(len(part.context))
        idx = torch.as_tensor(part.context, device=DEV)
        q, k, v = (x[:, :, s:e] for x in x64)
        kc, vc = (torch.zeros(1, x.shape[1], a, x.shape[3], dtype=x.dtype, device=DEV)
                  for x in x64[1:])
        kc[:, :, :len(idx)], vc[:, :, :len(idx)] = x64[1][:, :, idx], x64[2][:, :, idx]
        g = go[:, :, s:e]
        mask = dense_tree_mask(torch.cat([t["part_info"][2], t["tree_info"][2]]))[a:]

        def run(fn, xs, g=g):
            return _grad_run(fn, xs, g)

        def dense(q, k, v, kc, vc):
            group = q.shape[1] // k.shape[1]
            keys, values = (torch.cat([c, x], 2).repeat_interleave(group, 1)
                            for c, x in ((kc, k), (vc, v)))
            p = (q @ keys.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(
                ~mask, float("-inf")).softmax(-1)
            return p @ values

        ref = run(dense, (q, k, v, kc, vc))
        got = run(lambda *xs: intervals.tree_part_interval_attention(*xs, t["tree_info"][1]),
                  [x.to(dtype) for x in (q, k, v, kc, vc)])
        for name, a_, b_ in zip(("out", "dq", "dk", "dv", "dk_context", "dv_context"),
                                got, ref):
            if b_.norm() > 0:
                worst[name] = max(worst.get(name, 0.0), common.norm_rel(a_, b_))
    return {"parts": len(plan.parts), "with_context": with_context, "worst": worst}


def _attention_case(res, prefix, op_errors, switch, note, odd=False):
    """An attention path (``switch``, its sites' notes naming ``note``): the op alone against
    float64 beside FlexAttention (``op_errors``), then Qwen3 in bf16 on comb-shaped trees (and
    odd forests) against the float32 oracle with the path and without it (``switch`` at 0),
    whole and in parts, and the bf16 run per sequence against the same oracle (the floor)."""
    from benchmarks.real_trees import comb_tree
    from treefx.tools.synth import odd_forest

    torch.backends.cuda.matmul.allow_tf32 = False
    for dtype in (torch.bfloat16, torch.float16):
        res[f"{prefix}-op-{str(dtype)[6:]}"] = op_errors(dtype)
    cfg = dict(SMALL, head_dim=128, num_attention_heads=8, num_key_value_heads=2)
    ref = hf_model("qwen3", **cfg)
    trees = [comb_tree(s, cfg["vocab_size"], 6, 0.3) for s in range(2)]
    trees += odd_forest(1, cfg["vocab_size"]) if odd else []
    res[f"{prefix}-trees"] = {"tokens": treefx.pack(trees).num_tokens}
    for on in (True, False):
        if not on:
            os.environ[switch] = "0"
        try:
            low = _bf16_copy(ref, cfg)
            tm = treefx.compile(low, verify=False, **COMPILE_KW)
            name = f"{prefix}-qwen3-bf16" + ("" if on else "-off")
            res[f"{name}-vs-fp32-oracle"] = compare(tm, trees, "mean", reference=ref)
            res[f"{name}-sites"] = sum(note in r.note for c in tm.contexts for r in c.log)
            _parts_check(res, name, ref, low, tm, trees, note)
        finally:
            os.environ.pop(switch, None)
    res[f"{prefix}-qwen3-bf16-perbranch-vs-fp32-oracle"] = common.oracle_vs_oracle(
        _bf16_copy(ref, cfg), ref, trees, "mean")


def case_trunk(res):
    """The leading chain on cuDNN's causal kernel (the default for bf16/fp16 on the GPU)."""
    _attention_case(res, "trunk", _trunk_op_errors, "TREEFX_TRUNK_ATTENTION",
                    "dense causal kernel")


def case_intervals(res):
    """Tree attention on cuDNN's interval-mask kernels (bf16/fp16's default with the frontend)."""
    _attention_case(res, "intervals", _interval_op_errors, "TREEFX_CUDNN_ATTENTION",
                    "interval-mask", odd=True)


def _bf16_copy(ref, cfg):
    low = hf_model("qwen3", torch.bfloat16, **cfg)
    low.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()})
    return low


CASES = {
    "intervals": case_intervals,
    "trunk": case_trunk,
    "families": case_families,
    "inference": case_inference,
    "short-rows": case_short_rows,
    "qwen3-fp32": case_qwen3_fp32,
    "qwen3-bf16": case_qwen3_bf16,
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


def main(argv=None):
    global ERR_DIR, DRY_RUN
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check",
                                description=__doc__.split("\n\n")[0])
    common.add_run_args(p, f"CPU, eager backend, a tiny model; cases {DRY_RUN_CASES} unless "
                           "--cases")
    p.add_argument("--cases", default=None, help=f"comma-separated, of {', '.join(CASES)} "
                                                 "(default: all)")
    p.add_argument("--err-dir", default=None, help="write full tracebacks here")
    args = p.parse_args(argv)
    cuda = common.use_cuda(args.dry_run)
    configure(cuda)
    DRY_RUN = args.dry_run
    if args.dry_run:
        SMALL.update(TINY)
    args.cases = args.cases or (DRY_RUN_CASES if args.dry_run else ",".join(CASES))
    common.resolve_out(args, "gpu_check", cuda)
    ERR_DIR = args.err_dir
    res = common.run_meta(cuda)
    for name in args.cases.split(","):
        t0 = time.perf_counter()
        try:
            CASES[name](res)
            status = "ok"
        except Exception:
            res[f"{name}-error"] = _short_tb(traceback.format_exc(), name)
            status = "FAILED"
        print(f"{name}: {status} in {time.perf_counter() - t0:.1f}s", flush=True)
        common.save_json(res, args.out)
    print(json.dumps({k: v for k, v in res.items() if not k.endswith("error")}, indent=1,
                     default=str))
    for k, v in res.items():
        if k.endswith("error"):
            msgs = [ln for ln in v.splitlines() if "Error" in ln or "error:" in ln]
            print(f"--- {k}\n" + "\n".join(m[:400] for m in msgs[-6:]))
    return res


if __name__ == "__main__":
    main()
