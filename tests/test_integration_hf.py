"""``treefx.integrations.hf.TreeTrainer`` against Hugging Face's own ``Trainer`` on the same rows.

The rows are agent calls and answers that share prefixes (a prompt with several answers, the
turns of one conversation, a row that is a prefix of another, a duplicate), trained only on
their answers (``labels`` -100 elsewhere). The stock ``Trainer`` pads them into a batch; the
tree trainer merges each micro-batch into a prefix tree. Same model, seed, data order and
optimizer: the loss of every step, every parameter's gradient before each optimizer step and
the parameters after training must agree (float32, ≤ 1e-5 relative, or 4 × the stock path's
own spread where that is larger: the stock ``Trainer`` run again on the rows padded 7 columns
wider; AdamW turns rounding in tiny gradients into visible differences in the next
parameters), with gradient accumulation over several micro-batches.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from treefx.integrations.hf import TreeCollator, TreeTrainer, rows_to_tree  # noqa: E402

VOCAB = 97
RTOL = 1e-5


def _model():
    cfg = transformers.AutoConfig.for_model(
        "qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).float()


def _rows(seed: int = 0, tasks: int = 4) -> list[dict]:
    """Per task: a prompt with two answers, a second turn on the first answer (its prompt is
    the first call plus a user turn), and a row that is the first call's prompt alone plus
    one token; the last task's first row repeated."""
    rng = np.random.default_rng(seed)

    def tokens(n):
        return rng.integers(1, VOCAB, n).tolist()

    rows = []
    for _ in range(tasks):
        prompt = tokens(int(rng.integers(6, 14)))
        a, b = tokens(int(rng.integers(3, 9))), tokens(int(rng.integers(1, 6)))
        turn, a2 = tokens(4), tokens(int(rng.integers(2, 7)))
        for ctx, ans in ((prompt, a), (prompt, b), (prompt + a + turn, a2), (prompt, a[:1])):
            rows.append({"input_ids": ctx + ans, "labels": [-100] * len(ctx) + ans})
    rows.append(dict(rows[-4]))
    return rows


def _pad(rows, extra: int = 0):
    """The stock path: right-padded rows (``extra`` more columns), labels -100 on padding."""
    n = max(len(r["input_ids"]) for r in rows) + extra
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    att = torch.zeros(len(rows), n, dtype=torch.long)
    lab = torch.full((len(rows), n), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        k = len(r["input_ids"])
        ids[i, :k], att[i, :k] = torch.tensor(r["input_ids"]), 1
        lab[i, :k] = torch.tensor(r["labels"])
    return {"input_ids": ids, "attention_mask": att, "labels": lab}


class _Grads(TrainerCallback):
    """Every parameter's gradient just before each optimizer step."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                           if p.grad is not None})


class _Losses(TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def _train(trainer_cls, rows, tmp_path, **kw):
    model = _model()
    grads, losses = _Grads(), _Losses()
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=3, gradient_accumulation_steps=2,
        num_train_epochs=1, learning_rate=1e-3, logging_steps=1, save_strategy="no",
        report_to=[], seed=0, use_cpu=True, dataloader_num_workers=0, max_grad_norm=0.0)
    trainer = trainer_cls(model=model, args=args, train_dataset=rows,
                          callbacks=[grads, losses], **kw)
    out = trainer.train()
    return out.training_loss, losses.losses, grads.steps, dict(model.named_parameters())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_tree_trainer_equals_the_stock_trainer_with_gradient_accumulation(tmp_path):
    rows = _rows()
    ref = _train(Trainer, rows, tmp_path / "ref", data_collator=_pad)
    wide = _train(Trainer, rows, tmp_path / "wide", data_collator=lambda r: _pad(r, extra=7))
    got = _train(TreeTrainer, rows, tmp_path / "tree", tree_compile={"backend": "eager"})
    (loss_r, logs_r, grads_r, params_r), (loss_t, logs_t, grads_t, params_t) = ref, got

    def tol(a, b):
        return max(RTOL, 4 * _rel(a, b))

    assert len(grads_r) == len(grads_t) == 3  # 17 rows, 3 a micro-batch, 2 per step
    assert abs(loss_t - loss_r) <= RTOL * abs(loss_r), (loss_t, loss_r)
    np.testing.assert_allclose(logs_t, logs_r, rtol=RTOL)
    for step, (gr, gt, gw) in enumerate(zip(grads_r, grads_t, wide[2])):
        assert gr.keys() == gt.keys()
        for n in gr:
            assert _rel(gt[n], gr[n]) <= tol(gw[n], gr[n]), (step, n, _rel(gt[n], gr[n]))
    for n, p in params_r.items():
        p, q, w = p.detach(), params_t[n].detach(), wide[3][n].detach()
        assert _rel(q, p) <= tol(w, p), (n, _rel(q, p), tol(w, p))


def test_rows_to_tree_counts_what_trainer_counts_and_merges_shared_prefixes():
    rows = _rows(seed=1, tasks=2)
    trees, items = rows_to_tree(rows)
    (tree,) = trees
    lab = _pad(rows)["labels"]
    assert items == int((lab[:, 1:] != -100).sum())
    assert tree.num_sequences == len(rows)
    assert tree.num_tokens < sum(len(r["input_ids"]) for r in rows)
    for i, r in enumerate(rows):  # each row's tokens and trained positions
        assert tree.sequence(i).tolist() == r["input_ids"]
        assert np.asarray(tree.loss_mask(i)).tolist() == [int(x != -100) for x in r["labels"]]
    batch = TreeCollator()(rows)["tree_batch"]  # weights: rows training each token
    assert float(batch.loss_weights.sum()) == pytest.approx(
        sum(sum(x != -100 for x in r["labels"][1:]) for r in rows))
    # other ways to say what a row trains, and rows already trees
    mask_rows = [{"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 1, 1]},
                 {"input_ids": [5, 6, 9, 0], "attention_mask": [1, 1, 1, 0]}]
    trees, items = rows_to_tree(mask_rows + [{"tree": tree}])
    assert items == 2 + 2 + int((lab[:, 1:] != -100).sum())
    assert trees[0] is tree and trees[1].sequence(1).tolist() == [5, 6, 9]
    # model calls of treefx.data (trained on the completion or their loss_mask), and trees
    # as records (Tree.to_dict(), a mapping or JSON: what a datasets.Dataset column holds)
    from treefx.data import Call

    calls = [Call([5, 6], [7, 8]), {"prompt_ids": [5, 6], "completion_ids": [9],
                                    "loss_mask": [0, 1, 1], "logprobs": None}]
    (merged,), items = rows_to_tree(calls)
    assert items == 2 + 2 and merged.sequences == [[5, 6, 7, 8], [5, 6, 9]]
    assert [m.tolist() for m in merged.loss_masks] == [[0, 0, 1, 1], [0, 1, 1]]
    record = tree.to_dict()
    assert "weights" not in record  # a column other rows fill: None in this row
    trees, items = rows_to_tree([{"tree": record}, {"tree": json.dumps(record)},
                                 {"tree": {**record, "weights": None}}])
    assert trees == [tree] * 3 and items == 3 * int((lab[:, 1:] != -100).sum())


def test_tree_trainer_errors(tmp_path):
    with pytest.raises(ValueError, match=r"labels\[2\] = 9 but input_ids\[2\] = 7"):
        rows_to_tree([{"input_ids": [5, 6, 7], "labels": [-100, 6, 9]}])
    with pytest.raises(TypeError, match="expected a mapping with 'input_ids'"):
        rows_to_tree([[1, 2, 3]])
    with pytest.raises(ValueError, match="row 0: 'tree' is a string but not a JSON tree"):
        rows_to_tree([{"tree": "[1, 2"}])
    with pytest.raises(ValueError, match="row 1: completion_ids"):
        rows_to_tree([{"input_ids": [1, 2]}, {"prompt_ids": [1], "completion_ids": []}])
    with pytest.raises(ValueError, match="sets \\['reduction'\\] itself"):
        TreeCollator(reduction="mean")
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                             label_smoothing_factor=0.1)
    with pytest.raises(ValueError, match="label_smoothing_factor is not supported"):
        TreeTrainer(model=_model(), args=args, train_dataset=_rows())
    with pytest.raises(ValueError, match="compute_loss_func"):
        TreeTrainer(model=_model(), args=args, train_dataset=_rows(),
                    compute_loss_func=lambda *a, **k: 0)


def _pad_with_masks(rows):
    """The stock path for rows that may carry an ``attention_mask`` of their own (0 on padding
    they were stored with): right-padded to the longest row, as transformers' padding
    collators pad; labels -100 on padding."""
    n = max(len(r["input_ids"]) for r in rows)
    out = {"input_ids": torch.zeros(len(rows), n, dtype=torch.long),
           "attention_mask": torch.zeros(len(rows), n, dtype=torch.long),
           "labels": torch.full((len(rows), n), -100, dtype=torch.long)}
    for i, r in enumerate(rows):
        k = len(r["input_ids"])
        out["input_ids"][i, :k] = torch.tensor(r["input_ids"])
        out["attention_mask"][i, :k] = torch.tensor(r.get("attention_mask", [1] * k))
        out["labels"][i, :k] = torch.tensor(r["labels"])
    return out


@pytest.mark.parametrize("mode", ["all", "non_padding"])
def test_num_input_tokens_seen_counts_what_the_stock_trainer_counts(tmp_path, mode):
    """``include_num_input_tokens_seen``: ``Trainer`` counts ``input_ids.numel()`` of each
    padded micro-batch ("all"; True means it) or ``attention_mask.sum()`` ("non_padding").
    The tree batch has no ``input_ids``, so the count stayed 0 (with a warning about
    ``main_input_name``); now every logged count and the final one equal the stock trainer's
    on the same rows, two of them stored with padding of their own (attention_mask 0)."""
    rows = _rows()[:12]
    for r in rows[:2]:
        r["input_ids"] = r["input_ids"] + [0, 0, 0]
        r["labels"] = r["labels"] + [-100] * 3
        r["attention_mask"] = [1] * (len(r["input_ids"]) - 3) + [0] * 3

    def run(cls, **kw):
        args = TrainingArguments(
            output_dir=str(tmp_path / cls.__name__), per_device_train_batch_size=3,
            gradient_accumulation_steps=2, num_train_epochs=1, learning_rate=1e-3,
            logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True,
            dataloader_num_workers=0, include_num_input_tokens_seen=mode)
        trainer = cls(model=_model(), args=args, train_dataset=rows, **kw)
        trainer.train()
        seen = [h["num_input_tokens_seen"] for h in trainer.state.log_history
                if "num_input_tokens_seen" in h]
        return trainer.state.num_input_tokens_seen, seen

    stock = run(Trainer, data_collator=_pad_with_masks)
    tree = run(TreeTrainer, tree_compile={"backend": "eager"})
    assert stock[0] > 0 and len(stock[1]) == 3
    assert tree == stock, (tree, stock)
    padded = stock[0] > sum(len(r["input_ids"]) for r in rows)
    assert padded == (mode != "non_padding")
