"""Device stages: the benchmark runs behind BENCHMARKS.md's GPU figures, by name, each one call
of a GPU machine (benchmarks/README.md, "Device stages", lists them and what they carry)."""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

SHAPE = "--hidden 4096 --heads 32 --kv-heads 8 --vocab 151936 --por 0.75 --stream 0 --mask-reps 0"
E2E = f"benchmarks.e2e {SHAPE} --layers 4"
L36 = f"benchmarks.e2e {SHAPE} --layers 36 --scale 0.25 --warmup 1 --reps 3"
SWE = "benchmarks.real_trees --trees .data/swe200.jsonl --sample 40 --seed 0"
ONE_THREAD = {"OMP_NUM_THREADS": "1", "TREEFX_VERIFY": "0"}
FLEX = {"TREEFX_CUDNN_ATTENTION": "0"}
NEXT = "benchmarks.e2e --layers 4 --por 0.75 --quick --stream 0 --mask-reps 0 --arch"
MG = ("benchmarks.multi_gpu --trees .data/swe200.jsonl --tasks 8 --max-sequence-tokens 200000")
SCALE = f"{MG} --layers 8 --budget 32768 --steps 2"
CUDNN_SITE = "/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages"


@dataclass(frozen=True)
class Step:
    """One benchmark run: ``args`` after ``python -m`` (``nproc``: under torchrun instead),
    ``limit`` seconds, ``cache``: None the machine's compile caches, ``"fresh"`` empty ones,
    another name a folder the stage's steps of that name share (a restart with warm caches)."""
    name: str
    args: str
    limit: int
    env: dict = field(default_factory=dict)
    gpus: str = "0"
    cache: str | None = None
    nproc: int = 0
    port: int = 29500
    out: bool = True


@dataclass(frozen=True)
class Stage:
    what: str
    was: str
    phases: tuple
    needs: tuple = ()
    gpus: int = 1


def stage(what, was, *steps, needs=(), gpus=1, then=()):
    return Stage(what, was, (tuple(steps),) + ((tuple(then),) if then else ()), tuple(needs),
                 gpus)


def cold(name, args, limit, **kw):
    return Step(name, args, limit, cache="fresh", **kw)


STAGES = {
    "dense": stage(
        "8B-shaped layers x4 on cuDNN's interval kernels: gpu_check's intervals case, the "
        "attention alone, the e2e step against packing profiled (empty caches)",
        "cudnn_check.sh z48a ([e2e-15], [att-1], [ex-7])",
        Step("gpu_check_intervals", "benchmarks.gpu_check --cases intervals", 150),
        Step("chain_attention", "benchmarks.chain_attention --seeds 0", 120),
        cold("e2e_dense", f"{E2E} --warmup 2 --reps 5 --profile --methods treefx,packed", 300),
        needs=("cudnn",)),
    "dense-paths": stage(
        "the same step, logits=False and @treefx.step on the kernels, then FlexAttention's "
        "sites in the next process", "cudnn_check.sh z48b ([e2e-16])",
        cold("e2e_paths_on", f"{E2E} --warmup 2 --reps 5 "
             "--methods treefx,treefx_nologits,treefx_step", 330),
        cold("e2e_paths_off", f"{E2E} --warmup 2 --reps 5 --methods treefx", 200, env=FLEX),
        needs=("cudnn",)),
    "flex": stage(
        "FlexAttention's sites (no frontend): the output layer's paths, the step of every path "
        "beside packing profiled", "speed_check.sh z37 ([e2e-13], [lp-9]; logprobs' "
        "--profile retired in issue 67)",
        Step("logprobs_paths", "benchmarks.logprobs --paths 17187 --reps 10", 200),
        cold("e2e_steps", f"{E2E} --warmup 2 --reps 5 --profile "
             "--methods treefx,treefx_nologits,treefx_step,packed", 330)),
    "logprobs": stage(
        "the log-prob kernels against float64, the output layer's paths, the step of the three "
        "loss paths", "speed_check.sh z38 ([lp-8], [e2e-14]; logprobs' --profile retired in "
        "issue 67)",
        Step("logprobs_check", "benchmarks.logprobs --check-from-logits", 120, out=False),
        Step("logprobs_paths", "benchmarks.logprobs --paths 17187 --reps 10", 200),
        cold("e2e_steps", f"{E2E} --warmup 2 --reps 5 "
             "--methods treefx,treefx_nologits,treefx_step", 300)),
    "first-step": stage(
        "gpu_check's intervals case, first steps with empty caches as "
        "shipped: 4 layers, then 36 (a quarter of the tree)",
        "cudnn_check.sh z51b ([e2e-25])",
        Step("gpu_check_intervals", "benchmarks.gpu_check --cases intervals", 170),
        cold("e2e_first", f"{E2E} --warmup 2 --reps 5 --methods treefx", 150),
        cold("e2e_first_l36", f"{L36} --methods treefx", 200),
        needs=("cudnn",)),
    "first-step-flex": stage(
        "first steps with empty caches, 4 and 36 layers, on the kernels, then both on "
        "FlexAttention's sites, same host", "cudnn_check.sh z49i ([e2e-22])",
        *[cold(f"e2e_first{s}_{k}", f"{a} --methods treefx", t, env=env)
          for k, env in (("cudnn", {}), ("flex", FLEX))
          for s, a, t in (("", f"{E2E} --warmup 1 --reps 3", 150), ("_l36", L36, 200))],
        needs=("cudnn",)),
    "restart": stage(
        "a first step with empty caches, the same job restarted with the caches it left, then "
        "36 layers (treefx, logits=False)", "cudnn_check.sh z48e ([e2e-18])",
        Step("e2e_first", f"{E2E} --warmup 1 --reps 3 --methods treefx", 150, cache="job"),
        Step("e2e_restart", f"{E2E} --warmup 1 --reps 3 --methods treefx", 120, cache="job"),
        cold("e2e_l36", f"{L36} --methods treefx,treefx_nologits", 240),
        needs=("cudnn",)),
    "swe": stage(
        "gpu_check's trunk case; issue 34's 14 SWE tasks (budget 65,536, one CPU thread, 7 "
        "timed treefx steps) against packing, then treefx with the trunk split off",
        "speed_check.sh z42 (the SWE section's headline)",
        Step("gpu_check_trunk", "benchmarks.gpu_check --cases trunk", 150,
             env={"PYTHONFAULTHANDLER": "1"}),
        Step("real_trees_swe14", f"{SWE} --budget 65536 --slice 0:14 --methods treefx,packing "
             "--warmup 2 --reps 7 --time-limit 240", 260, env=ONE_THREAD),
        Step("real_trees_swe14_trunk_off", f"{SWE} --budget 65536 --slice 0:14 --methods "
             "treefx --warmup 2 --reps 7 --time-limit 140", 150,
             env={**ONE_THREAD, "TREEFX_TRUNK_ATTENTION": "0"}),
        needs=("swe",)),
    "swe-cudnn": stage(
        "the 14 SWE tasks with both sides on cuDNN's interval kernels",
        "cudnn_check.sh z50b", Step(
            "real_trees_swe14_intervals", f"{SWE} --budget 65536 --slice 0:14 --methods "
            "treefx,packing --warmup 2 --reps 7 --time-limit 520", 560, env=ONE_THREAD),
        needs=("cudnn", "swe")),
    "parts16k": stage(
        "7 SWE tasks in parts of 16,384 tokens, treefx alone, the trunk split on then off",
        "speed_check.sh z47", *[Step(
            f"real_trees_swe7_parts16k_{k}", f"{SWE} --budget 16384 --slice 0:7 --methods "
            "treefx --warmup 2 --reps 5 --time-limit 220", 230,
            env={**ONE_THREAD, "TREEFX_TRUNK_ATTENTION": v}) for k, v in (("on", "1"),
                                                                       ("off", "0"))],
        needs=("swe",)),
    "exactness": stage(
        "gpu_check's dense cases against the per-sequence oracle", "speed_check.sh z39 ([ex-6]; its "
        "small-trees, mistral-window, step-fp32 and regional cases retired in issue 67)",
        Step("gpu_check", "benchmarks.gpu_check --cases qwen3-fp32,qwen3-bf16,inference,"
             "short-rows --err-dir {out}/err", 540)),
    "families": stage(
        "gpu_check's intervals and families cases, then the e2e step profiled on the kernels",
        "cudnn_check.sh z50a without interval_host ([e2e-23])",
        Step("gpu_check", "benchmarks.gpu_check --cases intervals,families", 200),
        cold("e2e_profile", f"{E2E} --warmup 2 --reps 5 --profile --methods treefx", 150),
        needs=("cudnn",)),
    "fla": stage(
        "hybrids on fla: fla_check then e2e Qwen3.5 (GPU 0), e2e Qwen3-Next (GPU 1), the tree "
        "recurrence's state pass and exactness (GPU 2)",
        "speed_check.sh b's GPUs 0-1 ([fla-1]) and z23 ([fla-34]; its Triton cache "
        "from .cache/triton when carried; its timing case retired in issue 67)",
        Step("fla_check", "benchmarks.fla_check", 330),
        Step("e2e_qwen3_5", f"{NEXT} qwen3_5", 240),
        Step("e2e_qwen3_next", f"{NEXT} qwen3_next", 560, gpus="1"),
        Step("fla_tree_check", "benchmarks.fla_check --cases state,exact "
             "--dtypes bfloat16 --value-heads 32", 560, gpus="2"),
        needs=("fla",), gpus=3),
    "grpo": stage(
        "TRL's GRPO step with and without treefx", "speed_check.sh b's GPU 2 ([grpo-1])",
        Step("grpo", "benchmarks.grpo", 560), needs=("grpo",)),
    "grpo-first-cycle": stage(
        "issue 65: TRL's first cycle, both trainers at the tree trainer's defaults (TRL's row "
        "shuffle), then the treefx path with whole groups", "grpo_first_cycle.sh a (2026-12-05)",
        Step("grpo_a", "benchmarks.grpo --row-shuffle", 320, cache="fresh"),
        Step("grpo_g", "benchmarks.grpo --paths treefx", 200, cache="fresh"), needs=("grpo",)),
    "grpo-no-grad-graph": stage(
        "issue 65: the treefx path's old and reference log-probs on the policy's training graph "
        "(the default since 2026-12-05, one capture) against a no-grad graph of their own "
        "(TREEFX_SHARE_NO_GRAD=0): first cycle and the timed cycles' no-grad calls",
        "(new, 2026-12-05; not yet run)",
        Step("grpo_share", "benchmarks.grpo --paths treefx --row-shuffle", 280, cache="fresh"),
        Step("grpo_noshare", "benchmarks.grpo --paths treefx --row-shuffle", 280, cache="fresh",
             env={"TREEFX_SHARE_NO_GRAD": "0"}), needs=("grpo",)),
    "verl-engine": stage(
        "issue 65: verl 0.9.1's engine update and compute_log_prob, treefx's engine against "
        "verl's with FlexAttention and with SDPA", "(new, 2026-12-05; not yet run through)",
        Step("verl_engine", "benchmarks.verl_engine --engines treefx,verl-flex,verl", 500,
             cache="fresh"), needs=("verl",)),
    "parts-budget": stage(
        "issue 66's table at 4 layers: three SWE tasks whole, at half and a quarter of their "
        "tokens and at a max_memory budget, recompute and host parts, against packing",
        "parts-7 (recompute parts only, 2026-12-05)",
        Step("parts_budget_4", "benchmarks.parts_budget --trees .data/swe_issue66.jsonl "
             "--layers 4 --packing --beyond recompute,host", 540,
             env={"TREEFX_VERIFY": "0"})),
    "parts-budget-late": stage(
        "issue 66: the 4-layer table's rows again with TREEFX_PART_LOSS_GRAD_LATE=1 (each part's "
        "output-weight gradient made in its backward): step and peak against parts-budget's",
        "(new, 2026-12-05, fifth session; not yet run)",
        Step("parts_budget_4_late", "benchmarks.parts_budget --trees .data/swe_issue66.jsonl "
             "--layers 4 --configs whole,half,quarter,memory", 400,
             env={"TREEFX_VERIFY": "0", "TREEFX_PART_LOSS_GRAD_LATE": "1"})),
    "parts-budget-36": stage(
        "issue 66's table at 36 layers with checkpointing: issue 66's SWE task whole, at half "
        "and a quarter, recompute and host parts, and what whole and half hold at their peaks",
        "(new, 2026-12-05; not yet run)",
        Step("parts_budget_36", "benchmarks.parts_budget --trees .data/swe_issue66.jsonl "
             "--tasks 1 --layers 36 --checkpointing --configs whole,half,quarter --beyond "
             "recompute,host --reps 1 --breakdown whole,half", 540,
             env={"TREEFX_VERIFY": "0"})),
    "multi-gpu": stage(
        "FSDP2 scaling on 8 SWE trees, 8 Qwen3-8B-shaped layers: one GPU (treefx) and two at "
        "once, then four", "x4_check.sh d ([mg-14])",
        Step("multi_gpu_l8_x1", f"{SCALE} --methods treefx --time-limit 150", 200, nproc=1,
             port=29501),
        Step("multi_gpu_l8_x2", f"{SCALE} --time-limit 220", 260, gpus="1,2", nproc=2,
             port=29502),
        then=[Step("multi_gpu_l8_x4", f"{SCALE} --time-limit 200", 260, gpus="0,1,2,3",
                   nproc=4, port=29503)], needs=("swe",), gpus=4),
    "multi-gpu-8b": stage(
        "the full-depth Qwen3-8B on four GPUs, then multi_gpu --check's hybrid speed case on "
        "two", "x4_check.sh g ([mg-16])",
        Step("multi_gpu_8b_x4", f"{MG} --shape qwen3-8b --budget 32768 --steps 1 --grad-sync "
             "every --time-limit 240", 320, gpus="0,1,2,3", nproc=4, port=29502),
        then=[Step("distributed_check_hybrid_speed", "benchmarks.multi_gpu --check --cases "
                   "fsdp-hybrid-speed --time-limit 150", 170, gpus="0,1", nproc=2,
                   port=29506)], needs=("swe",), gpus=4),
    "distributed": stage(
        "multi_gpu --check on two GPUs: exactness (FSDP2 hybrid, DDP) and speed cases",
        "x4_check.sh e's GPUs 0-1 ([mg-15])",
        Step("distributed_check", "benchmarks.multi_gpu --check --time-limit 470", 570,
             gpus="0,1", nproc=2, port=29505), gpus=2),
}


# ----------------------------------------------------------------------------- running

def command(step: Step, out: str, caches: dict, mkdir=tempfile.mkdtemp) -> tuple[list, dict]:
    """One step's argument list and environment additions (``{out}``: the output folder)."""
    args = shlex.split(step.args.replace("{out}", out)) + (
        ["--out", os.path.join(out, step.name + ".json")] if step.out else [])
    head = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={step.nproc}",
             f"--master_port={step.port}", "-m"] if step.nproc else [sys.executable, "-m"])
    env = {"CUDA_VISIBLE_DEVICES": step.gpus, "PYTHONUNBUFFERED": "1", **step.env}
    if step.cache is not None:
        if step.cache == "fresh" or step.cache not in caches:
            caches[step.cache] = mkdir()
        d = caches[step.cache]
        env.update(TORCHINDUCTOR_CACHE_DIR=f"{d}/inductor", TRITON_CACHE_DIR=f"{d}/triton",
                   FLEX_ATTENTION_CUTE_DSL_CACHE_DIR=f"{d}/cute")
    return head + args, env


def shell_line(argv: list[str], env: dict, limit: int) -> str:
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [f"timeout {limit}"]
                    + ["python" if a == sys.executable else shlex.quote(a) for a in argv])


def lanes(phase) -> list[list[Step]]:
    """A phase's steps by GPUs, in order: each lane runs one after another, lanes together."""
    by = {}
    for s in phase:
        by.setdefault(s.gpus, []).append(s)
    return list(by.values())


def run_step(argv: list[str], env: dict, limit: int, log: str) -> tuple[int, float]:
    """Run one step with its time limit, output into ``log``; (exit status, seconds)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(argv, env={**os.environ, **env}, stdout=f,
                                stderr=subprocess.STDOUT, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    with open(log) as f:  # Inductor's warnings about sympy's pow_by_natural: noise
        kept = [line for line in f if "pow_by_natural" not in line]
    with open(log, "w") as f:
        f.writelines(kept)
    return rc, time.perf_counter() - t0


def prepare(needs, env: dict) -> None:
    """Install or check what the stage needs (``env`` gains the paths to put first)."""
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir"]
    paths = []
    if "cudnn" in needs:
        os.makedirs("/tmp/stage", exist_ok=True)
        for piece in glob.glob(".whl/wpart_*"):
            shutil.copy(piece, "/tmp/stage/")
        pieces = sorted(glob.glob("/tmp/stage/wpart_*"))
        if len(pieces) == 3:
            with open("/tmp/stage/w.tar", "wb") as w:
                for p in pieces:
                    with open(p, "rb") as f:
                        shutil.copyfileobj(f, w)
            subprocess.run(["tar", "xf", "w.tar"], cwd="/tmp/stage", check=True)
            for p in pieces + ["/tmp/stage/w.tar"]:
                os.remove(p)
            shutil.rmtree("/tmp/site", ignore_errors=True)
            subprocess.run(pip + ["--target", "/tmp/site", *glob.glob("/tmp/stage/*.whl")],
                           check=True)
        if not os.path.isdir("/tmp/site/cudnn"):
            raise SystemExit(f"the cuDNN frontend is not installed: {len(pieces)} of 3 pieces "
                             "staged in /tmp/stage (carry the next .whl/wpart_* piece)")
        paths.append(CUDNN_SITE)
    if "fla" in needs:
        subprocess.run(pip + glob.glob(".whl/fla/*.whl"), check=True)
        if os.path.isdir(".cache/triton"):  # fla's autotuning choices carried (minutes saved)
            env["TRITON_CACHE_DIR"] = os.path.abspath(".cache/triton")
    if "grpo" in needs:
        subprocess.run(pip + ["--target", "/tmp/grpo", *glob.glob(".whl/grpo/*.whl")],
                       check=True)
        paths.append("/tmp/grpo")
    if "verl" in needs:
        # verl 0.9.1 and what it imports that the machine lacks, and ray pruned
        # (benchmarks/README.md says how both are made)
        subprocess.run(pip + ["--target", "/tmp/verl", *glob.glob(".whl/verl/*.whl")],
                       check=True)
        subprocess.run(["tar", "xzf", ".whl/verl/ray-pruned.tar.gz", "-C", "/tmp/verl"],
                       check=True)
        paths.append("/tmp/verl")
    if "swe" in needs and not os.path.isfile(".data/swe200.jsonl"):
        raise SystemExit(".data/swe200.jsonl is missing (carry it)")
    if paths:
        env["PYTHONPATH"] = ":".join(paths + [os.environ.get("PYTHONPATH", "")]).rstrip(":")


def run(name: str, out: str, runner=run_step, dry: bool = False) -> dict:
    """Run stage ``name`` into ``out``: its phases in order, each phase's lanes at once."""
    st = STAGES[name]
    base: dict = {}
    if not dry:
        prepare(st.needs, base)
    caches: dict = {}
    mkdir = (lambda: f"$TMP/{len(caches)}") if dry else tempfile.mkdtemp
    rows, lock = [], threading.Lock()
    res = {"stage": name, "what": st.what, "was": st.was, "steps": rows}

    def lane(steps):
        for s in steps:
            argv, env = command(s, out, caches, mkdir)
            env = {**base, **env}
            row = {"name": s.name, "command": shell_line(argv, env, s.limit), "gpus": s.gpus}
            if dry:
                print(row["command"])
            else:
                rc, secs = runner(argv, env, s.limit, os.path.join(out, s.name + ".log"))
                row.update(rc=rc, seconds=round(secs, 1), timed_out=rc == 124)
                print(f"{s.name} rc={rc} {secs:.0f} s", flush=True)
            with lock:
                rows.append(row)

    for phase in st.phases:
        groups = lanes(phase)
        if dry:  # printed in order, lane by lane
            for g in groups:
                lane(g)
            continue
        threads = [threading.Thread(target=lane, args=(g,)) for g in groups]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if not dry:
        with open(os.path.join(out, f"stage_{name}.json"), "w") as f:
            json.dump(res, f, indent=1)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.stages",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("stage", nargs="?", choices=sorted(STAGES))
    p.add_argument("--list", action="store_true", help="the stages and what each reruns")
    p.add_argument("--print", action="store_true", help="the command lines, nothing run")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for logs and JSON "
                   "(default: $OUT)")
    args = p.parse_args(argv)
    if args.list or not args.stage:
        for k, st in STAGES.items():
            print(f"{k} ({st.gpus} GPU{'s' * (st.gpus > 1)}"
                  f"{', needs ' + ', '.join(st.needs) if st.needs else ''}): {st.what}; "
                  f"reruns {st.was}")
        return 0
    out = args.out or "."
    if not args.print:
        os.makedirs(out, exist_ok=True)
        if shutil.which("nvidia-smi"):
            subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                            "--format=csv,noheader"])
    res = run(args.stage, out, dry=args.print)
    return 0 if all(r.get("rc", 0) == 0 for r in res["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
