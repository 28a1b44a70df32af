"""TRL's GRPOTrainer on prefix trees: treefx.integrations.trl.TreeGRPOTrainer (CPU, < 1 min).

Needs TRL: pip install -e ".[trl]" (trl==1.16.0). A tiny Qwen3 with random weights and an
offline chat tokenizer, a conversational dataset whose prompts carry three earlier turns,
G = 4 completions per prompt sampled by TRL's own generate, a toy reward, a reference model
(beta), two optimizer steps per generation (old log-probs, clipping). The same steps run three
times from the same checkpoint and seed: TRL's own ``GRPOTrainer``; ``TreeGRPOTrainer`` with
its defaults (TRL's micro-batches, each one tree of the prefixes its rows share); and
``TreeGRPOTrainer(keep_groups_together=True)``, each micro-batch whole groups, so one tree holds
a prompt once and its G completions as branches (other rows per micro-batch than TRL's, allowed
because this loss, TRL's default ``dapo``, sums to the same update over a generation batch).
Prints the loss of each micro-batch of the three runs (the defaults': TRL's; whole groups': other
micro-batches, the same sum per optimizer step), the largest relative difference of the
parameters after training from TRL's (float32 rounding: the same training), and the tokens the
trees ran against the rows' own.

    python examples/grpo_trl.py [--steps 2]
"""

import argparse
import os
import tempfile
import time
import warnings

import torch

warnings.filterwarnings("ignore")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import datasets  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402

from treefx.integrations.trl import TreeGRPOTrainer  # noqa: E402
from treefx.models.chat import tiny_chat_tokenizer  # noqa: E402

G = 4
SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer briefly."}
QUESTIONS = ["What is 2 + 3?", "Name a prime above 10.", "Spell cat backwards.", "Is 9 odd?"]


def checkpoint(path: str) -> str:
    """A tiny Qwen3 (random weights, float32) and its tokenizer, saved to ``path``."""
    tok = tiny_chat_tokenizer()
    config = transformers.AutoConfig.for_model(
        "qwen3", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path)
    tok.save_pretrained(path)
    return path


def brevity(completions, **kwargs):
    """Reward: shorter answers score higher."""
    return [-len(c[0]["content"]) / 100.0 for c in completions]


def train(model_path: str, out: str, steps: int, kind: str):
    """Train with ``kind``: "trl" (GRPOTrainer), "trees" (TreeGRPOTrainer's defaults) or
    "groups" (TreeGRPOTrainer, keep_groups_together=True)."""
    args = trl.GRPOConfig(
        output_dir=out, use_cpu=True, report_to="none", save_strategy="no", seed=0,
        max_steps=steps, logging_steps=1, num_generations=G, per_device_train_batch_size=G,
        gradient_accumulation_steps=2, max_completion_length=12, beta=0.04,
        # two optimizer steps per generation (PPO-style, old log-probs and clipping): the
        # runs sample once, from the same parameters. Sampling again after a step would draw
        # from parameters that differ by float32 rounding, which can flip a sampled token.
        num_iterations=2,
        # SGD: the parameters after the step show the gradients' agreement directly (Adam's
        # first step divides each gradient entry by its size and so magnifies float32 noise
        # in entries near zero). TRL turns gradient checkpointing on by default: a model this
        # small does not need it.
        optim="sgd", learning_rate=0.1, gradient_checkpointing=False,
        bf16=False,  # float32 (TRL otherwise autocasts to bfloat16 where it can, the CPU too)
        disable_dropout=True, disable_tqdm=True)
    prompts = [[SYSTEM, {"role": "user", "content": "Hi."},
                {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": q}] for q in QUESTIONS]
    losses = []

    base = trl.GRPOTrainer if kind == "trl" else TreeGRPOTrainer
    extra = {"keep_groups_together": True} if kind == "groups" else {}

    class Trainer(base):
        def compute_loss(self, *a, **kw):
            loss = super().compute_loss(*a, **kw)
            losses.append(float(loss))
            return loss

        def log(self, logs, *a, **kw):  # keep the example's output to its own table
            pass

    trainer = Trainer(model=model_path, reward_funcs=brevity, args=args, **extra,
                      train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in prompts]))
    t0 = time.perf_counter()
    trainer.train()
    return trainer, losses, time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2,
                   help="optimizer steps (2 micro-batches each; one generation per 2 steps)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(os.path.join(tmp, "model"))
        runs = {kind: train(path, os.path.join(tmp, kind), a.steps, kind)
                for kind in ("trl", "trees", "groups")}
    print(f"{'micro-batch':>11}  {'TRL loss':>12}  {'trees':>12}  {'whole groups':>12}")
    for i, row in enumerate(zip(*(losses for _, losses, _ in runs.values()))):
        print(f"{i:>11}  " + "  ".join(f"{x:>12.8f}" for x in row))
    stock_params = dict(runs["trl"][0].model.named_parameters())
    for kind, label in (("trees", "defaults"), ("groups", "keep_groups_together=True")):
        tree = runs[kind][0]
        err = max(float((q - stock_params[n]).norm() / stock_params[n].norm())
                  for n, q in tree.model.named_parameters())
        st = tree.tree_stats
        print(f"{label}: parameters after {a.steps} steps: max relative difference {err:.2e} "
              f"from TRL's; trees ran {st['tree_tokens']} tokens for {st['sequence_tokens']} "
              f"tokens of rows ({st['sequence_tokens'] / st['tree_tokens']:.2f}x fewer; old, "
              "reference and current log-probs)")
    print("time: " + ", ".join(f"{k} {v[2]:.1f} s" for k, v in runs.items()) + " (the tree "
          "runs include treefx compiling the policy and the reference once each; a tiny model "
          "on the CPU shows no speed-up)")


if __name__ == "__main__":
    main()
