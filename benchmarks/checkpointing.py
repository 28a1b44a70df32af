"""Activation checkpointing under treefx on the GPU: exact through the inductor backend, what
it saves, and what the first-call verification costs.

    python -m benchmarks.checkpointing --parts exact,memory   # GPU
    python -m benchmarks.checkpointing --dry-run              # CPU, eager, tiny sizes

Parts (each runs even if another fails; failures are recorded with their traceback):
- ``exact``: HF Qwen3 (non-reentrant and reentrant gradient checkpointing) and Qwen3-Next
  (non-reentrant), float32 with TF32 off, and the pure-torch decoder with a selective policy:
  ``treefx.verify`` through the inductor backend on the probe forest (more than two attention
  blocks) and on a synthetic agent tree, values and every gradient. Qwen3 in bf16 too, with
  the bf16 tolerance.
- ``memory``: a Qwen3-8B-shaped stack (hidden 4096, 32 heads, 8 KV heads, head_dim 128,
  intermediate 12288, vocab 151,936, ``--layers`` layers, bf16) on a POR-0.75 agent tree of
  ~17k tokens: one ``@treefx.step`` training step (HF labels, fused loss) with and without HF
  gradient checkpointing: peak memory, median step time, first-call (compile) time, and the
  cost of ``treefx.verify`` (sampled parameters) on the same model.
- ``verify``: the first-call check alone on the same stack (bf16, with and without
  checkpointing): its verdict against the oracle's own floor, its time beside the compile's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback

import torch

import treefx
from treefx.models import tiny_decoder

from . import common
from .common import hf_labels_step, make_tree
from .timing import timed

# Set by configure(): CUDA and inductor on the GPU; the CPU and eager in a dry run.
CUDA = False
DEV = "cpu"
BACKEND = "eager"


def configure(cuda: bool) -> None:
    global CUDA, DEV, BACKEND
    CUDA = cuda
    DEV = "cuda" if cuda else "cpu"
    BACKEND = "inductor" if cuda else "eager"


def hf_model(model_type, dtype, ckpt: str | None, seed=0, **cfg):
    """HF model in training mode, with HF gradient checkpointing ``ckpt`` (None: off)."""
    return common.hf_model(model_type, dev=DEV, dtype=dtype, seed=seed, use_cache=False,
                           checkpointing=ckpt, train=True, **cfg)


def small(dry: bool) -> dict:
    if dry:
        return dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4, head_dim=32)


# Dense MLPs, as gpu_check and e2e use: with transformers 5.17 and torch 2.11, HF's
# grouped_mm fallback for MoE experts guards on a data-dependent size in its backward under
# AOTAutograd (GuardOnDataDependentSymNode in _grouped_mm_fallback_backward), whatever treefx
# does; the CPU tests cover Qwen3-Next's MoE.
NEXT = dict(layer_types=None, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
            num_experts=0, mlp_only_layers=[0, 1, 2, 3])


def regions(tm) -> int:
    return sum(c.body is not None for ctx in tm.contexts for c in ctx.scopes())


def verify_case(model, trees, tol=None) -> dict:
    tm = treefx.compile(model, backend=BACKEND, verify=False)
    out = {}
    for name, forest in (("probe", None), ("agent", trees)):
        r = treefx.verify(tm, forest, tolerance=tol, raise_on_failure=False)
        out[name] = dict(passed=r.passed, tokens=r.num_tokens, logprob_err=r.max_logprob_error,
                         grad_err=r.max_grad_error, worst_param=r.worst_param,
                         params=r.compared_params, seconds=r.seconds)
        print(f"  {name}: {r}", flush=True)
    out["checkpointed_regions"] = regions(tm)
    return out


class Checkpointed(torch.nn.Module):
    def __init__(self, layer, **kwargs):
        super().__init__()
        self.layer, self.kwargs = layer, kwargs

    def forward(self, *args):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.layer, *args, **self.kwargs)


def _save_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    if op in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def part_exact(args) -> dict:
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = small(args.dry_run)
    agent = make_tree(0.75, 0.03 if args.dry_run else 0.4, cfg["vocab_size"], seed=3)
    print(f"agent tree: {agent}", flush=True)
    results = {}
    cases = {
        "qwen3-fp32-nonreentrant": lambda: hf_model("qwen3", torch.float32, "nonreentrant", **cfg),
        "qwen3-fp32-reentrant": lambda: hf_model("qwen3", torch.float32, "reentrant", **cfg),
        "qwen3-next-fp32-nonreentrant": lambda: hf_model(
            "qwen3_next", torch.float32, "nonreentrant",
            **{**cfg, **NEXT, "layer_types": ["linear_attention", "full_attention"] * (
                cfg["num_hidden_layers"] // 2)}),
        "decoder-fp32-selective": lambda: _selective(cfg, create_selective_checkpoint_contexts,
                                                     functools),
        "qwen3-bf16-nonreentrant": lambda: hf_model("qwen3", torch.bfloat16, "nonreentrant",
                                                    **cfg),
    }
    for name, make in cases.items():
        print(f"{name}:", flush=True)
        try:
            model = make()
            # bf16: verify's default for the model's dtype (its bf16 tolerance)
            tol = None if "bf16" in name else common.tolerance(1e-4, 1e-3)
            results[name] = verify_case(model, [agent], tol)
        except Exception as e:  # noqa: BLE001 - record and go on
            results[name] = {"error": f"{type(e).__name__}: {e}", "traceback":
                             traceback.format_exc()}
            print(f"  FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        finally:
            torch.cuda.empty_cache() if CUDA else None
    return results


def _selective(cfg, make_contexts, functools):
    torch.manual_seed(0)
    m = tiny_decoder(vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"],
                     n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
                     n_kv_heads=cfg["num_key_value_heads"]).to(DEV)
    policy = functools.partial(make_contexts, _save_matmuls)
    m.layers = torch.nn.ModuleList(Checkpointed(layer, use_reentrant=False, context_fn=policy)
                                   for layer in m.layers)
    return m


def part_memory(args) -> dict:
    if args.dry_run:
        shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        scale = 0.03
    else:
        shape = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128)
        scale = 1.0
    tree = make_tree(0.75, scale, shape["vocab_size"], seed=0)
    batch = treefx.pack(tree, reduction="mean")
    print(f"tree: {tree}", flush=True)
    results = {"tree": dict(tokens=tree.num_tokens, baseline=tree.num_baseline_tokens,
                            por=tree.por), "layers": args.layers}
    for ckpt in (None, "nonreentrant"):
        name = f"ckpt-{ckpt or 'off'}"
        print(f"{name}:", flush=True)
        try:
            model = hf_model("qwen3", torch.bfloat16 if CUDA else torch.float32, ckpt,
                             num_hidden_layers=args.layers, **shape)
            step = treefx.step(hf_labels_step, backend=BACKEND)
            b = batch.to(DEV)
            if CUDA:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            step(model, b).backward()
            first = time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
            times, peaks = [], []
            for _ in range(args.reps):
                if CUDA:
                    torch.cuda.reset_peak_memory_stats()
                _, ms = timed(lambda: step(model, b).backward(), CUDA)
                times.append(ms)
                peaks.append(torch.cuda.max_memory_allocated() / 2**30 if CUDA else 0.0)
                model.zero_grad(set_to_none=True)
            r = dict(first_call_s=first, step_ms=statistics.median(times),
                     peak_gib=max(peaks), regions=regions(step))
            # The first-call check of treefx.compile, on this model: sampled parameters.
            tm = treefx.compile(model, backend=BACKEND, verify=False)
            probe = treefx.pack(treefx.probe_forest(
                shape["vocab_size"], min_tokens=2 * tm.engine.block_size + 1)).to(DEV)
            tm(probe)  # compiles the graph the check runs through, outside its timing
            t0 = time.perf_counter()
            # the default tolerance for the model's dtype
            rep = treefx.verify(tm, params="sample", raise_on_failure=False)
            r["verify"] = dict(seconds=time.perf_counter() - t0, passed=rep.passed,
                               logprob_err=rep.max_logprob_error, grad_err=rep.max_grad_error,
                               params=f"{rep.compared_params}/{rep.total_params}",
                               tokens=rep.num_tokens)
            results[name] = r
            print(f"  {r}", flush=True)
            model = step = tm = None  # free the memory before the next variant
        except Exception as e:  # noqa: BLE001
            results[name] = {"error": f"{type(e).__name__}: {e}",
                             "traceback": traceback.format_exc()}
            print(f"  FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        finally:
            if CUDA:
                torch.cuda.empty_cache()
    return results


def part_verify(args) -> dict:
    """The first-call check on the 8B-shaped stack (bf16): its verdict with the oracle's
    floor, and its cost beside the first call's compile."""
    if args.dry_run:
        shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    else:
        shape = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    out = {}
    for ckpt in (None, "nonreentrant"):
        name = f"ckpt-{ckpt or 'off'}"
        try:
            model = hf_model("qwen3", torch.bfloat16 if CUDA else torch.float32, ckpt,
                             num_hidden_layers=args.layers, **shape)
            tm = treefx.compile(model, backend=BACKEND, verify=False)
            probe = treefx.pack(treefx.probe_forest(
                shape["vocab_size"], min_tokens=2 * tm.engine.block_size + 1)).to(DEV)
            t0 = time.perf_counter()
            tm(probe)
            compile_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            rep = treefx.verify(tm, params="sample", raise_on_failure=False)
            out[name] = dict(compile_s=compile_s, verify_s=time.perf_counter() - t0,
                             report=str(rep), passed=rep.passed,
                             logprob_err=rep.max_logprob_error, logprob_floor=rep.logprob_floor,
                             grad_err=rep.max_grad_error, grad_floor=rep.grad_floor,
                             params=f"{rep.compared_params}/{rep.total_params}")
            print(f"{name}: compile {compile_s:.1f} s, verify {out[name]['verify_s']:.1f} s: "
                  f"{rep}", flush=True)
            del model, tm
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        finally:
            if CUDA:
                torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.checkpointing",
                                description=__doc__.split("\n")[0])
    common.add_run_args(p, "CPU, eager backend, tiny sizes")
    p.add_argument("--parts", default="exact,memory")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    if args.dry_run:
        args.layers, args.reps = 2, 1
    configure(common.use_cuda(args.dry_run))
    common.resolve_out(args, "checkpointing", CUDA)
    out = {**common.run_meta(CUDA), "backend": BACKEND, "argv": sys.argv[1:]}
    for part in args.parts.split(","):
        out[part] = {"exact": part_exact, "memory": part_memory,
                     "verify": part_verify}[part](args)
        common.save_json(out, args.out)
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
