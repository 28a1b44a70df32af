"""One PPO update of verl's actor with treefx's engine, beside verl's own engine.

    pip install -e ".[verl]"          # verl 0.9.1 (and the transformers it pins)
    python examples/verl_engine.py    # CPU (gloo, one process) or one GPU

In a verl run, the engine is chosen by two keys of the model config (see docs/integrations.md)::

    actor_rollout_ref.model.external_lib=treefx.integrations.verl
    actor_rollout_ref.model.model_type=tree_language_model

Here both engines are built directly from verl's four configs, as verl's worker builds them
(``EngineRegistry.new``), from the same checkpoint (a small Qwen3 with random weights). The
batch is what verl's trainer hands the actor for GRPO on multi-turn prompts: 2 tasks, each a
system prompt and earlier turns shared by its 4 rollouts, laid out by
``treefx.integrations.verl.update_batch`` as verl's trainer lays them out. Each engine computes verl's PPO loss (clipped policy loss, KL loss
to the reference, entropy bonus) over 2 micro-batches, accumulates the gradients and takes the
optimizer's step, with activation checkpointing (verl's default) in float32; the script prints
both losses, the largest gradient difference, and the
tokens the trees ran against the rows'.
"""

from __future__ import annotations

import functools
import os
import tempfile

import torch
import torch.distributed as dist


def main():
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29531"), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    import treefx.integrations.verl as tv  # registers the engine (external_lib does this in verl)

    tv.use_cpu_platform()  # verl has no CPU platform of its own; nothing on a GPU machine
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import (ActorConfig, FSDPEngineConfig, FSDPOptimizerConfig,
                                     HFModelConfig)
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.utils.losses import ppo_loss

    torch.manual_seed(0)
    folder = tempfile.mkdtemp()
    Qwen3ForCausalLM(Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=1024)).save_pretrained(folder)

    def configs(model_type):
        model = HFModelConfig(path=folder, load_tokenizer=False, model_type=model_type,
                              override_config={"attn_implementation": "sdpa"})
        # float32 throughout, to show the two engines agree to rounding (verl's default mixed
        # precision is bf16 parameters and autocast)
        engine = FSDPEngineConfig(strategy="fsdp2", model_dtype="fp32", use_torch_compile=False,
                                  mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32",
                                                   "buffer_dtype": "fp32"})
        optim = FSDPOptimizerConfig(lr=1e-5, total_training_steps=1)
        return dict(model_config=model, engine_config=engine, optimizer_config=optim,
                    checkpoint_config=CheckpointConfig())

    # GRPO rows: per task, a shared system prompt and earlier turns, 4 rollouts
    g = torch.Generator().manual_seed(1)
    tok = lambda n: torch.randint(1, 512, (n,), generator=g).tolist()  # noqa: E731
    system = tok(120)
    rows = []
    for _ in range(2):
        prompt = system + tok(60) + tok(20)
        rows += [(prompt, tok(int(torch.randint(10, 40, (1,), generator=g)))) for _ in range(4)]
    B, R = len(rows), max(len(r) for _, r in rows)
    batch = tv.update_batch(rows, {   # as verl's trainer hands the actor its update batch
        "old_log_probs": -torch.rand(B, R, generator=g) * 6,
        "ref_log_prob": -torch.rand(B, R, generator=g) * 6,
        "advantages": torch.randn(B, 1, generator=g).expand(B, R).contiguous(),
    }, temperature=1.0, global_batch_size=B, use_remove_padding=True, use_fused_kernels=False,
        use_dynamic_bsz=False, micro_batch_size_per_gpu=4, calculate_entropy=True)
    loss_fn = functools.partial(ppo_loss, ActorConfig(
        strategy="fsdp2", rollout_n=4, ppo_micro_batch_size_per_gpu=4, use_kl_loss=True,
        entropy_coeff=0.01))

    results = {}
    for model_type in ("language_model", tv.MODEL_TYPE):
        if model_type == "language_model" and not torch.cuda.is_available():
            # verl registers its own engine for accelerators only: build the class directly
            from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
            engine = FSDPEngineWithLMHead(*configs(model_type).values())
        else:
            engine = EngineRegistry.new(model_type=model_type, backend="fsdp2",
                                        **configs(model_type))
        engine.initialize()
        with engine.train_mode():
            out = engine.train_batch(batch.clone(), loss_fn)
            grads = {n: p.grad.full_tensor() for n, p in engine.module.named_parameters()}
        results[model_type] = (sum(out["loss"]), grads, getattr(engine, "tree_stats", None))
        print(f"{type(engine).__name__:>22}: loss {sum(out['loss']):.6f}, "
              f"grad norm {float(out['metrics']['grad_norm']):.6f}")
    (loss_a, grads_a, _), (loss_b, grads_b, stats) = results.values()
    worst = max(float((grads_a[n] - grads_b[n]).abs().max()) for n in grads_a)
    print(f"loss difference {abs(loss_a - loss_b):.2e}, largest gradient difference {worst:.2e}")
    print(f"tokens: {stats['tree_tokens']} in the trees, {stats['sequence_tokens']} in the rows")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
