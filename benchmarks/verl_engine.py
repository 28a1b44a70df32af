"""verl's actor update and ``compute_log_prob`` with its own FSDP engine
(``FSDPEngineWithLMHead``, SDPA or ``verl-flex``: FlexAttention) and with treefx's
(``treefx.integrations.verl.TreeFSDPEngine``), one process, the same GRPO batch of multi-turn
prompts made as ``benchmarks.grpo`` makes them (issue 65; benchmarks/README.md says what verl
needs)."""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile

import torch
import torch.distributed as dist

import treefx
from benchmarks import common
from benchmarks.common import SHAPES
from benchmarks.grpo import add_rollout_args, make_rollouts

TOL = {"float32": {"logprob": 1e-5, "loss": 1e-5}, "bfloat16": {"logprob": 0.1, "loss": 1e-2}}


def _batch(rollouts: dict, micro: int, seed: int):
    """verl's update batch (jagged, the worker's metadata) for ``rollouts``; its token counts."""
    import treefx.integrations.verl as tv

    g = torch.Generator().manual_seed(seed)
    rows = [(grp["prompt"], c) for grp in rollouts["groups"] for c in grp["completions"]]
    G = len(rollouts["groups"][0]["completions"])
    B, P, R = len(rows), max(len(p) for p, _ in rows), max(len(r) for _, r in rows)
    adv = torch.randn(B // G, 1, generator=g).repeat_interleave(G, 0).expand(B, R)
    td = tv.update_batch(rows, {"old_log_probs": -torch.rand(B, R, generator=g) * 4,
                                "ref_log_prob": -torch.rand(B, R, generator=g) * 4,
                                "advantages": adv.contiguous()},
                         temperature=1.0, global_batch_size=B, use_remove_padding=True,
                         use_fused_kernels=False, use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=micro)
    stats = {"rows": B, "row_tokens": sum(len(p) + len(r) for p, r in rows),
             "padded_tokens": B * (P + R),
             "tree_tokens_whole_batch":
                 treefx.Tree.from_sequences([p + r for p, r in rows]).num_tokens}
    return td, stats


def _configs(folder: str, model_type: str, dry_run: bool, checkpointing: bool,
             attention: str = "sdpa"):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    model = HFModelConfig(path=folder, load_tokenizer=False, model_type=model_type,
                          enable_gradient_checkpointing=checkpointing,
                          override_config={"attn_implementation": attention})
    engine = dict(strategy="fsdp2", use_torch_compile=not dry_run)
    if dry_run:
        engine.update(model_dtype="fp32", mixed_precision={
            "param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"})
    optim = FSDPOptimizerConfig(lr=0.0, total_training_steps=100, weight_decay=0.0)
    return dict(model_config=model, engine_config=FSDPEngineConfig(**engine),
                optimizer_config=optim, checkpoint_config=CheckpointConfig())


def run_engine(name: str, folder: str, td, args, cuda: bool) -> dict:
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.utils.losses import ppo_loss

    import treefx.integrations.verl as tv

    if args.compile_options:
        tv.register(compile_options=args.compile_options)
    model_type = "language_model" if name.startswith("verl") else tv.MODEL_TYPE
    attention = "flex_attention" if name == "verl-flex" else "sdpa"
    if model_type == "language_model" and not cuda:
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
        EngineRegistry._engines["language_model"]["fsdp2"].setdefault("cpu", FSDPEngineWithLMHead)
    engine = EngineRegistry.new(model_type=model_type, backend="fsdp2",
                                **_configs(folder, model_type, args.dry_run,
                                           not args.no_checkpointing, attention))
    engine.initialize()
    loss_fn = functools.partial(ppo_loss, ActorConfig(
        strategy="fsdp2", rollout_n=args.G, ppo_micro_batch_size_per_gpu=args.micro,
        use_kl_loss=True, kl_loss_coef=0.001, entropy_coeff=0.0, loss_agg_mode="token-mean"))
    timer = functools.partial(common.timed, cuda=cuda)
    rec = {"engine": type(engine).__name__, "attention": attention, "log_prob_ms": [], "update_ms": [], "losses": []}

    def log_prob():
        with engine.eval_mode():
            data = td.clone()
            tu.assign_non_tensor(data, calculate_entropy=True, compute_loss=False)
            return engine.infer_batch(data)

    def update():
        with engine.train_mode():
            data = td.clone()
            tu.assign_non_tensor(data, calculate_entropy=False)
            return engine.train_batch(data, loss_fn)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    (first_lp, rec["first_log_prob_ms"]) = timer(log_prob)
    (first_up, rec["first_update_ms"]) = timer(update)
    rec["first_cycle_s"] = (rec["first_log_prob_ms"] + rec["first_update_ms"]) / 1e3
    rec["log_probs"] = [t.float().cpu() for t in first_lp["model_output"]["log_probs"].unbind()]
    rec["first_loss"] = float(sum(first_up["loss"]))
    for i in range(args.warmup + args.steps):
        lp, t_lp = timer(log_prob)
        up, t_up = timer(update)
        if i >= args.warmup:
            rec["log_prob_ms"].append(t_lp)
            rec["update_ms"].append(t_up)
            rec["losses"].append(float(sum(up["loss"])))
    rec["log_prob_median_ms"] = statistics.median(rec["log_prob_ms"])
    rec["update_median_ms"] = statistics.median(rec["update_ms"])
    rec["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    rec["tree_stats"] = dict(getattr(engine, "tree_stats", {}) or {})
    engine = None  # free it before the next engine is built
    common.free_memory(None, cuda)
    return rec


def compare(a: dict, b: dict, response_lens: list[int], tol: dict) -> dict:
    worst = 0.0
    for x, y, n in zip(a["log_probs"], b["log_probs"], response_lens):
        # the response's tokens: position t holds log p(token t+1), so the last n before the end
        worst = max(worst, float((x[-n - 1:-1] - y[-n - 1:-1]).abs().max()))
    loss = abs(a["first_loss"] - b["first_loss"]) / max(abs(a["first_loss"]), 1e-12)
    return {"logprob_max_abs": worst, "loss_rel": loss,
            "within_tolerance": worst <= tol["logprob"] and loss <= tol["loss"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_run_args(p, "CPU: tiny Qwen3, float32, a small batch; the engines must agree")
    p.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None)
    add_rollout_args(p)
    p.add_argument("--micro", type=int, default=16, help="rows per micro-batch")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-checkpointing", action="store_true")
    p.add_argument("--engines", default="verl,treefx",
                   help="comma-separated: verl (SDPA), verl-flex (FlexAttention), treefx")
    p.add_argument("--compile-options", type=__import__("json").loads, default={})
    args = p.parse_args(argv)
    if args.dry_run:
        args.shape, args.groups, args.G, args.micro = "tiny", 2, 4, 4
        args.context, args.history, args.question, args.completion = 40, "10,20", "3,6", "5,20"
        args.warmup, args.steps = 0, 1
    cuda = common.use_cuda(args.dry_run)
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29543"), ("RANK", "0"),
                 ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    import treefx.integrations.verl as tv

    tv.use_cpu_platform()
    config = dict(SHAPES[args.shape])
    if args.layers:
        config["num_hidden_layers"] = args.layers
    folder = tempfile.mkdtemp()
    model = common.hf_model("qwen3", dev="cpu", dtype=torch.float32, on_device=False, **config)
    model.save_pretrained(folder)
    del model
    rollouts = make_rollouts(args, config["vocab_size"], eos=2)
    td, stats = _batch(rollouts, args.micro, args.seed)
    res = {"meta": common.run_meta(cuda), "args": vars(args), "model": config, "data": stats,
           "engines": {}}
    for name in args.engines.split(","):
        print(f"[{name}] ...", flush=True)
        try:
            res["engines"][name] = run_engine(name, folder, td, args, cuda)
        except Exception as e:  # the other engines still run; the result says why this failed
            if args.dry_run:
                raise
            import traceback
            traceback.print_exc()
            res["errors"] = {**res.get("errors", {}), name: f"{type(e).__name__}: {e}"[:2000]}
            common.free_memory(None, cuda)
    dtype = "float32" if args.dry_run else "bfloat16"
    lens = td["responses"].offsets().diff().tolist() if td["responses"].is_nested else \
        td["response_mask"].sum(1).tolist()
    for stock in ("verl", "verl-flex"):
        if {stock, "treefx"} <= res["engines"].keys():
            a, b = res["engines"][stock], res["engines"]["treefx"]
            key = "" if stock == "verl" else "_flex"
            res["comparison" + key] = compare(a, b, lens, TOL[dtype])
            res["speedup_update" + key] = a["update_median_ms"] / b["update_median_ms"]
            res["speedup_log_prob" + key] = a["log_prob_median_ms"] / b["log_prob_median_ms"]
    for rec in res["engines"].values():
        rec.pop("log_probs", None)
    for name, rec in res["engines"].items():
        print(f"{name:>7}: update {rec['update_median_ms']:.1f} ms, log-prob "
              f"{rec['log_prob_median_ms']:.1f} ms, first cycle {rec['first_cycle_s']:.1f} s, "
              f"peak {rec['peak_gib'] if rec['peak_gib'] is None else round(rec['peak_gib'], 1)}"
              f" GiB")
    for key in ("", "_flex"):
        if "comparison" + key in res:
            print(f"against verl{key.replace('_', '-')}: update {res['speedup_update' + key]:.2f}x,"
                  f" log-prob {res['speedup_log_prob' + key]:.2f}x; {res['comparison' + key]}")
    common.save_json(res, common.resolve_out(args, "verl_engine", cuda))
    dist.destroy_process_group()
    if args.dry_run and "comparison" in res and not res["comparison"]["within_tolerance"]:
        raise SystemExit(f"the engines differ: {res['comparison']}")
    return res


if __name__ == "__main__":
    main()
