"""``treefx.integrations.trl_sft.TreeSFTTrainer`` against TRL's own ``SFTTrainer`` on the same
rows (CPU, a tiny Qwen3 with random weights, float32, TRL's default gradient checkpointing).

The rows share prefixes (a prompt with several answers, a second turn on the first answer, a
row that is a prefix of another, a duplicate) and train on their answers only. The stock
trainer pads them into a batch; the tree trainer merges each micro-batch into a prefix tree.
Same model, seed, data order and optimizer: every logged loss, every gradient before each
optimizer step, the parameters after training, and TRL's metrics (``entropy``,
``mean_token_accuracy``, ``num_tokens``) must agree (float32, ≤ 1e-5 relative, or 4 × the
stock path's own spread where that is larger: the stock trainer run again with its rows padded
wider, ``pad_to_multiple_of``; AdamW turns rounding in tiny gradients into visible differences
in the next parameters), with gradient accumulation over two micro-batches of three rows.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

from test_integration_hf import RTOL, _Grads, _rel, _rows  # noqa: E402

import treefx  # noqa: E402
from treefx.integrations.trl_sft import TreeSFTTrainer, tree_token_metrics  # noqa: E402
from treefx.models.chat import tiny_chat_tokenizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

METRICS = ("loss", "entropy", "mean_token_accuracy", "num_tokens")


@pytest.fixture(scope="module")
def tok():
    return tiny_chat_tokenizer()


def _model(vocab: int):
    cfg = transformers.AutoConfig.for_model(
        "qwen3", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).float()


def _greedy_rows(vocab: int) -> list[dict]:
    """The HF test's rows, with each task's first answer replaced by the initial model's greedy
    continuation of its prompt (so ``mean_token_accuracy`` is not 0 on a random model), as
    ``input_ids`` and a ``completion_mask``."""
    rows = _rows()
    model = _model(vocab).eval()
    for i in range(0, len(rows) - 1, 4):
        r = rows[i]
        ctx = [t for t, lab in zip(r["input_ids"], r["labels"]) if lab == -100]
        n = len(r["input_ids"]) - len(ctx)
        with torch.no_grad():
            ids = model.generate(torch.tensor([ctx]), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)[0].tolist()
        rows[i] = {"input_ids": ids, "labels": [-100] * len(ctx) + ids[len(ctx):]}
        # the row that is the prompt plus the first answer's first token follows it
        rows[i + 3] = {"input_ids": ids[:len(ctx) + 1], "labels": [-100] * len(ctx)
                       + ids[len(ctx):len(ctx) + 1]}
    rows[-1] = dict(rows[-4])
    return [{"input_ids": r["input_ids"],
             "completion_mask": [int(x != -100) for x in r["labels"]]} for r in rows]


def _train(cls, rows, tok, tmp_path, *, vocab, config=None, **kw):
    """Train on ``rows``; (logged metrics per step, gradients per step, parameters, trainer)."""
    model = _model(vocab)
    grads = _Grads()
    args = trl.SFTConfig(**{
        "output_dir": str(tmp_path), "per_device_train_batch_size": 3,
        "gradient_accumulation_steps": 2, "num_train_epochs": 1, "learning_rate": 1e-3,
        "logging_steps": 1, "save_strategy": "no", "report_to": [], "seed": 0, "use_cpu": True,
        "dataloader_num_workers": 0, "max_grad_norm": 0.0, "bf16": False,
        "disable_tqdm": True, **(config or {})})
    trainer = cls(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                  processing_class=tok, callbacks=[grads], **kw)
    trainer.train()
    logs = [{k: h[k] for k in METRICS if k in h} for h in trainer.state.log_history
            if "loss" in h]
    return logs, grads.steps, dict(model.named_parameters()), trainer


def _check_logs(got, ref, rtol=RTOL) -> dict:
    """Every logged loss and metric agrees; the largest relative difference of each."""
    assert len(got) == len(ref) > 0
    worst = dict.fromkeys(METRICS, 0.0)
    for g, r in zip(got, ref):
        assert g.keys() == r.keys() == set(METRICS), (g, r)
        assert g["num_tokens"] == r["num_tokens"]
        # accuracy: the same tokens are the argmax (a near-tie could flip one: none here)
        assert g["mean_token_accuracy"] == pytest.approx(r["mean_token_accuracy"], abs=1e-6)
        for k in ("loss", "entropy"):
            assert g[k] == pytest.approx(r[k], rel=rtol), (k, g, r)
        for k in METRICS:
            worst[k] = max(worst[k], abs(g[k] - r[k]) / max(abs(r[k]), 1e-12))
    return worst


def test_tree_sft_trainer_equals_trls_sft_trainer(tok, tmp_path):
    """Pre-tokenized rows (``input_ids`` + ``completion_mask``, TRL builds the labels with
    ``completion_only_loss``), loss ``nll``, AdamW: losses, gradients, parameters, metrics.
    Without gradient checkpointing (5x faster here; the next test keeps TRL's default)."""
    vocab = 97
    rows = _greedy_rows(vocab)
    config = {"completion_only_loss": True, "gradient_checkpointing": False}
    ref = _train(trl.SFTTrainer, rows, tok, tmp_path / "ref", vocab=vocab, config=config)
    wide = _train(trl.SFTTrainer, rows, tok, tmp_path / "wide", vocab=vocab,
                  config={**config, "pad_to_multiple_of": 29})
    got = _train(TreeSFTTrainer, rows, tok, tmp_path / "tree", vocab=vocab, config=config,
                 tree_compile={"backend": "eager"})
    (logs_r, grads_r, params_r, _), (logs_t, grads_t, params_t, trainer) = ref, got

    def tol(a, b):
        return max(RTOL, 4 * _rel(a, b))

    assert len(grads_r) == len(grads_t) == 3  # 17 rows, 3 a micro-batch, 2 per step
    worst = _check_logs(logs_t, logs_r)
    assert any(x["mean_token_accuracy"] > 0 for x in logs_r)  # the metric is not trivially 0
    worst.update(grad=0.0, param=0.0)
    for step, (gr, gt, gw) in enumerate(zip(grads_r, grads_t, wide[1])):
        assert gr.keys() == gt.keys()
        for n in gr:
            err = _rel(gt[n], gr[n])
            worst["grad"] = max(worst["grad"], err)
            assert err <= tol(gw[n], gr[n]), (step, n, err)
    for n, p in params_r.items():
        p, q, w = p.detach(), params_t[n].detach(), wide[2][n].detach()
        worst["param"] = max(worst["param"], _rel(q, p))
        assert _rel(q, p) <= tol(w, p), (n, _rel(q, p), tol(w, p))
    stats = trainer.tree_stats
    assert stats["tree_tokens"] < stats["sequence_tokens"] == logs_t[-1]["num_tokens"]
    print("max rel err:", {k: f"{v:.1e}" for k, v in worst.items()}, "logs", logs_r)


SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def _conversations() -> list[dict]:
    """Prompt-completion conversations: each question answered twice, a second turn on the
    first answer (sharing the system prompt and the first user turn), a duplicate."""
    qa = [("What is 2 + 3?", ["5.", "The answer is 5."], "And 12 * 7?", "84."),
          ("Weather in Paris?", ["Sunny.", "Sunny, 21 degrees."], "And Berlin?", "It rains."),
          ("Hello!", ["Hello! How can I help?", "Hi."], "Thanks.", "That is all.")]
    rows = []
    for q, answers, q2, a2 in qa:
        prompt = [SYSTEM, {"role": "user", "content": q}]
        for a in answers:
            rows.append({"prompt": prompt, "completion": [{"role": "assistant", "content": a}]})
        rows.append({"prompt": prompt + [{"role": "assistant", "content": answers[0]},
                                         {"role": "user", "content": q2}],
                     "completion": [{"role": "assistant", "content": a2}]})
    rows.append(rows[0])
    return rows


def test_conversations_through_trls_chat_template_with_dft_loss(tok, tmp_path):
    """Conversations TRL tokenizes (prompt-completion, trained on the completions) and the
    ``dft`` loss, SGD, TRL's default gradient checkpointing: every logged loss and metric and
    the parameters after training."""
    rows = _conversations()
    config = {"loss_type": "dft", "optim": "sgd", "learning_rate": 0.5}
    ref = _train(trl.SFTTrainer, rows, tok, tmp_path / "ref", vocab=len(tok), config=config)
    got = _train(TreeSFTTrainer, rows, tok, tmp_path / "tree", vocab=len(tok), config=config,
                 tree_compile={"backend": "eager"})
    worst = _check_logs(got[0], ref[0])
    worst["param"] = max(_rel(got[2][n].detach(), p.detach()) for n, p in ref[2].items())
    print("max rel err:", {k: f"{v:.1e}" for k, v in worst.items()}, "logs", ref[0])
    assert worst["param"] <= RTOL, worst
    # evaluation: TRL's eval loss (the mean of the micro-batches' token means) and metrics
    evals = [t.evaluate(datasets.Dataset.from_list(rows[:7])) for t in (ref[3], got[3])]
    for k in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
        assert evals[1][k] == pytest.approx(evals[0][k], rel=RTOL), (k, evals)
    moved = max(_rel(p.detach(), q.detach()) for p, q in
                zip(ref[2].values(), _model(len(tok)).parameters()))
    assert moved > 1e-3  # the steps did something
    stats = got[3].tree_stats
    assert stats["tree_tokens"] < stats["sequence_tokens"]


def test_tree_token_metrics_weigh_each_token_by_the_rows_that_train_it():
    """The function the trainer logs from, alone: on rows with shared tokens (some answers
    the model's own greedy ones), equal to the per-row sums over trained tokens (entropy of the
    predicted distribution, argmax hit). The tree's logits are the rows' own, placed at their
    tokens' places in the depth-first row."""
    model = _model(97)
    rows = [{"input_ids": r["input_ids"], "labels": [t if m else -100 for t, m in
             zip(r["input_ids"], r["completion_mask"])]} for r in _greedy_rows(97)[:9]]
    batch = treefx.integrations.hf.TreeCollator()(rows)["tree_batch"]
    logits = torch.zeros(1, batch.num_tokens, 97)
    e_ref = c_ref = n_ref = 0.0
    with torch.no_grad():
        for i, r in enumerate(rows):
            ids = torch.tensor([r["input_ids"]])
            row_logits = model(ids).logits[0].float()
            logits[0, batch.sequence_index(i)] = row_logits
            row_logits = row_logits[:-1]
            mask = torch.tensor(r["labels"][1:]) != -100
            logp = row_logits.log_softmax(-1)
            e_ref += float((-(logp.exp() * logp).sum(-1))[mask].sum())
            c_ref += float((row_logits.argmax(-1) == ids[0, 1:])[mask].sum())
            n_ref += float(mask.sum())
    out = treefx.TreeOutput(logits, torch.zeros(batch.num_tokens))
    for chunk in (1 << 26, 3 * 97):  # all rows at once; 3 logit rows at a time
        ent, correct, count = tree_token_metrics(out, batch, chunk_elements=chunk)
        assert float(count) == n_ref
        assert float(correct) == c_ref > 0
        assert float(ent) == pytest.approx(e_ref, rel=1e-6)


def test_calls_and_tree_records_train_as_their_rows(tok, tmp_path):
    """Rows in treefx's terms, which TRL's preparation leaves alone: model calls
    (``prompt_ids`` + ``completion_ids``) and trees (``Tree.to_dict()`` records, as a mapping
    and as JSON) give the same micro-batches, the same trees and trained-token counts, as the
    same rows as ``input_ids`` + ``labels``."""
    rows = _rows(seed=3, tasks=2)[:6]
    calls = []
    for r in rows:
        k = r["labels"].index(next(x for x in r["labels"] if x != -100))
        calls.append({"prompt_ids": r["input_ids"][:k], "completion_ids": r["input_ids"][k:]})
    tree = treefx.integrations.hf.rows_to_tree(rows[:3])[0][0]

    def batches(data, **config):
        args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=3,
                             report_to=[], use_cpu=True, bf16=False, **config)
        trainer = TreeSFTTrainer(model=_model(97), args=args, processing_class=tok,
                                 train_dataset=datasets.Dataset.from_list(data))
        return [(b["tree_batch"].trees, b["num_items"])
                for b in trainer.get_train_dataloader()]

    def same(a, b):
        assert len(a) == len(b)
        for (ta, na), (tb, nb) in zip(a, b):
            assert na == nb and [t.sequences for t in ta] == [t.sequences for t in tb]
            assert [np.concatenate(t.loss_masks).tolist() for t in ta] == \
                   [np.concatenate(t.loss_masks).tolist() for t in tb]

    same(batches(calls), batches(rows))
    items = int(sum(m[1:].sum() for m in tree.loss_masks))
    for record in (tree.to_dict(), json.dumps(tree.to_dict())):  # a mapping, a JSON string
        ((trees, n),) = batches([{"tree": record}])
        assert n == items and trees == [tree]


def test_refused_options_name_themselves(tok, tmp_path, caplog):
    data = datasets.Dataset.from_list(_rows()[:3])

    def make(**config):
        args = trl.SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False,
                             **config)
        return TreeSFTTrainer(model=_model(97), args=args, processing_class=tok,
                              train_dataset=data)

    for option in ("packing", "padding_free", "use_liger_kernel", "eval_packing"):
        with pytest.raises(ValueError, match=f"{option}=True is not supported"):
            make(**{option: True, **({"max_length": None} if option == "padding_free" else {})})
    with pytest.raises(ValueError, match="label_smoothing_factor is not supported"):
        make(label_smoothing_factor=0.1)
    with pytest.raises(ValueError, match="compute_loss_func"):
        TreeSFTTrainer(model=_model(97), args=trl.SFTConfig(output_dir=str(tmp_path),
                       report_to=[], use_cpu=True, bf16=False), processing_class=tok,
                       train_dataset=data, compute_loss_func=lambda *a, **k: 0)
    # a tree longer than max_length: TRL does not cut it, treefx does not either
    tree = treefx.Tree.from_sequences([list(range(1, 40)), list(range(1, 20))])
    trainer = TreeSFTTrainer(
        model=_model(97), processing_class=tok,
        args=trl.SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False,
                           max_length=32, max_steps=1),
        train_dataset=datasets.Dataset.from_list([{"tree": tree.to_dict()}]))
    with pytest.raises(ValueError, match="39 tokens is longer than max_length=32"):
        trainer.train()
    # a model compiled with logits=False: the loss, no entropy or accuracy, a warning once
    batch = treefx.integrations.hf.TreeCollator()([{"tree": tree}])["tree_batch"]
    out = treefx.TreeOutput(None, torch.zeros(batch.num_tokens))
    with caplog.at_level(logging.WARNING, logger="treefx"):
        trainer._record_metrics("train", out, batch)
        trainer._record_metrics("train", out, batch)
    assert caplog.text.count("logits=False") == 1
    metrics = trainer._metrics["train"]
    assert "entropy" not in metrics and metrics["num_tokens"] == [2 * (39 + 19)]
    assert metrics["num_tree_tokens"] == [2 * 39]


@pytest.mark.parametrize("mode, pad", [("all", 8), ("non_padding", None)])
def test_num_input_tokens_seen_counts_what_sft_trainer_counts(tok, tmp_path, mode, pad):
    """``include_num_input_tokens_seen``: ``SFTTrainer`` counts each padded micro-batch
    (``input_ids.numel()``, padded to the longest row or to ``pad_to_multiple_of``; or
    ``attention_mask.sum()``); the tree trainer's count, logged and final, is the same."""
    rows = _rows()[:12]
    config = {"include_num_input_tokens_seen": mode, "pad_to_multiple_of": pad,
              "gradient_checkpointing": False}

    def seen(trainer):
        return trainer.state.num_input_tokens_seen, [
            h["num_input_tokens_seen"] for h in trainer.state.log_history
            if "num_input_tokens_seen" in h]

    ref = _train(trl.SFTTrainer, rows, tok, tmp_path / "ref", vocab=97, config=config)[3]
    got = _train(TreeSFTTrainer, rows, tok, tmp_path / "tree", vocab=97, config=config,
                 tree_compile={"backend": "eager"})[3]
    assert seen(ref)[0] > 0 and len(seen(ref)[1]) == 3
    assert seen(got) == seen(ref), (seen(got), seen(ref))
    assert (seen(ref)[0] == sum(len(r["input_ids"]) for r in rows)) == (mode == "non_padding")
