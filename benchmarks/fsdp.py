"""FSDP2 training on several GPUs: treefx against sequence packing, one process per GPU.

    torchrun --nproc_per_node=2 -m benchmarks.fsdp --shape qwen3-8b --method treefx
    torchrun --nproc_per_node=2 -m benchmarks.fsdp --shape qwen3-8b --method packed
    torchrun --nproc_per_node=1 -m benchmarks.fsdp --shape qwen3-1.7b --method treefx
    python -m benchmarks.fsdp --dry-run            # CPU, gloo, one process, a tiny model

The setup of an agent trainer: a Hugging Face Qwen3 of the given shape (random weights), float32
master weights sharded with ``fully_shard`` per decoder layer and on the root, bf16 compute
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), activation checkpointing
(``activation_checkpointing_enable``), AdamW. Every rank builds the same pool of synthetic agent
trees (POR about ``--por``, about ``--tokens`` unique tokens per rank), ``treefx.distributed
.assign`` balances them over the ranks, and each rank trains on its own:

- ``treefx``: ``treefx.compile(model, logits=False)`` (regional execution under FSDP2), one
  step per rank on ``treefx.distributed.pack(my_trees)``;
- ``packed``: the same sequences unshared, packed into micro-batches of at most the rank's tree
  token count (each sequence a chain: a block-diagonal causal mask, positions from 0), through
  the same compiled model, gradients accumulated over the micro-batches
  (``set_requires_gradient_sync`` only on the last), the same global mean over sequences.

So the two differ only in whether shared prefixes are computed once. Reported per method: the
first step's time (capture and compile included), the median step time over ``--steps``, the
tokens per second (unique tree tokens, and the sequence tokens they stand for), the peak memory
per GPU (``max_memory_allocated``), and the loss (equal for both up to bf16 rounding).
The share of the token-count bound is (packed step / treefx step) / (sequence tokens / tree
tokens), computed from the two JSON files.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

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


def _setup(dry_run: bool):
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not dry_run
    if "RANK" not in os.environ:  # plain python: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
    local = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo",
                            device_id=torch.device("cuda", local) if cuda else None)
    return torch.device("cuda", local) if cuda else torch.device("cpu")


def _build(model_type: str, config: dict, dev, checkpointing: bool, dtype=torch.float32):
    """A Hugging Face causal LM of ``config`` on ``dev`` (random weights, the same on every
    rank), SDPA attention, in training mode (dropout is 0 in Qwen3 and Qwen3-Next)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from treefx.models import enable_activation_checkpointing

    cfg = AutoConfig.for_model(model_type, **config)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)  # the same weights on every rank before sharding
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if checkpointing:
        enable_activation_checkpointing(model, use_reentrant=False)
    return model.train()


def _shard(model, mp_policy=None):
    """FSDP2: ``fully_shard`` on every decoder layer and on the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = mp_policy or MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    return model


def _model(shape: str, dev, checkpointing: bool, layers: int | None = None,
           vocab_size: int | None = None):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    config = dict(SHAPES[shape], num_hidden_layers=layers or SHAPES[shape]["num_hidden_layers"])
    if vocab_size:
        config["vocab_size"] = vocab_size
    model = _build("qwen3", config, dev, checkpointing)
    low = torch.bfloat16 if dev.type == "cuda" else torch.float32
    _shard(model, MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32))
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return model


def _pool(world: int, tokens: int, por: float, vocab: int, seed: int = 0, **lengths):
    """Synthetic agent trees, the same on every rank: about ``tokens`` unique tokens per rank
    (at least two trees per rank); ``lengths``: ``synth.agent_tree``'s length ranges."""
    from treefx import synth

    trees, total, i = [], 0, 0
    while total < world * tokens or len(trees) < 2 * world:
        t = synth.agent_tree(seed=seed + i, vocab_size=vocab, target_por=por, rollouts=2,
                             **lengths)
        trees.append(t)
        total += t.num_tokens
        i += 1
    return trees


def _chains(trees, budget: int):
    """Every sequence of ``trees`` as its own one-path tree, in micro-batches of at most
    ``budget`` tokens (first fit in order; a longer sequence alone)."""
    import treefx

    batches, cur, size = [], [], 0
    for t in trees:
        for i, seq in enumerate(t.sequences):
            chain = treefx.Tree.from_sequences([seq], weights=[float(t.weights[i])],
                                               loss_masks=[t.loss_mask(i)])
            if cur and size + len(seq) > budget:
                batches.append(cur)
                cur, size = [], 0
            cur.append(chain)
            size += len(seq)
    if cur:
        batches.append(cur)
    return batches


def _sync(dev):
    import torch.distributed as dist

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dist.barrier()


def main(argv=None):
    p = argparse.ArgumentParser(prog="torchrun ... -m benchmarks.fsdp",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--method", choices=("treefx", "packed"), default="treefx")
    p.add_argument("--tokens", type=int, default=32768, help="unique tree tokens per rank")
    p.add_argument("--por", type=float, default=0.75)
    p.add_argument("--steps", type=int, default=3, help="timed steps after the first two")
    p.add_argument("--layers", type=int, default=None, help="override the shape's depth")
    p.add_argument("--no-checkpointing", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny model, eager")
    p.add_argument("--out", default=None, help="JSON file (rank 0 writes it)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.shape, args.tokens, args.steps = "tiny", min(args.tokens, 1500), 1

    import torch.distributed as dist

    import treefx
    from treefx.layout import pack

    dev = _setup(args.dry_run)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.backends.cuda.matmul.allow_tf32 = True
    trees = _pool(world, args.tokens, args.por, SHAPES[args.shape]["vocab_size"])
    mine = treefx.distributed.assign(trees, world)[rank]
    t0 = time.perf_counter()
    model = _model(args.shape, dev, not args.no_checkpointing, args.layers)
    build_s = time.perf_counter() - t0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    backend = "inductor" if dev.type == "cuda" else "eager"
    tm = treefx.compile(model, backend=backend, logits=False, verify=False)
    tree_tokens = sum(t.num_tokens for t in mine)
    seq_tokens = sum(t.num_baseline_tokens for t in mine)
    if args.method == "treefx":
        batches = [treefx.distributed.pack(mine, reduction="mean").to(dev)]
    else:
        counts = torch.tensor([sum(t.num_sequences for t in mine)], device=dev)
        dist.all_reduce(counts)
        batches = [pack(c, reduction="mean", num_sequences=int(counts), loss_scale=world)
                   .to(dev) for c in _chains(mine, tree_tokens)]

    def step():
        total = 0.0
        for i, b in enumerate(batches):
            model.set_requires_gradient_sync(i == len(batches) - 1)
            loss = treefx.tree_loss(tm(b), b)
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    _sync(dev)
    t0 = time.perf_counter()
    first_loss = step()
    _sync(dev)
    first_s = time.perf_counter() - t0
    step()  # warm: recompiles after the first step (none expected) would show here
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(args.steps):
        _sync(dev)
        t0 = time.perf_counter()
        step()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    stats = torch.tensor([tree_tokens, seq_tokens, peak or 0.0, step_s], dtype=torch.float64,
                         device=dev)
    gathered = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats)
    g = torch.stack(gathered).cpu()
    result = {
        "method": args.method, "shape": args.shape, "world_size": world,
        "config": SHAPES[args.shape], "layers": args.layers or SHAPES[args.shape][
            "num_hidden_layers"], "checkpointing": not args.no_checkpointing,
        "por_target": args.por, "trees_total": len(trees), "trees_per_rank_0": len(mine),
        "tree_tokens_per_rank": g[:, 0].tolist(), "sequence_tokens_per_rank": g[:, 1].tolist(),
        "micro_batches_rank_0": len(batches),
        "build_s": round(build_s, 1), "first_step_s": round(first_s, 1),
        "step_s_per_rank": [round(x, 4) for x in g[:, 3].tolist()],
        "step_s": round(float(g[:, 3].max()), 4),
        "tree_tokens_per_s": round(float(g[:, 0].sum() / g[:, 3].max()), 1),
        "sequence_tokens_per_s": round(float(g[:, 1].sum() / g[:, 3].max()), 1),
        "peak_gib_per_gpu": [round(x, 2) for x in g[:, 2].tolist()],
        "first_loss": first_loss, "timed_steps": args.steps,
        "treefx_captures": sum(len(v) for v in tm.engine._regional.values()),
        "compiled_pieces": [x.num_compiled for v in tm.engine._regional.values() for x in v],
    }
    if dev.type == "cuda":
        import triton
        import transformers

        result["versions"] = {"torch": torch.__version__, "triton": triton.__version__,
                              "transformers": transformers.__version__,
                              "device": torch.cuda.get_device_name(dev)}
    if rank == 0:
        print(json.dumps(result, indent=1), flush=True)
        if args.out:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
