"""TRL's SFTTrainer on prefix trees: treefx.integrations.trl_sft.TreeSFTTrainer (CPU, < 1 min).

Needs TRL: pip install -e ".[trl]" (trl==1.16.0). SFT on the model calls of four three-turn
conversations: each call is a prompt-completion row (the conversation so far, then the
assistant's answer), which TRL tokenizes through an offline chat template and trains on the
answer only (``completion_only_loss``); the calls of one conversation share its growing
prefix. The same two SGD steps (batch 3, gradient accumulation 2) run with TRL's own
``SFTTrainer`` on the rows padded into a batch and with ``TreeSFTTrainer``, which merges each
micro-batch's rows into a prefix tree. Prints each step's loss and TRL's metrics (entropy, mean
token accuracy, tokens) for both, the largest relative difference of the parameters after
training (float32 rounding), and the tokens the trees ran against the rows' own.

    python examples/sft_trl.py [--steps 2]
"""

import argparse
import tempfile
import time
import warnings

import torch

warnings.filterwarnings("ignore")

import datasets  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402

from treefx.integrations.trl_sft import TreeSFTTrainer  # noqa: E402
from treefx.models.chat import tiny_chat_tokenizer  # noqa: E402

SYSTEM = {"role": "system", "content": "Answer briefly."}
QUESTIONS = [("What is 2 + 3?", "5."), ("And times 4?", "20."), ("Minus 1?", "19."),
             ("Name a prime.", "7."), ("A larger one?", "13."), ("Larger still?", "101."),
             ("Spell cat backwards.", "tac."), ("And dog?", "god."), ("And tip?", "pit."),
             ("Is 9 odd?", "Yes."), ("Is 10?", "No."), ("And 11?", "Yes.")]
METRICS = ("loss", "entropy", "mean_token_accuracy", "num_tokens")


def rows() -> list[dict]:
    """Every call of four three-turn conversations, as prompt-completion rows."""
    out = []
    for c in range(0, len(QUESTIONS), 3):
        chat = [SYSTEM]
        for q, a in QUESTIONS[c:c + 3]:
            chat = chat + [{"role": "user", "content": q}]
            answer = [{"role": "assistant", "content": a}]
            out.append({"prompt": chat, "completion": answer})
            chat = chat + answer
    return out


def model(tok):
    config = transformers.AutoConfig.for_model(
        "qwen3", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def train(cls, data, tok, out, steps, **kw):
    m = model(tok)
    args = trl.SFTConfig(
        output_dir=out, per_device_train_batch_size=3, gradient_accumulation_steps=2,
        max_steps=steps, learning_rate=0.05, optim="sgd", logging_steps=1, save_strategy="no",
        report_to=[], seed=0, use_cpu=True, disable_tqdm=True,
        bf16=False,  # float32 (TRL otherwise autocasts to bfloat16 where it can, the CPU too)
        # TRL turns gradient checkpointing on by default (trees train with it as well); a model
        # this small does not need it
        gradient_checkpointing=False)
    trainer = cls(model=m, args=args, train_dataset=datasets.Dataset.from_list(data),
                  processing_class=tok, **kw)
    trainer.remove_callback(transformers.PrinterCallback)  # the table below says it
    trainer.train()
    logs = [{k: h[k] for k in METRICS} for h in trainer.state.log_history if "loss" in h]
    return trainer, logs, dict(m.named_parameters())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    tok = tiny_chat_tokenizer()
    data = rows()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        _, ref, ref_params = train(trl.SFTTrainer, data, tok, d, args.steps)
        tree, got, params = train(TreeSFTTrainer, data, tok, d, args.steps,
                                  tree_compile={"backend": "eager"})
    print(f"{'step':>4}  {'trainer':<14}{'loss':>12}{'entropy':>12}{'accuracy':>10}"
          f"{'tokens':>8}")
    for i, (r, g) in enumerate(zip(ref, got)):
        for name, x in (("SFTTrainer", r), ("TreeSFTTrainer", g)):
            print(f"{i:>4}  {name:<14}{x['loss']:>12.7f}{x['entropy']:>12.7f}"
                  f"{x['mean_token_accuracy']:>10.4f}{int(x['num_tokens']):>8}")
    diff = max(float((params[n] - q).detach().abs().max() / q.detach().abs().max())
               for n, q in ref_params.items())
    st = tree.tree_stats
    print(f"parameters after {args.steps} steps: largest relative difference {diff:.1e}")
    print(f"tokens: the rows {st['sequence_tokens']}, as trees {st['tree_tokens']} "
          f"({st['sequence_tokens'] / st['tree_tokens']:.2f}x fewer); "
          f"{time.perf_counter() - t0:.0f} s")
    return ref, got, diff


if __name__ == "__main__":
    main()
