"""TRL's GRPO training step with and without treefx: ``trl.GRPOTrainer`` against
``treefx.integrations.trl.TreeGRPOTrainer``, one GPU, one process, the same pre-made rollouts
(issue 35; benchmarks/README.md says what a cycle times, what is compared and what TRL needs)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
import zlib

import torch

from benchmarks import common
from benchmarks.common import SHAPES

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

PATHS = ("trl", "treefx")
TOL = {"float32": {"logprob": 1e-5, "loss": 1e-5, "grad": 1e-5},
       "bfloat16": {"logprob": 0.1, "loss": 1e-2, "grad": 0.1}}


# ----------------------------------------------------------------------------- data


def make_rollouts(args, vocab: int, eos: int) -> dict:
    """The pre-made rollouts: per group its prompt ids and G completions (ids, EOS last)."""
    g = torch.Generator().manual_seed(args.seed)

    def length(text):  # "lo,hi" (or "n")
        lo, _, hi = text.partition(",")
        return int(torch.randint(int(lo), int(hi or lo) + 1, (1,), generator=g))

    def draw(n):  # ids 10.. below the vocabulary: never the tokenizer's pad (0) or EOS (2)
        return torch.randint(10, vocab, (n,), generator=g).tolist()

    context = draw(args.context)
    groups = []
    for _ in range(args.groups):
        prompt = context + draw(length(args.history)) + draw(length(args.question))
        completions = [draw(max(1, length(args.completion) - 1)) + [eos]
                       for _ in range(args.G)]
        groups.append({"prompt": prompt, "completions": completions})
    return {"context": context, "groups": groups}


def add_rollout_args(p: argparse.ArgumentParser) -> None:
    """The rollouts' arguments (:func:`make_rollouts`; benchmarks.verl_engine's too)."""
    p.add_argument("--groups", type=int, default=4, help="prompts per generation batch")
    p.add_argument("--G", type=int, default=8, help="completions per prompt")
    p.add_argument("--context", type=int, default=2000, help="tokens every prompt shares")
    p.add_argument("--history", default="500,2000", help="each prompt's earlier turns: lo,hi")
    p.add_argument("--question", default="20,150", help="each prompt's last user turn: lo,hi")
    p.add_argument("--completion", default="100,1000", help="completion tokens: lo,hi")
    p.add_argument("--seed", type=int, default=0)


def data_stats(rollouts: dict, per_device: int, G: int) -> dict:
    """Token counts of one generation batch: TRL's padded rows, the rows' own tokens, the trees
    (per group, per micro-batch of whole groups, the whole batch)."""
    import treefx

    groups = rollouts["groups"]
    prompts = [len(x["prompt"]) for x in groups]
    comps = [len(c) for x in groups for c in x["completions"]]
    rows = len(comps)
    seqs = [x["prompt"] + c for x in groups for c in x["completions"]]
    per_group = [treefx.Tree.from_sequences([x["prompt"] + c for c in x["completions"]])
                 for x in groups]
    k = max(1, per_device // G)
    per_micro = [treefx.Tree.from_sequences([s for x in groups[i:i + k]
                                             for s in (x["prompt"] + c for c in x["completions"])])
                 for i in range(0, len(groups), k)]
    whole = treefx.Tree.from_sequences(seqs)
    sequence_tokens = sum(len(s) for s in seqs)
    padded = rows * (max(prompts) + max(comps))
    micro_tree = sum(t.num_tokens for t in per_micro)
    return {
        "groups": len(groups), "G": G, "rows": rows, "context_tokens": len(rollouts["context"]),
        "prompt_tokens": prompts, "completion_tokens": comps,
        "completion_tokens_min_mean_max": [min(comps), sum(comps) / rows, max(comps)],
        "sequence_tokens": sequence_tokens, "trl_padded_tokens": padded,
        "padding_share": 1 - sequence_tokens / padded,
        "tree_tokens_per_group": sum(t.num_tokens for t in per_group),
        "tree_tokens_per_micro_batch_in_order": micro_tree,
        "tree_tokens_whole_batch": whole.num_tokens,
        "por_micro_batch_trees": 1 - micro_tree / sequence_tokens,
        "bound_vs_rows": sequence_tokens / micro_tree,
        "bound_vs_trl_padded": padded / micro_tree,
    }


def rollout_func(rollouts: dict):
    """TRL's ``rollout_func``: prompt ``"group-k"`` gets group k's prompt ids and, on its j-th
    occurrence in the call, its j-th completion (TRL repeats each prompt G times)."""
    groups = rollouts["groups"]

    def rollout(prompts, trainer):
        seen: dict[int, int] = {}
        prompt_ids, completion_ids = [], []
        for p in prompts:
            k = int(p.rsplit("-", 1)[1])
            j = seen.get(k, 0)
            seen[k] = j + 1
            prompt_ids.append(list(groups[k]["prompt"]))
            completion_ids.append(list(groups[k]["completions"][j]))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return rollout


def reward(completions, completion_ids=None, **kwargs):
    """A hash of each completion's ids in [0, 1): the same for both paths, not constant."""
    keys = completion_ids if completion_ids is not None else completions
    return [(zlib.crc32(repr(list(k)).encode()) % 1000) / 1000.0 for k in keys]


# ----------------------------------------------------------------------------- model


def save_checkpoint(path: str, config: dict, cuda: bool, dtype) -> tuple[dict, int]:
    """A Qwen3 of ``config`` and the chat tokenizer saved to ``path``; its info, EOS id."""
    import transformers

    from treefx.models.chat import tiny_chat_tokenizer

    tok = tiny_chat_tokenizer()
    dev = "cuda" if cuda else "cpu"
    model = common.hf_model("qwen3", dev=dev, dtype=dtype, on_device=cuda,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                            **config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    info = {"model_type": "qwen3", **config,
            "parameters": sum(p.numel() for p in model.parameters()),
            "dtype": str(dtype).removeprefix("torch."),
            "transformers": transformers.__version__}
    del model
    common.free_memory(None, cuda)
    return info, tok.eos_token_id


# ----------------------------------------------------------------------------- timing


class _Clock:
    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


class _CountingTreeModel:
    """A compiled model that notes the token count of each batch it runs in ``runs``."""

    def __init__(self, tm, runs: list):
        self.tm, self.runs = tm, runs

    def __call__(self, batch):
        self.runs.append((torch.is_grad_enabled(), batch.num_tokens))
        return self.tm(batch)

    def __getattr__(self, name):
        return getattr(self.tm, name)


class _TreefxNotes(logging.Handler):
    """treefx's log lines about its captures during training (``messages``), kept for the
    result; what else the log shows is unchanged."""

    KEEP = ("capturing again", "twin", "whole graph", "regional execution:", "verify", "compiled a")

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        self.others: list = []
        self.logger = logging.getLogger("treefx")
        self.level_before = self.logger.level
        self.propagate_before = self.logger.propagate
        self.logger.addHandler(self)
        if self.logger.getEffectiveLevel() > logging.INFO:
            # INFO lines reach this handler only, warnings the root's handlers (or Python's
            # last resort) as before
            self.logger.setLevel(logging.INFO)
            self.logger.propagate = False
            self.others = [h for h in logging.getLogger().handlers] or [logging.lastResort]

    def emit(self, record):
        text = record.getMessage()
        if len(self.messages) < 40 and any(k in text for k in self.KEEP):
            self.messages.append(text[:600])
            print(f"  treefx: {text[:300]}", flush=True)
        if record.levelno >= logging.WARNING:
            for h in self.others:
                h.handle(record)

    def close(self):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)
        self.logger.propagate = self.propagate_before
        super().close()


def _compile_state(trainer, model) -> dict:
    """What a log-prob call's compile-time breakdown is measured from: Dynamo's timers and
    graph count, the tree model's own timings and first-call check."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    tm = (getattr(trainer, "_tree_models", None) or {}).get(id(model))
    tm = tm[1] if tm is not None and tm[0] is model else None
    rep = getattr(tm, "verification", None)
    return {
        "wall": time.perf_counter(),
        "dynamo_s": sum(compilation_time_metrics.get("_compile.compile_inner", ())),
        "backend_call_s": sum(compilation_time_metrics.get("OutputGraph.call_user_compiler",
                                                          ())),
        "graphs": int(counters["stats"].get("unique_graphs", 0)),
        "timers": {k: sum(v) for k, v in compilation_time_metrics.items()},
        "timings": dict(tm.timings) if tm is not None else {},
        "compilations": tm.num_compilations if tm is not None else 0,
        "check": rep if rep is not None and not isinstance(rep, str) else None,
    }


def _compile_delta(a: dict, b: dict) -> dict:
    """One call's breakdown, from the states before (``a``) and after (``b``)."""
    t = {k: v - a["timings"].get(k, 0.0) for k, v in b["timings"].items()}
    out = {
        "dynamo_trace_s": (b["dynamo_s"] - a["dynamo_s"])
        - (b["backend_call_s"] - a["backend_call_s"]),
        "treefx_passes_s": t.get("passes", 0.0), "backend_compile_s": t.get("compile", 0.0),
        "check_s": t.get("check", 0.0), "new_graphs": b["graphs"] - a["graphs"],
        "tree_compilations": b["compilations"] - a["compilations"],
    }
    timers = {k: v - a["timers"].get(k, 0.0) for k, v in b["timers"].items()}
    # torch.compile's own timers (nested, so they overlap): the largest of this call
    out["torch_timers_s"] = dict(sorted(((k, round(v, 2)) for k, v in timers.items()
                                         if v >= 0.05), key=lambda kv: -kv[1])[:14])
    rep = b["check"] if b["check"] is not a["check"] else None
    if rep is not None:
        stages = dict(getattr(rep, "stage_seconds", {}) or {})
        out["check_stages_s"] = stages
        out["check_oracle_s"] = stages.get("oracle", 0.0) + stages.get("floor", 0.0)
        out["check_tokens"] = rep.num_tokens
    return out


def first_cycle_breakdown(record: dict) -> dict:
    """Where the first cycle's log-prob calls spent their time, by kind (old, ref, loss): wall
    time, Dynamo's trace, treefx's passes, the backend's compilation, the first-call check's
    oracle runs, and the rest (the graphs' runs, host work)."""
    if not record.get("cycles"):
        return {}
    out: dict = {}
    keys = ("wall_s", "dynamo_trace_s", "treefx_passes_s", "backend_compile_s",
            "check_oracle_s", "new_graphs", "tree_compilations")
    for kind, _a, _b, d in record["cycles"][0]["logps"]:
        if d is None:
            continue
        k = out.setdefault(kind, {x: 0 for x in keys} | {"calls": 0})
        k["calls"] += 1
        for x in keys:
            k[x] += d.get(x, 0)
        if "check_stages_s" in d:
            k["check_stages_s"] = d["check_stages_s"]
            k["check_tokens"] = d["check_tokens"]
        if d.get("torch_timers_s"):
            k.setdefault("torch_timers_s", []).append(d["torch_timers_s"])
    for k in out.values():
        k["rest_s"] = k["wall_s"] - sum(k[x] for x in ("dynamo_trace_s", "treefx_passes_s",
                                                      "backend_compile_s", "check_oracle_s"))
    total = {x: sum(k[x] for k in out.values()) for x in keys + ("rest_s", "calls")}
    out["total"] = total
    return out


def timed_class(base, clock: _Clock, record: dict):
    """``base`` (TRL's trainer class or treefx's) with events recorded around its methods into
    ``record["cycles"]`` (one per generation batch); what they compute is unchanged."""
    cycles = record.setdefault("cycles", [])

    class Timed(base):
        def training_step(self, model, inputs, num_items_in_batch=None):
            every = self.args.steps_per_generation * self.num_iterations
            if self._step % every == 0:  # a new generation batch: a new cycle
                self._bench_close_cycle()
                if clock.cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                cycles.append({"wall0": time.perf_counter(), "prep": None, "steps": [],
                               "logps": [], "losses": [],
                               "tree_stats0": dict(getattr(self, "tree_stats", {}) or {}),
                               "dynamo0": common.dynamo_counts()})
            a = clock.mark()
            out = super().training_step(model, inputs, num_items_in_batch)
            cycles[-1]["steps"].append((a, clock.mark()))
            return out

        def _bench_close_cycle(self):
            if not cycles or "wall_s" in cycles[-1]:
                return
            c = cycles[-1]
            if clock.cuda:
                torch.cuda.synchronize()
                c["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            c["wall_s"] = time.perf_counter() - c.pop("wall0")
            c["tree_stats"] = {k: v - c["tree_stats0"].get(k, 0)
                               for k, v in (getattr(self, "tree_stats", {}) or {}).items()}
            c["dynamo"] = common.counts_delta(c.pop("dynamo0"), common.dynamo_counts())

        def _generate_and_score_completions(self, inputs):
            a = clock.mark()
            out = super()._generate_and_score_completions(inputs)
            cycles[-1]["prep"] = (a, clock.mark())
            if "first_batch" not in record:
                record["first_batch"] = {
                    k: out[k].detach().float().cpu() for k in
                    ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                     "old_per_token_logps", "ref_per_token_logps", "advantages")
                    if isinstance(out.get(k), torch.Tensor)}
            return out

        def _get_per_token_logps_and_entropies(self, model, *a, **kw):
            kind = ("loss" if torch.is_grad_enabled() else
                    "ref" if model is self.ref_model else "old")
            first = len(cycles) == 1
            before = _compile_state(self, model) if first else None
            s = clock.mark()
            out = super()._get_per_token_logps_and_entropies(model, *a, **kw)
            e = clock.mark()
            detail = None
            if first:
                if clock.cuda:
                    torch.cuda.synchronize()
                detail = _compile_delta(before, _compile_state(self, model))
                detail["wall_s"] = time.perf_counter() - before["wall"]
                print(f"  first cycle, {kind} log-probs: {detail['wall_s']:.1f} s (trace "
                      f"{detail['dynamo_trace_s']:.1f}, passes {detail['treefx_passes_s']:.1f}, "
                      f"compile {detail['backend_compile_s']:.1f}, check "
                      f"{detail.get('check_oracle_s', 0.0):.1f}; "
                      f"{detail['new_graphs']} new graphs)", flush=True)
            cycles[-1]["logps"].append((kind, s, e, detail))
            return out

        def tree_model(self, model):  # each tree run's token count, by call
            tm = super().tree_model(model)
            return _CountingTreeModel(tm, cycles[-1].setdefault("tree_runs", []))

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
            cycles[-1]["losses"].append(loss.detach().float())
            return loss

    Timed.__name__ = f"Timed{base.__name__}"
    return Timed


def summarize_cycles(record: dict, clock: _Clock, ga: int) -> list[dict]:
    out = []
    for c in record["cycles"]:
        steps = [clock.ms(a, b) for a, b in c["steps"]]
        prep = clock.ms(*c["prep"]) if c["prep"] else 0.0
        calls: dict[str, float] = {}
        for kind, a, b, _ in c["logps"]:
            calls[kind] = calls.get(kind, 0.0) + clock.ms(a, b)
        losses = [float(x) for x in c["losses"]]
        out.append({
            "cycle_ms": sum(steps), "prep_ms": prep, "loss_backward_ms": sum(steps) - prep,
            "micro_batches": len(steps),
            "loss_backward_per_micro_batch_ms": (sum(steps) - prep) / max(1, len(steps)),
            "training_step_ms": steps,
            # the log-prob calls: old and ref (inside prep), loss (the loss's forward only)
            "logprob_calls_ms": calls,
            "wall_s": c.get("wall_s"), "peak_gib": c.get("peak_gib"),
            "micro_batch_losses": losses,
            "step_losses": [sum(losses[i:i + ga]) for i in range(0, len(losses), ga)],
            "tree_stats": c.get("tree_stats"), "dynamo": c.get("dynamo"),
            # (grad, tokens) of each tree run, in order (treefx's path)
            "tree_runs": c.get("tree_runs"),
        })
    return out


# ----------------------------------------------------------------------------- one path


def run_path(name: str, ckpt: str, rollouts: dict, args, cuda: bool, tmp: str,
             reference: dict | None) -> tuple[dict, dict]:
    """Train ``name``'s trainer for 1 + warmup + cycles generation batches; return its result
    and what the other path is compared with (first-batch log-probs, losses, gradients)."""
    import datasets
    import transformers
    import trl

    clock = _Clock(cuda)
    record: dict = {}
    grads: dict = {}
    G, per_device = args.G, args.per_device
    rows = args.groups * G
    ga = rows // per_device
    cycles = 1 + args.warmup + args.cycles
    dtype = "bfloat16" if cuda else "float32"
    config = trl.GRPOConfig(
        output_dir=os.path.join(tmp, name), report_to="none", save_strategy="no",
        logging_steps=10**6, disable_tqdm=True, seed=args.seed, use_cpu=not cuda, bf16=cuda,
        max_steps=cycles * args.iterations, num_generations=G,
        per_device_train_batch_size=per_device, gradient_accumulation_steps=ga,
        steps_per_generation=ga, num_iterations=args.iterations, beta=args.beta,
        max_completion_length=max(len(c) for x in rollouts["groups"] for c in x["completions"]),
        optim="sgd", learning_rate=0.0, max_grad_norm=0.0,  # raw gradients compared
        disable_dropout=True, gradient_checkpointing=True,
        model_init_kwargs={"dtype": dtype, "attn_implementation": "sdpa"})
    dataset = datasets.Dataset.from_list([{"prompt": f"group-{k}"} for k in range(args.groups)])

    class Grads(transformers.TrainerCallback):
        """Each gradient at the first optimizer step: kept (reference path) or compared."""

        def on_pre_optimizer_step(self, a, state, control, model=None, **kw):
            if grads.get("done"):
                return
            norms, errs = {}, {}
            for n, p in model.named_parameters():
                if p.grad is None:
                    continue
                g = p.grad.detach()
                norms[n] = float(g.float().norm())
                if reference is None:
                    grads.setdefault("tensors", {})[n] = g.to("cpu", copy=True)
                elif n in reference["grads"]:
                    r = reference["grads"][n].to(g.device).float()
                    errs[n] = float((g.float() - r).norm() / r.norm().clamp_min(1e-30))
            grads["norms"], grads["errors"], grads["done"] = norms, errs, True

    base = trl.GRPOTrainer
    kwargs = {}
    if name == "treefx":
        from treefx.integrations.trl import TreeGRPOTrainer

        base = TreeGRPOTrainer
        options = dict(args.compile_options)
        if args.verify is not None:
            options["verify"] = args.verify
        kwargs = {"compile_options": options, "keep_groups_together": not args.row_shuffle}
    cls = timed_class(base, clock, record)
    notes = _TreefxNotes() if name == "treefx" else None
    t0 = time.perf_counter()
    trainer = cls(model=ckpt, reward_funcs=reward, args=config, train_dataset=dataset,
                  rollout_func=rollout_func(rollouts), callbacks=[Grads()], **kwargs)
    setup_s = time.perf_counter() - t0
    resting = torch.cuda.memory_allocated() / 2**30 if cuda else None
    print(f"[{name}] {base.__module__}.{base.__name__} built in {setup_s:.1f} s; {cycles} "
          f"cycles of {args.iterations * ga} micro-batches", flush=True)
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        if notes is not None:
            notes.close()
    trainer._bench_close_cycle()
    train_s = time.perf_counter() - t0
    per_cycle = summarize_cycles(record, clock, ga)
    timed = per_cycle[1 + args.warmup:]
    for c in per_cycle:
        for kind in ("old", "ref", "loss"):
            c[f"{kind}_logprobs_ms"] = c["logprob_calls_ms"].get(kind, 0.0)
    med = lambda k: statistics.median(c[k] for c in timed) if timed else None  # noqa: E731
    res = {
        "trainer": f"{base.__module__}.{base.__name__}",
        "setup_s": setup_s, "train_s": train_s, "resting_gib": resting,
        "first_cycle": per_cycle[0],
        "median": {k: med(k) for k in ("cycle_ms", "prep_ms", "loss_backward_ms",
                                         "loss_backward_per_micro_batch_ms", "old_logprobs_ms",
                                         "ref_logprobs_ms", "loss_logprobs_ms", "peak_gib")
                   if timed and timed[0][k] is not None},
        # graphs Dynamo compiled during the timed cycles (0 unless a tree size recompiled)
        "timed_new_graphs": sum((c["dynamo"] or {}).get("unique_graphs", 0) for c in timed),
        "timed_peak_gib": max((c["peak_gib"] for c in timed if c["peak_gib"] is not None),
                              default=None),
        "cycles": per_cycle,
        "first_cycle_breakdown": first_cycle_breakdown(record),
        "grad_norm_first_step": (sum(v * v for v in grads.get("norms", {}).values())) ** 0.5,
        "gradient_checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing",
                                               config.gradient_checkpointing)),
    }
    if name == "treefx":
        res["tree_stats"] = dict(trainer.tree_stats)
        res["compile_options"] = trainer.compile_options
        checks = {}
        for module, tm in trainer._tree_models.values():
            rep = getattr(tm, "verification", None)
            if rep is not None:
                checks["reference" if module is trainer.ref_model else "policy"] = {
                    "passed": rep.passed, "max_abs_logprob_err": rep.max_logprob_error,
                    "max_rel_grad_err": rep.max_grad_error}
        res["first_call_checks"] = checks
        res["treefx_notes"] = notes.messages
    fm = record.get("first_batch", {})
    for_compare = {"first_batch": fm, "grads": grads.pop("tensors", {}),
                   "grad_norms": grads.get("norms", {}), "grad_errors": grads.get("errors", {}),
                   "step_losses": [x for c in per_cycle for x in c["step_losses"]]}
    del trainer
    common.free_memory(None, cuda)
    return res, for_compare


# ----------------------------------------------------------------------------- comparison


def compare(ref: dict, other: dict, tol: dict) -> dict:
    """``other`` (treefx) against ``ref`` (TRL): first-batch log-probs, step losses, gradients."""
    out: dict = {"tolerance": tol}
    a, b = ref["first_batch"], other["first_batch"]
    same = all(k in a and k in b and torch.equal(a[k], b[k])
               for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"))
    out["same_first_batch"] = same
    if same:
        mask = a["completion_mask"] > 0
        for k in ("old_per_token_logps", "ref_per_token_logps"):
            if k in a and k in b:
                d = (a[k] - b[k]).abs()[mask]
                out[k.removesuffix("_per_token_logps") + "_logprob_max_abs_err"] = float(d.max())
                out[k.removesuffix("_per_token_logps") + "_logprob_mean_abs_err"] = float(d.mean())
        if "advantages" in a and "advantages" in b:
            out["advantages_max_abs_err"] = float((a["advantages"] - b["advantages"]).abs().max())
    la, lb = ref["step_losses"], other["step_losses"]
    n = min(len(la), len(lb))
    out["step_losses_trl"], out["step_losses_treefx"] = la[:n], lb[:n]
    out["loss_max_rel_err"] = max((abs(x - y) / max(abs(x), 1e-12)
                                   for x, y in zip(la[:n], lb[:n])), default=None)
    errs = other["grad_errors"]
    if errs:
        worst = max(errs, key=errs.get)
        na, nb = ref["grad_norms"], other["grad_norms"]
        ta = sum(v * v for v in na.values()) ** 0.5
        tb = sum(v * v for v in nb.values()) ** 0.5
        out.update({"grad_params_compared": len(errs), "grad_max_rel_err": errs[worst],
                    "grad_worst_param": worst,
                    "grad_median_rel_err": statistics.median(errs.values()),
                    "grad_norm_trl": ta, "grad_norm_treefx": tb,
                    "grad_norm_rel_err": abs(ta - tb) / max(ta, 1e-30),
                    "grad_rel_err_by_param": errs})
    lp = [v for k, v in out.items() if k.endswith("_logprob_max_abs_err")]
    out["within_tolerance"] = bool(
        same and all(v <= tol["logprob"] for v in lp)
        and out["loss_max_rel_err"] is not None and out["loss_max_rel_err"] <= tol["loss"]
        and errs and out["grad_max_rel_err"] <= tol["grad"])
    return out


def _fmt(x, unit="", digits=1):
    return "–" if x is None else f"{x:,.{digits}f}{unit}"


def report(res: dict) -> str:
    """The side-by-side table (markdown), printed and kept in the result."""
    p = res["paths"]
    t, f = p.get("trl", {}), p.get("treefx", {})
    d = res["data"]

    def row(label, key, unit=" ms", src="median", digits=1):
        a = (t.get(src) or {}).get(key)
        b = (f.get(src) or {}).get(key)
        x = f"{a / b:.2f}×" if a and b else "–"
        return f"| {label} | {_fmt(a, unit, digits)} | {_fmt(b, unit, digits)} | {x} |"

    lines = [
        f"| {res['model']['num_hidden_layers']} layers, {d['groups']} groups × G = {d['G']}, "
        f"{d['rows']} rows | TRL | treefx | TRL / treefx |", "|---|---|---|---|",
        row(f"cycle: prep + {t.get('first_cycle', {}).get('micro_batches', '')} × loss+backward "
            f"(median of {res['args']['cycles']})", "cycle_ms"),
        row("prep: old + reference log-probs, rewards", "prep_ms"),
        row("loss + backward, per micro-batch", "loss_backward_per_micro_batch_ms"),
        row("first cycle (treefx: captures, compiles, first-call check)", "cycle_ms",
            src="first_cycle"),
        row("peak memory, timed cycles", "peak_gib", unit=" GiB", digits=1),
    ]
    lines.append(f"| tokens per pass over the batch: TRL's padded rows / rows' own / trees "
                 f"| {d['trl_padded_tokens']:,} / {d['sequence_tokens']:,} | "
                 f"{d['tree_tokens_per_micro_batch_in_order']:,} (POR "
                 f"{d['por_micro_batch_trees']:.2f}) | bound {d['bound_vs_trl_padded']:.2f}× "
                 f"({d['bound_vs_rows']:.2f}× unpadded) |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default: the shape's 28)")
    add_rollout_args(p)
    p.add_argument("--per-device", type=int, default=16,
                   help="per_device_train_batch_size (rows per micro-batch and per log-prob "
                        "chunk); a multiple of G")
    p.add_argument("--iterations", type=int, default=2, help="num_iterations (GRPO's mu)")
    p.add_argument("--beta", type=float, default=0.04, help="KL coefficient (reference model)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed cycles after the first (default 1; dry run 0)")
    p.add_argument("--cycles", type=int, default=None,
                   help="timed cycles, their median reported (default 3; dry run 1)")
    p.add_argument("--paths", default="trl,treefx", help="which trainers, in this order")
    p.add_argument("--verify", choices=("default", "on", "off"), default="default",
                   help="treefx's first-call check (default: treefx's default, on)")
    p.add_argument("--row-shuffle", action="store_true",
                   help="treefx's path with TRL's row shuffle (keep_groups_together=False) "
                        "instead of whole groups per micro-batch")
    p.add_argument("--compile-options", type=json.loads, default={},
                   help="treefx.compile's keyword arguments for the treefx path, as JSON")
    common.add_run_args(p, "CPU, a tiny float32 Qwen3 and short rollouts; the two paths must "
                           "agree to 1e-5")
    args = p.parse_args(argv)
    cuda = common.use_cuda(args.dry_run)
    if args.dry_run:
        args.context, args.history, args.question, args.completion = 24, "4,16", "2,6", "3,12"
        args.G, args.per_device = 4, 8
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    if args.warmup is None:
        args.warmup = 0 if args.dry_run else 1
    if args.cycles is None:
        args.cycles = 1 if args.dry_run else 3
    args.verify = {"default": None, "on": True, "off": False}[args.verify]
    paths = [x for x in args.paths.split(",") if x]
    if not set(paths) <= set(PATHS):
        p.error(f"--paths: among {PATHS}")
    if args.per_device % args.G or (args.groups * args.G) % args.per_device:
        p.error("--per-device must be a multiple of G and divide groups × G")
    warnings.filterwarnings("ignore")
    common.bump_dynamo_limits()

    import datasets
    import trl

    shape = dict(SHAPES["tiny" if args.dry_run else "qwen3-1.7b"])
    if args.dry_run:
        shape["tie_word_embeddings"] = True  # as Qwen3-1.7B
    full_depth = shape["num_hidden_layers"]
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    dtype = torch.bfloat16 if cuda else torch.float32
    out_path = common.resolve_out(args, "grpo" if args.layers in (None, full_depth)
                                  else f"grpo_{args.layers}layers", cuda)
    res: dict = {"meta": {**common.run_meta(cuda), "trl": trl.__version__,
                          "datasets": datasets.__version__},
                 "args": vars(args), "paths": {}}
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "model")
        t0 = time.perf_counter()
        model_info, eos = save_checkpoint(ckpt, shape, cuda, dtype)
        model_info.update(full_depth=shape["num_hidden_layers"] == full_depth,
                          full_depth_layers=full_depth,
                          checkpoint_s=time.perf_counter() - t0)
        res["model"] = model_info
        rollouts = make_rollouts(args, shape["vocab_size"], eos)
        res["data"] = data_stats(rollouts, args.per_device, args.G)
        d = res["data"]
        print(f"model: qwen3, {shape['num_hidden_layers']} layers (full depth "
              f"{full_depth}), {model_info['parameters'] / 1e9:.2f}B parameters, "
              f"{model_info['dtype']}; data: {d['groups']} groups x G={d['G']}, "
              f"{d['sequence_tokens']:,} tokens in rows ({d['trl_padded_tokens']:,} padded), "
              f"{d['tree_tokens_per_micro_batch_in_order']:,} in micro-batch trees "
              f"(POR {d['por_micro_batch_trees']:.2f})", flush=True)
        common.save_json(res, out_path)
        kept: dict = {}
        for name in paths:
            try:
                r, kept[name] = run_path(name, ckpt, rollouts, args, cuda, tmp,
                                         kept.get("trl") if name == "treefx" else None)
                res["paths"][name] = r
                m = r["median"]
                print(f"[{name}] first cycle {r['first_cycle']['cycle_ms']:,.0f} ms; median "
                      f"cycle {_fmt(m.get('cycle_ms'), ' ms', 0)} (prep "
                      f"{_fmt(m.get('prep_ms'), ' ms', 0)}, loss+backward "
                      f"{_fmt(m.get('loss_backward_per_micro_batch_ms'), ' ms', 0)} per "
                      f"micro-batch); peak {_fmt(r['timed_peak_gib'], ' GiB')}; graphs "
                      f"compiled in timed cycles: {r['timed_new_graphs']}", flush=True)
            except Exception as e:  # keep what ran; the other path still runs
                failed = True
                res["paths"][name] = {"error": f"{type(e).__name__}: {e}",
                                      "traceback": traceback.format_exc()[-6000:]}
                print(f"[{name}] FAILED: {type(e).__name__}: {e}", flush=True)
                common.free_memory(None, cuda)
            common.save_json(res, out_path)
    if "trl" in kept and "treefx" in kept:
        tol = TOL["bfloat16" if cuda else "float32"]
        res["comparison"] = cmp = compare(kept["trl"], kept["treefx"], tol)
        print(f"comparison ({'bf16' if cuda else 'float32'}; tolerance {tol}): old log-probs "
              f"max |err| {_fmt(cmp.get('old_logprob_max_abs_err'), digits=2 if cuda else 8)}"
              f", reference {_fmt(cmp.get('ref_logprob_max_abs_err'), digits=2 if cuda else 8)}"
              f"; step losses max rel err {cmp['loss_max_rel_err']:.2e}; gradients max rel "
              f"err {cmp.get('grad_max_rel_err', float('nan')):.2e} "
              f"({cmp.get('grad_worst_param')}), median "
              f"{cmp.get('grad_median_rel_err', float('nan')):.2e}, norm "
              f"{cmp.get('grad_norm_trl', float('nan')):.4g} vs "
              f"{cmp.get('grad_norm_treefx', float('nan')):.4g}; within tolerance: "
              f"{cmp['within_tolerance']}", flush=True)
    if res["paths"] and all("median" in v for v in res["paths"].values()):
        res["table"] = report(res)
        print(res["table"], flush=True)
    common.save_json(res, out_path)
    print(f"wrote {out_path}", flush=True)
    if args.dry_run and "comparison" in res and not res["comparison"]["within_tolerance"]:
        print("dry run: the two paths differ beyond float32 tolerance", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
