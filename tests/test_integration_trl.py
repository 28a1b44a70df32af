"""treefx.integrations.trl against TRL's own GRPOTrainer, with the real library (CPU, a tiny
Qwen3 with random weights, float32, a few optimizer steps).

Both trainers get the same data: the same dataset order (TRL's seeded sampler), the same
rollouts (a deterministic ``rollout_func``, so no sampling differs) and the same initial
weights (one saved checkpoint). Compared: the loss of every micro-batch, every gradient as the
optimizer sees it, and every parameter after every optimizer step, to 1e-5 relative.
"""

from __future__ import annotations

import os
import zlib

import pytest

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

import torch  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

RTOL = 1e-5
G = 4  # num_generations

# Three prior turns before the question: prompts share the system turn, and each group's G
# completions share its prompt.
SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer briefly."}
QUESTIONS = ["What is 2 + 3?", "Name a prime above 10.", "Spell cat backwards.",
             "Is 9 odd?", "Largest of 4, 7, 1?", "What is 6 times 7?"]


def _prompts():
    return [[SYSTEM, {"role": "user", "content": "Hi."},
             {"role": "assistant", "content": "Hello! How can I help?"},
             {"role": "user", "content": q}] for q in QUESTIONS]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3 (random weights) and the offline chat tokenizer, saved: each trainer loads
    the same weights, and TRL builds the reference model from the same path."""
    import transformers

    from treefx.models.chat import tiny_chat_tokenizer

    tok = tiny_chat_tokenizer()
    config = transformers.AutoConfig.for_model(
        "qwen3", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    path = tmp_path_factory.mktemp("qwen3_tiny")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _rollout_func(multi_turn: bool):
    """Deterministic rollouts: each row's tokens a function of its prompt and its index in the
    group. ``multi_turn``: the G completions of a prompt share a first assistant turn and a
    tool result (masked out of the loss by ``env_mask``, as TRL's tool loop masks tool output)
    and then branch."""

    def rollout(prompts, trainer):
        tok = trainer.processing_class
        vocab = len(tok)
        seen: dict[int, int] = {}
        prompt_ids, completion_ids, env_mask = [], [], []
        for messages in prompts:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            key = zlib.crc32(repr(ids).encode())
            k = seen.get(key, 0)
            seen[key] = k + 1
            shared = torch.Generator().manual_seed(key)
            own = torch.Generator().manual_seed(key * 31 + k + 1)
            draw = lambda n, g: torch.randint(10, vocab - 10, (n,), generator=g).tolist()  # noqa: E731
            tail = draw(2 + (3 * k) % 5, own) + [tok.eos_token_id]
            if multi_turn:
                turn, tool = draw(5, shared), draw(4, shared)
                completion = turn + tool + tail
                mask = [1] * len(turn) + [0] * len(tool) + [1] * len(tail)
            else:
                completion, mask = tail, [1] * len(tail)
            prompt_ids.append(ids)
            completion_ids.append(completion)
            env_mask.append(mask)
        out = {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}
        if multi_turn:
            out["env_mask"] = env_mask
        return out

    return rollout


def _reward(completions, completion_ids=None, **kwargs):
    text = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(zlib.crc32(t.encode()) % 97) / 97.0 for t in text]


def _train(cls, checkpoint, tmp_path, *, multi_turn, steps, config, **trainer_kwargs):
    """Train ``steps`` optimizer steps; return (micro-batch losses, grads per step, params
    after each step)."""
    import datasets
    import transformers

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    losses, grads, params = [], [], []

    class Record(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                          if p.grad is not None})

        def on_optimizer_step(self, args, state, control, model=None, **kw):
            params.append({n: p.detach().clone() for n, p in model.named_parameters()})

    class Recording(cls):
        def compute_loss(self, *a, **kw):
            loss = super().compute_loss(*a, **kw)
            losses.append(loss.detach().clone())
            return loss

    args = trl.GRPOConfig(**{
        "output_dir": str(tmp_path), "use_cpu": True, "report_to": "none",
        "save_strategy": "no", "logging_steps": 1, "max_steps": steps, "seed": 0,
        "num_generations": G, "max_completion_length": 32, "disable_dropout": True,
        "bf16": False, **config})
    dataset = datasets.Dataset.from_list([{"prompt": p} for p in _prompts()])
    trainer = Recording(model=checkpoint, reward_funcs=_reward, args=args,
                        train_dataset=dataset, rollout_func=_rollout_func(multi_turn),
                        callbacks=[Record()], **trainer_kwargs)
    trainer.train()
    return losses, grads, params, trainer


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _compare(tree, stock):
    (tl, tg, tp, _), (sl, sg, sp, _) = tree, stock
    assert len(tl) == len(sl) > 0 and len(tg) == len(sg) > 0 and len(tp) == len(sp) == len(tg)
    loss_err = max(abs(float(a) - float(b)) / max(abs(float(b)), 1e-12) for a, b in zip(tl, sl))
    grad_err = max(_rel(a[n], b[n]) for a, b in zip(tg, sg) for n in b)
    assert all(a.keys() == b.keys() for a, b in zip(tg, sg))
    param_err = max(_rel(a[n], b[n]) for a, b in zip(tp, sp) for n in b)
    print(f"losses {[round(float(x), 6) for x in sl]}: max rel err loss {loss_err:.2e}, "
          f"grads {grad_err:.2e}, params {param_err:.2e}")
    assert loss_err <= RTOL and grad_err <= RTOL and param_err <= RTOL, \
        (loss_err, grad_err, param_err)
    # the update did something: parameters moved from one step to the next
    assert any(_rel(tp[0][n], tp[-1][n]) > 1e-4 for n in tp[0]) or len(tp) == 1


def test_tree_trainer_equals_trl_row_shuffle_multi_turn_accumulation(checkpoint, tmp_path):
    """TRL's own micro-batching (rows shuffled, groups split across micro-batches), gradient
    accumulation over 2 micro-batches, completions sharing a first turn and a tool result, a
    reference model (beta), old log-probs (num_iterations=2), temperature 0.8."""
    from treefx.integrations.trl import TreeGRPOTrainer

    config = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, beta=0.04,
                  num_iterations=2, temperature=0.8, optim="sgd", learning_rate=0.5)
    tree = _train(TreeGRPOTrainer, checkpoint, tmp_path / "tree", multi_turn=True, steps=2,
                  config=config, keep_groups_together=False)
    stock = _train(trl.GRPOTrainer, checkpoint, tmp_path / "stock", multi_turn=True, steps=2,
                   config=config)
    assert len(tree[0]) == 4  # 2 steps x 2 micro-batches
    assert len(tree[3]._tree_models) == 2  # the policy and the reference ran on trees
    _compare(tree, stock)


def test_tree_trainer_keeps_groups_together(checkpoint, tmp_path):
    """Groups shuffled whole: each micro-batch of 4 rows is one group (one tree, one prompt);
    equal to TRL's own log-prob path under the same shuffling (``trees=False``)."""
    from treefx.integrations.trl import TreeGRPOTrainer

    seen = []

    class Watch(TreeGRPOTrainer):
        def _compute_loss(self, model, inputs):
            p = inputs["prompt_ids"] * inputs["prompt_mask"]
            seen.append(bool((p == p[:1]).all()))
            return super()._compute_loss(model, inputs)

    config = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2,
                  loss_type="bnpo", learning_rate=1e-4)
    tree = _train(Watch, checkpoint, tmp_path / "tree", multi_turn=False, steps=2,
                  config=config)
    stock = _train(TreeGRPOTrainer, checkpoint, tmp_path / "stock", multi_turn=False, steps=2,
                   config=config, trees=False)
    assert seen and all(seen)
    assert len(tree[3]._tree_models) == 1 and not stock[3]._tree_models
    _compare(tree, stock)


def test_generation_batches_keep_one_graph_with_gradient_checkpointing(checkpoint, tmp_path):
    """TRL switches gradient checkpointing off and on around each generation batch's no-grad
    block, and transformers' ``gradient_checkpointing_enable`` adds a forward hook to the input
    embeddings every time. A tree-compiled graph is guarded on those hooks: without
    ``_keep_input_grad_hooks`` every generation batch recompiled the policy's graph (and past
    Dynamo's recompile limit training stopped). Four generation batches: one hook, one graph."""
    from treefx.integrations.trl import TreeGRPOTrainer

    config = dict(per_device_train_batch_size=4, gradient_accumulation_steps=1,
                  gradient_checkpointing=True, learning_rate=1e-4)
    losses, _, _, trainer = _train(TreeGRPOTrainer, checkpoint, tmp_path, multi_turn=False,
                                   steps=4, config=config)
    assert len(losses) == 4 and trainer.model.is_gradient_checkpointing
    assert len(trainer.model.get_input_embeddings()._forward_hooks) == 1
    ((_, tm),) = trainer._tree_models.values()
    assert tm.num_compilations == 1


@pytest.mark.slow  # ~15 s; the cause is checked in tests/test_checkpointing.py
def test_first_call_check_with_trls_bf16_and_gradient_checkpointing(checkpoint, tmp_path):
    """TRL's defaults, bfloat16 autocast and gradient checkpointing, with treefx's first-call
    check on: the check runs the model alone in the same autocast region before the tree
    call, which once made the Trainer's backward fail ("aten._to_copy ... not found in
    storage", autocast's weight cache); it trains and the check passes."""
    from treefx.integrations.trl import TreeGRPOTrainer

    config = dict(per_device_train_batch_size=4, gradient_accumulation_steps=1,
                  learning_rate=1e-4, bf16=True, gradient_checkpointing=True)
    losses, _, params, trainer = _train(TreeGRPOTrainer, checkpoint, tmp_path, multi_turn=False,
                                        steps=1, config=config,
                                        compile_options={"verify": True})
    assert trainer.args.bf16 and trainer.args.gradient_checkpointing
    ((_, tm),) = trainer._tree_models.values()
    assert tm.verification.passed and tm.verification.compared_params > 0
    assert len(params) == 1 and all(torch.isfinite(x) for x in losses)


def test_logps_and_entropies_equal_trls_fused_head():
    """The function the trainer calls, alone: rows of two prompts (left-padded), completions
    sharing a first turn (right-padded), temperature 0.7; log-probs, entropies and their
    gradients equal TRL's fused LM head on the padded rows."""
    import treefx
    from treefx.integrations.trl import tree_logps_and_entropies
    from treefx.tools.debug.examples import qwen3_tiny
    from trl.trainer.utils import add_fused_lm_head

    model = qwen3_tiny().float()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    vocab, P, C = model.config.vocab_size, 6, 5
    g = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(1, vocab, (n,), generator=g).tolist()  # noqa: E731
    prompts, shared = [draw(4), draw(6)], draw(2)
    rows = [(p, shared + draw(1 + i)) for p in prompts for i in range(3)]
    ids = torch.zeros(len(rows), P + C, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (p, c) in enumerate(rows):
        ids[b, P - len(p):P], mask[b, P - len(p):P] = torch.tensor(p), 1
        ids[b, P:P + len(c)], mask[b, P:P + len(c)] = torch.tensor(c), 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-C] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    lp_ref, ent_ref = out.log_probs[:, -C:], out.entropy[:, -C:]
    (lp_ref.sum() + ent_ref.sum()).backward()
    g_ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    lp, ent = tree_logps_and_entropies(treefx.compile(model, verify=False), ids, mask, C,
                                       temperature=0.7, compute_entropy=True)
    (lp.sum() + ent.sum()).backward()
    torch.testing.assert_close(lp, lp_ref, rtol=RTOL, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=RTOL, atol=1e-5)
    assert max(_rel(p.grad, r) for p, r in zip(model.parameters(), g_ref)) <= RTOL
    # a row whose tokens are not one run: refused
    mask[0, P + 1] = 0
    with pytest.raises(ValueError, match="not contiguous"):
        tree_logps_and_entropies(treefx.compile(model, verify=False), ids, mask, C)


def test_unsupported_version_names_the_supported_ones():
    from treefx.integrations.trl import SUPPORTED_TRL_VERSIONS, check_trl_version

    assert check_trl_version() == trl.__version__ in SUPPORTED_TRL_VERSIONS
    with pytest.raises(ImportError, match=r"supports trl 1\.16\.0.*trl 0\.9\.9 is installed"):
        check_trl_version("0.9.9")
    # the extra pins exactly the versions the check accepts
    import pathlib
    import re

    pyproject = (pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    extra = re.search(r"^trl = \[(.*)\]$", pyproject, re.M).group(1)
    assert re.findall(r'"(trl[=<>!~].*?)"', extra) == [f"trl=={v}" for v in SUPPORTED_TRL_VERSIONS]


@pytest.mark.slow  # ~25 s; the trainer itself is checked above
def test_example_runs_and_matches(capsys):
    """examples/grpo_trl.py: TRL's own sampling, both trainers, the same parameters."""
    import pathlib
    import re
    import runpy

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "grpo_trl.py"
    runpy.run_path(str(path), run_name="example")["main"](["--steps", "2"])
    out = capsys.readouterr().out
    err = float(re.search(r"max relative difference ([\d.e+-]+)", out).group(1))
    rows = re.findall(r"^\s+\d+\s+(-?[\d.]+)\s+(-?[\d.]+)$", out, re.M)
    assert len(rows) == 4 and err <= RTOL, out
    assert all(abs(float(a) - float(b)) <= 1e-6 for a, b in rows), out
