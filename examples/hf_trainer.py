"""Hugging Face's Trainer on prefix trees: treefx.integrations.hf.TreeTrainer (CPU, < 1 min).

SFT on agent calls: each conversation (a system prompt, three user turns, three assistant
answers) is cut into its three model calls, each a row that trains its own answer
(``treefx.data.chat_call`` through an offline chat tokenizer); the rows of one conversation
share its growing prefix. The same two SGD steps (batch 6, gradient accumulation 2; AdamW's
first steps divide each gradient entry by its own size, which turns float32 rounding in
near-zero entries into visible parameter differences) run
with the stock ``Trainer`` on the rows padded into a batch and with ``TreeTrainer``, which
merges each micro-batch's rows into a prefix tree. Prints the loss of each step of both, the
largest relative difference of the parameters after training (float32 rounding), and the
tokens the trees ran against the rows' own.

    python examples/hf_trainer.py [--steps 2]
"""

import argparse
import tempfile
import time

import torch
import transformers

import treefx
from treefx.integrations.hf import TreeTrainer, rows_to_tree
from treefx.models.chat import tiny_chat_tokenizer

QUESTIONS = [("What is 2 + 3?", "5."), ("And times 4?", "20."), ("Minus 1?", "19."),
             ("Name a prime.", "7."), ("A larger one?", "13."), ("Larger still?", "101."),
             ("Spell cat backwards.", "tac."), ("And dog?", "god."), ("And tip?", "pit."),
             ("Is 9 odd?", "Yes."), ("Is 10?", "No."), ("And 11?", "Yes.")]


def rows(tok) -> list[dict]:
    """Every call of four three-turn conversations: input ids, labels -100 on the prompt."""
    out = []
    for c in range(0, len(QUESTIONS), 3):
        chat = [{"role": "system", "content": "Answer briefly."}]
        for q, a in QUESTIONS[c:c + 3]:
            chat += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            call = treefx.data.chat_call(chat, tok)
            ids = list(call.prompt_ids) + list(call.completion_ids)
            out.append({"input_ids": ids, "labels": [-100] * len(call.prompt_ids)
                        + list(call.completion_ids)})
    return out


def pad(batch):
    """The stock Trainer's batch: right-padded rows, labels -100 on padding."""
    n = max(len(r["input_ids"]) for r in batch)
    ids = torch.zeros(len(batch), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, r in enumerate(batch):
        k = len(r["input_ids"])
        ids[i, :k], mask[i, :k], labels[i, :k] = torch.tensor(r["input_ids"]), 1, \
            torch.tensor(r["labels"])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def model(tok):
    config = transformers.AutoConfig.for_model(
        "qwen3", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def train(cls, data, tok, out, steps, **kw):
    m = model(tok)
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=3, gradient_accumulation_steps=2,
        max_steps=steps, learning_rate=0.05, optim="sgd", logging_steps=1, save_strategy="no",
        report_to=[], seed=0, use_cpu=True, disable_tqdm=True)
    trainer = cls(model=m, args=args, train_dataset=data, **kw)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, dict(m.named_parameters())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    transformers.logging.set_verbosity_error()
    tok = tiny_chat_tokenizer()
    data = rows(tok)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        ref, ref_params = train(transformers.Trainer, data, tok, d, args.steps,
                                data_collator=pad)
        got, params = train(TreeTrainer, data, tok, d, args.steps,
                            tree_compile={"backend": "eager"})
    diff = max(float((params[n] - p).detach().abs().max() / p.detach().abs().max())
               for n, p in ref_params.items())
    row_tokens = sum(len(r["input_ids"]) for r in data)
    tree_tokens = sum(t.num_tokens for t in rows_to_tree(data)[0])
    print(f"losses, Trainer:     {[round(x, 6) for x in ref]}")
    print(f"losses, TreeTrainer: {[round(x, 6) for x in got]}")
    print(f"parameters after {args.steps} steps: largest relative difference {diff:.1e}")
    print(f"tokens: the rows {row_tokens}, as one tree {tree_tokens} "
          f"({row_tokens / tree_tokens:.2f}x fewer); {time.perf_counter() - t0:.0f} s")
    return ref, got, diff


if __name__ == "__main__":
    main()
