"""Setup shared by the benchmarks: device and backend choice, model builders, synthetic trees,
the oracle comparisons that ``treefx.verify`` cannot express, dynamo counters, argument
helpers and the result writer.

Conventions kept in one place so that every script measures the same way: GPU runs use CUDA,
bf16 where a script times training, and the inductor backend; ``--dry-run`` runs the same code
on the CPU with a tiny float32 model and eager backends, to check the harness without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
from pathlib import Path

import torch

import treefx
from treefx import synth
from treefx.models import enable_activation_checkpointing
from treefx.tools.synth import odd_forest, odd_tree  # noqa: F401  (the checks' trees)

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


def device_name(cuda: bool) -> str:
    return torch.cuda.get_device_name() if cuda else "cpu"


def versions() -> dict:
    """torch, triton, transformers and Python versions (None where not installed)."""
    try:
        import triton
    except ImportError:
        triton = None
    try:
        import transformers
    except ImportError:
        transformers = None
    return {"torch": torch.__version__, "triton": getattr(triton, "__version__", None),
            "transformers": getattr(transformers, "__version__", None),
            "python": platform.python_version()}


def host_cpu() -> str:
    """The host's CPU model and the cores this process may use (compile times depend on
    both: the same GPU kind comes on hosts of different CPUs)."""
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores"


def run_meta(cuda: bool) -> dict:
    """Device, host CPU, versions, date and command line of this run (recorded in every
    result file)."""
    return {"device": device_name(cuda) if cuda else f"cpu ({platform.processor()})",
            "host_cpu": host_cpu(), "cuda": cuda, **versions(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable), "-m",
                                 _module_name(), *sys.argv[1:]])}


def _module_name() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None) or "?"
    return name.removesuffix(".__main__")


def attention_heads(cuda: bool) -> tuple[int, int, int, torch.dtype]:
    """(query heads, KV heads, head width, dtype) the attention benchmarks time: Qwen3-8B's
    in bf16 on the GPU, tiny float32 ones for a dry run on the CPU."""
    return (32, 8, 128, torch.bfloat16) if cuda else (4, 2, 16, torch.float32)


def bump_dynamo_limits(limit: int = 64, accumulated: int | None = 1024) -> None:
    """Room for the graphs a benchmark compiles on purpose (sizes, methods, variants);
    ``accumulated=None`` leaves the accumulated limits as they are."""
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
    try:
        from torch._dynamo.utils import counters
    except Exception:
        return {}
    return {
        "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
        "frames_ok": int(counters["frames"].get("ok", 0)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


def counts_delta(a: dict, b: dict) -> dict:
    return {k: b.get(k, 0) - a.get(k, 0) for k in b}


# ----------------------------------------------------------------------------- arguments and results


def add_run_args(p: argparse.ArgumentParser, dry_run_help: str) -> None:
    """``--out`` and ``--dry-run``, the same in every benchmark."""
    p.add_argument("--out", default=None,
                   help="JSON results (default benchmarks/results/<name>_<date>_<device>.json)")
    p.add_argument("--dry-run", action="store_true", help=dry_run_help)


def default_out(name: str, cuda: bool, dry_run: bool = False) -> str:
    """``benchmarks/results/<name>_<YYYY-MM-DD>_<device>.json`` (a dry run's name ends in
    ``_dryrun``, which git ignores): never the working directory."""
    date = datetime.date.today().isoformat()
    suffix = "_dryrun" if dry_run else ""
    return str(RESULTS / f"{name}_{date}_{device_tag(cuda)}{suffix}.json")


def resolve_out(args, name: str, cuda: bool) -> str:
    if not args.out:
        args.out = default_out(name, cuda, getattr(args, "dry_run", False))
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
    """A Hugging Face causal LM from a config (random weights, seeded), ``attn`` attention
    (SDPA by default).

    ``on_device``: initialise the weights on ``dev`` (the device's random generator) rather
    than on the CPU and move them. ``checkpointing``: ``"reentrant"`` or ``"nonreentrant"`` HF
    gradient checkpointing. ``use_cache``: set on the config when given."""
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


def hf_labels_step(model, batch):
    """An ordinary Hugging Face training step's loss (``labels=``), for ``@treefx.step``."""
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 labels=batch["labels"]).loss


# ----------------------------------------------------------------------------- trees

# synth.agent_tree's default length ranges; multiplied per POR so that each tree has ~12-17k
# unique tokens at scale 1 (the POR-0.75 tree is 17.2k / 68.8k tokens).
LENGTHS = dict(system_len=(150, 400), prompt_len=(30, 200), think_len=(40, 300),
               answer_len=(10, 80), tool_len=(20, 250))
SHAPES = {  # POR: (shape, length multiplier)
    0.3: (dict(rollouts=1, turns=(2, 3)), 8.0),
    0.5: (dict(rollouts=1, turns=(3, 5)), 4.0),
    0.75: (dict(rollouts=4), 1.8),
    0.85: (dict(rollouts=8), 0.6),
}


def scaled_lengths(mult: float) -> dict:
    return {k: (max(1, round(lo * mult)), max(1, round(hi * mult)))
            for k, (lo, hi) in LENGTHS.items()}


def make_tree(por: float, scale: float, vocab: int, seed: int = 0) -> treefx.Tree:
    """A synth agent tree at POR ~ ``por`` (the nearest shape of SHAPES)."""
    key = min(SHAPES, key=lambda k: abs(k - por))
    shape, mult = SHAPES[key]
    err = None
    for s in range(seed, seed + 4):  # another seed if a shape cannot reach the POR
        try:
            return synth.agent_tree(s, vocab_size=vocab, target_por=por, **shape,
                                    **scaled_lengths(mult * scale))
        except ValueError as e:
            err = e
    raise err


def stream_trees(n: int, scale: float, vocab: int) -> list[treefx.Tree]:
    """``n`` trees of different shapes and sizes (~2k-20k tokens at scale 1)."""
    out = []
    for i in range(n):
        mult = (0.4 + 1.6 * ((i * 7) % n) / max(n - 1, 1)) * scale
        out.append(synth.agent_tree(500 + i, vocab_size=vocab, rollouts=1 + i % 4,
                                    **scaled_lengths(mult)))
    return out


def agent_row(n: int, first_seed: int, scale: float = 1.0, vocab: int = 32000):
    """``subtree_end`` of a DFS row of POR-0.75-shaped agent trees (4 rollouts) cut at ``n``
    tokens, ends clipped to ``n`` (still a valid forest layout), and the trees."""
    shape, mult = SHAPES[0.75]
    lengths = {k: (max(1, round(lo * mult * scale)), max(1, round(hi * mult * scale)))
               for k, (lo, hi) in LENGTHS.items()}
    trees, total, i = [], 0, 0
    while total < n:
        t = synth.agent_tree(first_seed + i, vocab_size=vocab, **shape, **lengths)
        trees.append(t)
        total += t.num_tokens
        i += 1
    se = treefx.pack(trees).subtree_end[:n].clamp(max=n).contiguous()
    return se, trees


def check_forest(vocab: int, small: bool = False) -> list[treefx.Tree]:
    """The exactness checks' forest: two odd trees and a synthetic agent tree (6,098 tokens at
    vocab 1024): odd shapes and more than one attention block. ``small``: a few hundred tokens
    (a CPU dry run)."""
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


def tolerance(logprob: float, grad: float, **kw):
    """A ``treefx.verify`` tolerance (``treefx.Tolerance``)."""
    import treefx

    return treefx.Tolerance(logprob=logprob, grad=grad, **kw)


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
    """A training step that is not a ``TreeModel`` (a baseline, ``@treefx.step``) against the
    per-sequence oracle: ``loss`` was just computed and back-propagated, so the model's
    ``.grad`` holds the step's gradients; ``reference`` is :func:`oracle`'s result.
    ``treefx.verify`` checks tree models; this checks anything else that claims the same
    loss."""
    ref_loss, g_ref = reference
    g = grads_of(model)
    return {"loss": float(loss),
            "loss_rel_err": abs(float(loss) - ref_loss) / abs(ref_loss),
            "max_rel_grad_err": max_rel_grad_err(g, g_ref),
            "worst_grad": worst_rel_grad(g, g_ref)}


def oracle_vs_oracle(model, reference, trees, reduction: str = "mean") -> dict:
    """The per-sequence run of ``model`` (e.g. bf16) against that of ``reference`` (e.g. its
    float32 copy): the error a precision has before any tree is involved, beside which a tree
    run's error (``treefx.verify(..., reference=)``) is judged."""
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
