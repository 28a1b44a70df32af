"""Tree training on several GPUs with FSDP2 (or DDP): every rank trains on its own trees, the
gradients equal one process training on all of them.

    torchrun --nproc_per_node=2 examples/fsdp.py                  # GPUs (NCCL), or CPUs (gloo)
    torchrun --nproc_per_node=8 examples/fsdp.py --shape qwen3-8b --steps 20
    torchrun --nproc_per_node=2 examples/fsdp.py --ddp            # DDP instead of FSDP2
    python examples/fsdp.py                                       # one process

The default is a small Qwen3 (hidden 256, 4 layers): its 3 steps run on one GPU, or on a
2-core CPU in one process or two, in about a minute (two on a busy machine; the first step
compiles). The setup is the usual one: ``fully_shard`` on every decoder layer and on the root,
bf16 compute on float32 master weights on the GPU (``MixedPrecisionPolicy``), activation
checkpointing, AdamW. treefx adds three calls:

- ``treefx.distributed.assign(trees, world_size)``: balance the trees over the ranks by the
  cost of a step (tokens and attended pairs);
- ``treefx.distributed.pack(my_trees)``: normalize the loss over the global batch (all ranks'
  sequences) and for FSDP/DDP averaging gradients over ranks;
- ``treefx.compile(model)``: the sharded model runs regionally: the passes rewrite the whole
  captured forward once, then each decoder layer runs through its own module call, where FSDP2
  gathers and frees its parameters (one compiled layer serves every layer of one type).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import treefx
from treefx import synth

SHAPES = {
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=4096),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151936, tie_word_embeddings=False),
}


# Tree sizes: agent tasks of ~1-4k tokens on the CPU; realistic ones (~10-40k, POR ~0.75) on
# GPUs.
SIZES = dict(system_len=(40, 120), prompt_len=(10, 40), think_len=(10, 60),
             answer_len=(5, 20), tool_len=(10, 60), turns=(2, 3))
if torch.cuda.is_available():
    SIZES = dict(target_por=0.75)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="small")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--trees-per-rank", type=int, default=2)
    p.add_argument("--ddp", action="store_true", help="DistributedDataParallel, not FSDP2")
    args = p.parse_args()

    # torchrun sets these; a plain `python examples/fsdp.py` is a group of one
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="29500").items():
        os.environ.setdefault(k, v)
    cuda = torch.cuda.is_available()
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", **SHAPES[args.shape])
    torch.manual_seed(0)  # the same weights on every rank
    with device:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    ckpt = {"use_reentrant": False}  # activation checkpointing, by the name transformers has:
    if hasattr(model, "activation_checkpointing_enable"):  # 5.24 (the old name warns)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt)
    else:  # 5.17
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt)
    model.train()
    if args.ddp:
        held = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cuda else torch.float32,
                                  reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        held = model
    opt = torch.optim.AdamW(held.parameters(), lr=1e-5)
    tm = treefx.compile(held, logits=False)  # regional under FSDP2 / DDP

    for step in range(args.steps):
        # Every rank draws the same global batch of agent trees, then takes its share.
        trees = [synth.agent_tree(seed=1000 * step + i, vocab_size=cfg.vocab_size, **SIZES)
                 for i in range(world * args.trees_per_rank)]
        mine = treefx.distributed.assign(trees, world)[rank]
        batch = treefx.distributed.pack(mine, reduction="mean").to(device)
        t0 = time.perf_counter()
        loss = treefx.tree_loss(tm(batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)  # the mean over ranks is the global batch's loss
        seconds = time.perf_counter() - t0
        if rank == 0:
            print(f"step {step}: loss {float(global_loss) / world:.4f} (global mean over "
                  f"{batch.num_sequences_normalizer} sequences), rank 0: {len(mine)} trees, "
                  f"{batch.num_tokens} tokens, {seconds:.1f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
