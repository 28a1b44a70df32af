"""Setup shared by the benchmarks: device, run metadata, arguments and results, model builders,
synthetic trees and the oracle comparisons ``treefx.verify`` cannot express. GPU runs use
CUDA and Inductor; ``--dry-run`` runs the same code on the CPU, tiny float32, eager."""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

import treefx
from treefx import synth
from treefx.models import enable_activation_checkpointing
from treefx.tools.synth import odd_forest

RESULTS = Path(__file__).resolve().parent / "results"

# ----------------------------------------------------------------------------- device


def use_cuda(dry_run: bool = False) -> bool:
    """The GPU when there is one and this is not a dry run."""
    return torch.cuda.is_available() and not dry_run


def device_tag(cuda: bool) -> str:
    """Short device name for result files: ``h100``, ``h200``, ... or ``cpu``."""
    if not cuda:
        return "cpu"
    name = torch.cuda.get_device_name()
    m = re.search(r"\b([A-Za-z]+\d+[A-Za-z]*)\b", name)
    return (m.group(1) if m else re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")).lower()


def _version(module: str):
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def run_meta(cuda: bool) -> dict:
    """Device, host CPU (compile times depend on it), versions, date and command line."""
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f
                          if ln.startswith("model name")), model)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    module = (getattr(spec, "name", None) or "?").removesuffix(".__main__")
    return {"device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor()})",
            "host_cpu": f"{model}, {cores} cores", "cuda": cuda, "torch": torch.__version__,
            "triton": _version("triton"), "transformers": _version("transformers"),
            "python": platform.python_version(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable), "-m", module, *sys.argv[1:]])}


def bump_dynamo_limits(limit: int = 64, accumulated: int | None = 1024) -> None:
    """Room for the graphs a benchmark compiles on purpose (``accumulated=None``: kept)."""
    cfg = torch._dynamo.config
    for name, val in (("recompile_limit", limit), ("cache_size_limit", limit),
                      ("accumulated_recompile_limit", accumulated),
                      ("accumulated_cache_size_limit", accumulated)):
        if val is not None and hasattr(cfg, name):
            try:
                setattr(cfg, name, val)
            except Exception:
                pass


def dynamo_counts() -> dict:
    """Dynamo's counters of compiled graphs, frames and graph breaks so far."""
    from torch._dynamo.utils import counters

    return {
        "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
        "frames_ok": int(counters["frames"].get("ok", 0)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


def unique_graphs() -> int:
    """Dynamo's compiled graphs so far."""
    return dynamo_counts().get("unique_graphs", 0)


def counts_delta(a: dict, b: dict) -> dict:
    return {k: b.get(k, 0) - a.get(k, 0) for k in b}


# ----------------------------------------------------------------------------- the one timer


def timed(fn, cuda: bool):
    """Run ``fn()`` once; return (its result, milliseconds). On the GPU the time is between two
    CUDA events recorded around the call, after synchronizing on the second (so it is the GPU's
    time for the call, host overhead included only where the GPU waits for it)."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        return out, start.elapsed_time(end)
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def repeat(fn, reps: int, cuda: bool, warmup: int = 0) -> list[float]:
    """``warmup`` untimed calls, then ``reps`` timed ones (:func:`timed`); milliseconds each."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return [timed(fn, cuda)[1] for _ in range(reps)]


def median_ms(fn, reps: int, cuda: bool, warmup: int = 0) -> float:
    """Median of :func:`repeat`."""
    return statistics.median(repeat(fn, reps, cuda, warmup))


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def is_oom(e: BaseException) -> bool:
    """An out-of-memory error, or one raised from it (Dynamo and treefx wrap what a compiled
    graph raises while it compiles)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
            return True
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    return False


def kernel_runs_delta(before: dict, after: dict) -> dict:
    """``{"name:path": runs}`` taken between two reads of ``ops.recurrence.kernel_runs()``."""
    return {f"{n}:{p}": after[(n, p)] - before.get((n, p), 0) for n, p in after
            if after[(n, p)] != before.get((n, p), 0)}


def free_memory(model, cuda: bool) -> None:
    """The model's gradients dropped, garbage collected, the CUDA cache emptied."""
    if model is not None:
        model.zero_grad(set_to_none=True)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- arguments and results


def add_run_args(p: argparse.ArgumentParser, dry_run_help: str) -> None:
    """``--out`` and ``--dry-run``, the same in every benchmark."""
    p.add_argument("--out", default=None,
                   help="JSON results (default benchmarks/results/<name>_<date>_<device>.json)")
    p.add_argument("--dry-run", action="store_true", help=dry_run_help)


def resolve_out(args, name: str, cuda: bool) -> str:
    """``--out``, or ``benchmarks/results/<name>_<YYYY-MM-DD>_<device>[_dryrun].json``."""
    if not args.out:
        dry = "_dryrun" if getattr(args, "dry_run", False) else ""
        args.out = str(RESULTS / f"{name}_{datetime.date.today()}_{device_tag(cuda)}{dry}.json")
    return args.out


def save_json(res, path: str | None) -> None:
    """Write ``res`` atomically (a run stopped at its time limit leaves the last complete file)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = str(path) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1, default=str)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- models


def hf_model(model_type: str, *, dev: str, dtype=torch.float32, seed: int = 0,
             on_device: bool = False, use_cache: bool | None = None,
             checkpointing: str | None = None, train: bool = False, attn: str = "sdpa",
             **cfg):
    """A Hugging Face causal LM from a config (random weights, seeded), ``attn`` attention;
    ``on_device``: the weights initialised on ``dev``; ``checkpointing``: ``"reentrant"`` or
    ``"nonreentrant"`` HF gradient checkpointing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **cfg)
    config._attn_implementation = attn
    if use_cache is not None:
        config.use_cache = use_cache
    torch.manual_seed(seed)
    if on_device:
        try:
            with torch.device(dev):
                model = AutoModelForCausalLM.from_config(config)
        except Exception:  # a transformers version that does not take the device context
            model = AutoModelForCausalLM.from_config(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    model = model.to(dev, dtype)
    if checkpointing is not None:
        enable_activation_checkpointing(model, use_reentrant=checkpointing == "reentrant")
    if train:
        model.train()
    return model


# ----------------------------------------------------------------------------- several GPUs

# Qwen3 shapes of multi_gpu, grpo and verl_engine
SHAPES = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151936, tie_word_embeddings=False),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1024,
                 tie_word_embeddings=False),
}
# the same, the depth left to ``--layers`` (real_trees, parts_budget, real_trees_flops)
SHAPE_8B = {k: v for k, v in SHAPES["qwen3-8b"].items() if k != "num_hidden_layers"}
TINY = {k: v for k, v in SHAPES["tiny"].items() if k != "num_hidden_layers"}


def hybrid_config(hidden, intermediate, layers, heads, kv_heads, head_dim, k_heads, v_heads,
                  k_dim, vocab) -> dict:
    """A Qwen3-Next config: every fourth layer and the last full attention, dense MLPs."""
    types = ["full_attention" if (i + 1) % 4 == 0 or i == layers - 1 else "linear_attention"
             for i in range(layers)]
    return dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                linear_num_key_heads=k_heads, linear_num_value_heads=v_heads,
                linear_key_head_dim=k_dim, linear_value_head_dim=k_dim,
                linear_conv_kernel_dim=4, layer_types=types, num_experts=0,
                mlp_only_layers=list(range(layers)), vocab_size=vocab,
                tie_word_embeddings=False)


def dist_setup(dry_run: bool) -> torch.device:
    """The process group (NCCL on the GPU, gloo on the CPU; plain ``python``: one process)."""
    import torch.distributed as dist

    cuda = use_cuda(dry_run)
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
    local = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo",
                            device_id=torch.device("cuda", local) if cuda else None)
    return torch.device("cuda", local) if cuda else torch.device("cpu")


def dist_sync(dev) -> None:
    import torch.distributed as dist

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dist.barrier()


def dist_build(model_type: str, config: dict, dev, checkpointing: bool, dtype=torch.float32):
    """:func:`hf_model` on ``dev`` in training mode (the same weights on every rank)."""
    return hf_model(model_type, dev=dev, dtype=dtype, on_device=True, train=True,
                    checkpointing="nonreentrant" if checkpointing else None, **config)


def fsdp_shard(model, mp_policy=None):
    """FSDP2: ``fully_shard`` on every decoder layer and on the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = mp_policy or MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp_policy)
    return fully_shard(model, mp_policy=mp_policy)


def fsdp_qwen3(shape: str, dev, checkpointing: bool, layers: int | None = None,
               vocab_size: int | None = None):
    """A Qwen3 of ``SHAPES[shape]`` sharded by FSDP2, bf16 compute on the GPU."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    config = dict(SHAPES[shape], num_hidden_layers=layers or SHAPES[shape]["num_hidden_layers"])
    if vocab_size:
        config["vocab_size"] = vocab_size
    model = dist_build("qwen3", config, dev, checkpointing)
    low = torch.bfloat16 if dev.type == "cuda" else torch.float32
    fsdp_shard(model, MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32))
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return model


def tree_pool(world: int, tokens: int, por: float, vocab: int, seed: int = 0, **lengths):
    """Synthetic agent trees, the same on every rank: ~``tokens`` a rank, at least two a rank."""
    trees, total, i = [], 0, 0
    while total < world * tokens or len(trees) < 2 * world:
        t = synth.agent_tree(seed=seed + i, vocab_size=vocab, target_por=por, rollouts=2,
                             **lengths)
        trees.append(t)
        total += t.num_tokens
        i += 1
    return trees


# ----------------------------------------------------------------------------- trees

# synth.agent_tree's default length ranges; multiplied per POR so that each tree has ~12-17k
# unique tokens at scale 1 (the POR-0.75 tree is 17.2k / 68.8k tokens).
LENGTHS = dict(system_len=(150, 400), prompt_len=(30, 200), think_len=(40, 300),
               answer_len=(10, 80), tool_len=(20, 250))
POR_SHAPES = {  # POR: (shape, length multiplier)
    0.3: (dict(rollouts=1, turns=(2, 3)), 8.0),
    0.5: (dict(rollouts=1, turns=(3, 5)), 4.0),
    0.75: (dict(rollouts=4), 1.8),
    0.85: (dict(rollouts=8), 0.6),
}


def scaled_lengths(mult: float) -> dict:
    return {k: (max(1, round(lo * mult)), max(1, round(hi * mult)))
            for k, (lo, hi) in LENGTHS.items()}


def make_tree(por: float, scale: float, vocab: int, seed: int = 0) -> treefx.Tree:
    """A synth agent tree at POR ~ ``por`` (the nearest shape of POR_SHAPES)."""
    key = min(POR_SHAPES, key=lambda k: abs(k - por))
    shape, mult = POR_SHAPES[key]
    err = None
    for s in range(seed, seed + 4):  # another seed if a shape cannot reach the POR
        try:
            return synth.agent_tree(s, vocab_size=vocab, target_por=por, **shape,
                                    **scaled_lengths(mult * scale))
        except ValueError as e:
            err = e
    raise err


def check_forest(vocab: int, small: bool = False) -> list[treefx.Tree]:
    """The exactness checks' forest: two odd trees and a synthetic agent tree (6,098 tokens at
    vocab 1024; ``small``: a few hundred tokens, a CPU dry run)."""
    forest = odd_forest(0, vocab)
    if small:
        agent = synth.agent_tree(1, vocab_size=vocab, rollouts=2, **scaled_lengths(0.1))
    else:
        agent = synth.agent_tree(1, vocab_size=vocab, rollouts=3, system_len=(300, 600),
                                 think_len=(50, 400), tool_len=(50, 500))
    return [forest[0], forest[1], agent]


def tiny_forest() -> list[treefx.Tree]:
    """71 tokens: shorter than one 128-token attention block."""
    return [treefx.Tree.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6], [7]]),
            treefx.Tree.from_sequences([[9] * 40, [9] * 20 + [8] * 24])]


# ----------------------------------------------------------------------------- oracle checks


def report_dict(rep) -> dict:
    """The fields of a ``treefx.VerificationReport`` that a result file keeps."""
    return {"passed": rep.passed, "tokens": rep.num_tokens,
            "max_abs_logprob_err": rep.max_logprob_error,
            "max_rel_grad_err": rep.max_grad_error, "worst_param": rep.worst_param,
            "logprob_floor": rep.logprob_floor, "grad_floor": rep.grad_floor,
            "logprob_tolerance": rep.logprob_tolerance, "grad_tolerance": rep.grad_tolerance,
            "params": f"{rep.compared_params}/{rep.total_params}", "seconds": rep.seconds,
            "report": str(rep)}


def max_rel(a: torch.Tensor, r: torch.Tensor, floor: float = 0.0) -> float:
    """``max |a - r| / max(max |r|, floor)`` in float64 (the checks' worst relative error)."""
    a, r = a.detach().double(), r.detach().double()
    return float((a - r).abs().max()) / max(float(r.abs().max()), floor, 1e-30)


def norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (the timings' agreement between two paths)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def grads_of(model) -> dict:
    """The parameters' gradients (float32 copies), then cleared."""
    g = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
         if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return g


def max_rel_grad_err(g: dict, g_ref: dict) -> float:
    """Largest ``|g - g_ref| / |g_ref|`` over the reference's parameters."""
    return max(((g[n] - gr).norm() / gr.norm().clamp_min(1e-30)).item()
               for n, gr in g_ref.items())


def worst_rel_grad(g: dict, g_ref: dict) -> list:
    """``[parameter, relative error]`` of the parameter whose gradient differs most."""
    errs = {n: ((g[n].float() - gr.float()).norm() / gr.float().norm().clamp_min(1e-30)).item()
            for n, gr in g_ref.items()}
    name = max(errs, key=errs.get)
    return [name, errs[name]]


def oracle(model, trees, reduction: str = "mean"):
    """The per-sequence oracle's loss and gradients on ``model`` (``.grad`` cleared after)."""
    model.zero_grad(set_to_none=True)
    ref = treefx.reference.sequence_loss(model, trees, reduction=reduction)
    ref.backward()
    return float(ref.detach()), grads_of(model)


def loss_vs_oracle(model, loss, reference) -> dict:
    """A training step that is not a ``TreeModel`` (a baseline, ``@treefx.step``) against
    :func:`oracle`'s ``reference``: ``loss`` was just back-propagated into ``.grad``."""
    ref_loss, g_ref = reference
    g = grads_of(model)
    return {"loss": float(loss),
            "loss_rel_err": abs(float(loss) - ref_loss) / abs(ref_loss),
            "max_rel_grad_err": max_rel_grad_err(g, g_ref),
            "worst_grad": worst_rel_grad(g, g_ref)}


def oracle_vs_oracle(model, reference, trees, reduction: str = "mean") -> dict:
    """The per-sequence run of ``model`` (e.g. bf16) against that of ``reference`` (its float32
    copy): a precision's own error, beside which a tree run's is judged."""
    lps = treefx.reference.sequence_logprobs(model, trees)
    ref_lps = treefx.reference.sequence_logprobs(reference, trees)
    lp_err = max((lp.float() - r.float()).abs().max().item()
                 for lp, r in zip(lps, ref_lps) if r.numel())
    loss = treefx.reference.sequence_loss(model, trees, reduction=reduction)
    loss.backward()
    g = grads_of(model)
    ref = treefx.reference.sequence_loss(reference, trees, reduction=reduction)
    ref.backward()
    g_ref = grads_of(reference)
    return {"tokens": treefx.pack(trees).num_tokens, "max_abs_logprob_err": lp_err,
            "loss_rel_err": abs(loss.item() - ref.item()) / abs(ref.item()),
            "max_rel_grad_err": max_rel_grad_err(g, g_ref),
            "worst_grad": worst_rel_grad(g, g_ref)}
