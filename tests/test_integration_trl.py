"""treefx.integrations.trl against TRL's own GRPOTrainer, with the real library (CPU, a tiny
Qwen3 with random weights, float32, a few optimizer steps).

Both trainers get the same data: the same dataset order (TRL's seeded sampler), the same
rollouts (a deterministic ``rollout_func``, so no sampling differs) and the same initial
weights (one saved checkpoint). Compared: the loss of every micro-batch, every gradient as the
optimizer sees it, and every parameter after every optimizer step, to 1e-5 relative; and every
statistic the stock trainer logs (1e-5 relative + 1e-6 absolute). The tree trainer runs with
its defaults (TRL's micro-batches) for every ``loss_type`` and the options whose objective
depends on which rows share a micro-batch; ``keep_groups_together=True`` (whole groups per
micro-batch) against stock TRL where it is allowed, and its refusals where it is not.
"""

from __future__ import annotations

import os
import re
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
                  config=config)
    stock = _train(trl.GRPOTrainer, checkpoint, tmp_path / "stock", multi_turn=True, steps=2,
                   config=config)
    assert len(tree[0]) == 4  # 2 steps x 2 micro-batches
    assert len(tree[3]._tree_models) == 2  # the policy and the reference ran on trees
    _compare(tree, stock)


# What the stock trainer logs that is a clock reading, not a statistic of the training.
_CLOCK = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
ATOL_METRIC = 1e-6  # logged statistics: |tree - stock| <= RTOL * |stock| + ATOL_METRIC


def _compare_logs(tree_trainer, stock_trainer, *, only=None):
    """Every statistic the stock trainer logs (each ``log_history`` entry, clock readings
    aside), the tree trainer logs too, with the same value; ``only``: compare those keys'
    values alone (the rest must still be logged). Returns the largest difference as a
    fraction of its tolerance."""
    tree_logs, stock_logs = tree_trainer.state.log_history, stock_trainer.state.log_history
    assert len(tree_logs) == len(stock_logs) > 0
    worst = 0.0
    for t, s in zip(tree_logs, stock_logs):
        missing = set(s) - set(t)
        assert not missing, f"the tree trainer does not log {sorted(missing)}"
        for k, v in s.items():
            if k in _CLOCK or (only is not None and k not in only):
                continue
            if not isinstance(v, (int, float)):
                assert t[k] == v, (k, t[k], v)
                continue
            err = abs(t[k] - v) / (RTOL * abs(v) + ATOL_METRIC)
            assert err <= 1, (k, t[k], v)
            worst = max(worst, err)
    return worst


# Each case: GRPOConfig options (beside _BASE) a stock GRPOTrainer trains with, which the tree
# trainer's defaults must train the same. Every loss_type of TRL 1.16
# (GRPOConfig.loss_type), the entropy quantile and bonus, and steps_per_generation >
# gradient_accumulation_steps with a reference model; num_iterations=2 in _BASE (old
# log-probs; the second pass over a generation batch has ratios away from 1, so clipping and
# the soft gates act).
_BASE = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_iterations=2,
             optim="sgd", learning_rate=0.5)
_CASES = {
    "bnpo": dict(loss_type="bnpo"),
    "sapo": dict(loss_type="sapo"),
    "top_entropy_quantile": dict(top_entropy_quantile=0.3),
    "steps_per_generation_beta": dict(steps_per_generation=4, num_iterations=1, beta=0.04,
                                      temperature=0.8),
    "grpo": dict(loss_type="grpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "dapo": dict(loss_type="dapo"),
    "cispo": dict(loss_type="cispo"),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "vespo": dict(loss_type="vespo"),
    "gspo_off_policy_mask": dict(loss_type="grpo", importance_sampling_level="sequence",
                                 off_policy_mask_threshold=0.05),
    "entropy_bonus": dict(entropy_coef=0.05, use_adaptive_entropy=True, entropy_target=10.0),
}
_DEFAULT_RUN = ("bnpo", "sapo", "top_entropy_quantile", "steps_per_generation_beta")


@pytest.mark.parametrize("case", [c if c in _DEFAULT_RUN else
                                  pytest.param(c, marks=pytest.mark.slow) for c in _CASES])
def test_defaults_train_what_grpo_trainer_trains(checkpoint, tmp_path, case):
    """TreeGRPOTrainer with its defaults against TRL's own GRPOTrainer, the same options:
    losses, gradients and parameters after every optimizer step to 1e-5 relative, and every
    logged statistic (the same keys; values to 1e-5 relative + 1e-6). About 3 s a case (most
    of it treefx compiling the tiny model); 4 in the default run, all 12 with -m slow."""
    from treefx.integrations.trl import TreeGRPOTrainer

    config = {**_BASE, **_CASES[case]}
    tree = _train(TreeGRPOTrainer, checkpoint, tmp_path / "tree", multi_turn=False, steps=2,
                  config=config)
    stock = _train(trl.GRPOTrainer, checkpoint, tmp_path / "stock", multi_turn=False, steps=2,
                   config=config)
    assert tree[3]._tree_models and not tree[3].keep_groups_together
    _compare(tree, stock)
    print(f"logged statistics: largest difference {_compare_logs(tree[3], stock[3]):.2f} of "
          "the tolerance")


@pytest.mark.parametrize("loss_type", ["dapo", *(pytest.param(t, marks=pytest.mark.slow)
                                                 for t in ("grpo", "dr_grpo", "cispo", "sapo",
                                                           "luspo", "vespo"))])
def test_keep_groups_together_trains_what_grpo_trainer_trains(checkpoint, tmp_path, loss_type):
    """Opted in, groups shuffled whole: each micro-batch of 4 rows is one group (one tree,
    one prompt), other rows than stock TRL's micro-batches; with a loss whose sum over a
    generation batch does not depend on which rows share a micro-batch, and every generation
    batch in one optimizer step, the parameters after every step are stock GRPOTrainer's (to
    1e-5 relative), as are the logged loss and the generation batch's statistics."""
    from treefx.integrations.trl import TreeGRPOTrainer

    seen = []

    class Watch(TreeGRPOTrainer):
        def _compute_loss(self, model, inputs):
            p = inputs["prompt_ids"] * inputs["prompt_mask"]
            seen.append(bool((p == p[:1]).all()))
            return super()._compute_loss(model, inputs)

    config = {**_BASE, "loss_type": loss_type}
    if loss_type == "luspo":
        config["importance_sampling_level"] = "sequence"
    tree = _train(Watch, checkpoint, tmp_path / "tree", multi_turn=False, steps=2,
                  config=config, keep_groups_together=True)
    stock = _train(trl.GRPOTrainer, checkpoint, tmp_path / "stock", multi_turn=False, steps=2,
                   config=config)
    assert len(seen) == 4 and all(seen)
    (_, tg, tp, trainer), (_, sg, sp, _) = tree, stock
    assert len(tp) == len(sp) == 2
    grad_err = max(_rel(a[n], b[n]) for a, b in zip(tg, sg) for n in b)
    param_err = max(_rel(a[n], b[n]) for a, b in zip(tp, sp) for n in b)
    print(f"grads {grad_err:.2e}, params {param_err:.2e}")
    assert grad_err <= RTOL and param_err <= RTOL
    # per-micro-batch means (kl, entropy, clip ratios) are over other rows; the rest agrees
    _compare_logs(trainer, stock[3], only={"loss", "train_loss", "reward", "reward_std",
                                           "frac_reward_zero_std", "num_tokens", "grad_norm",
                                           "completions/mean_length"})


@pytest.mark.parametrize("config, option", [
    (dict(loss_type="bnpo"), "loss_type='bnpo'"),
    (dict(top_entropy_quantile=0.3), "top_entropy_quantile=0.3"),
    (dict(entropy_coef=0.01), "entropy_coef=0.01"),
    (dict(steps_per_generation=4), "steps_per_generation=4"),
])
def test_keep_groups_together_refuses_options_that_depend_on_micro_batches(
        checkpoint, tmp_path, config, option):
    """Where TRL's update depends on which rows share a micro-batch, keep_groups_together=True
    would train something else: refused in one line naming the option. The defaults take it."""
    import datasets

    from treefx.integrations.trl import TreeGRPOTrainer, composition_dependent_options

    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                          num_generations=G, per_device_train_batch_size=4,
                          gradient_accumulation_steps=2, bf16=False, **config)
    assert composition_dependent_options(args)[0].startswith(option)
    dataset = datasets.Dataset.from_list([{"prompt": p} for p in _prompts()])
    kw = dict(model=checkpoint, reward_funcs=_reward, args=args, train_dataset=dataset,
              rollout_func=_rollout_func(False))
    with pytest.raises(ValueError, match=r"keep_groups_together=True.*" + re.escape(option)):
        TreeGRPOTrainer(keep_groups_together=True, **kw)
    assert not TreeGRPOTrainer(**kw).keep_groups_together
    ok = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                        num_generations=G, per_device_train_batch_size=4,
                        gradient_accumulation_steps=4, steps_per_generation=2, bf16=False)
    assert composition_dependent_options(ok) == []


def test_shuffle_groups_leaves_trls_random_stream():
    """The group shuffle draws TRL's row permutation: the global generator is left where
    TRL's shuffle leaves it (TRL samples the next completions from it), and the groups come
    in a uniformly random order (each group's 4 rows together, in order)."""
    from trl.trainer.utils import shuffle_sequence_dict

    from treefx.integrations.trl import shuffle_groups

    n, g = 12, 4
    batch = {"prompt_ids": torch.arange(n // g).repeat_interleave(g)[:, None],
             "prompt_mask": torch.ones(n, 1, dtype=torch.long), "row": list(range(n)),
             "num_items_in_batch": torch.tensor(7)}
    torch.manual_seed(1)
    shuffle_sequence_dict(batch)
    after_trl = torch.rand(3)
    firsts = set()
    for seed in range(40):
        torch.manual_seed(seed)
        out = shuffle_groups(batch, g)
        if seed == 1:
            assert torch.equal(torch.rand(3), after_trl)
        rows = torch.tensor(out["row"]).view(n // g, g)
        assert torch.equal(rows, rows[:, :1] + torch.arange(g))
        assert torch.equal(out["prompt_ids"][:, 0], torch.tensor(out["row"]) // g)
        assert int(out["num_items_in_batch"]) == 7
        firsts.add(int(rows[0, 0]) // g)
    assert firsts == {0, 1, 2}


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


@pytest.mark.slow  # ~40 s; the cause is checked in tests/test_regional.py (autocast region)
def test_bf16_runs_layer_by_layer_and_the_reference_shares_the_policys_graph(
        checkpoint, tmp_path, caplog):
    """TRL's ``bf16=True`` (what it sets on a GPU): accelerate wraps the model's forward in
    ``torch.autocast``, whose region the captured graph enters before the first layer and
    leaves after the last. Regional execution (the GPU's default, here through AOTAutograd on
    the CPU) carries the region into each layer's piece instead of refusing the graph: no
    fallback to the whole graph, whose compile grows with depth, and the reference model (a
    twin, with ``beta != 0``, under the first-call check that twins need) runs the policy's
    graph instead of capturing its own. With gradient checkpointing, which TRL turns off around
    its no-grad calls, the policy captures one graph, checkpointed, for its old log-probs and
    its loss alike (``TreeEngine.captures_training``), and its first-call check compares
    gradients."""
    import logging

    from treefx.integrations.trl import TreeGRPOTrainer

    config = dict(per_device_train_batch_size=4, gradient_accumulation_steps=1, beta=0.04,
                  num_iterations=2, learning_rate=1e-4, bf16=True, gradient_checkpointing=True)
    with caplog.at_level(logging.INFO, logger="treefx"):
        losses, _, _, trainer = _train(
            TreeGRPOTrainer, checkpoint, tmp_path, multi_turn=False, steps=2, config=config,
            compile_options={"backend": "aot-eager", "regional": True, "verify": True})
    text = caplog.text
    assert "regional execution: the graph changes" not in text and "whole graph" not in text
    assert "running the no-grad graph of a twin model" in text
    tms = {("ref" if m is trainer.ref_model else "policy"): tm
           for m, tm in trainer._tree_models.values()}
    assert tms["ref"].engine.twin_used and tms["ref"].num_compilations == 0
    policy = tms["policy"]
    (key,) = [k for k, gs in policy.engine._regional.items() if gs]
    assert len(policy.engine._regional[key]) == 1 and policy.num_compilations == 1
    assert key[2] and any(key[-1])  # captured with gradients, checkpointing on
    assert policy.verification.passed and policy.verification.compared_params > 0
    assert all(torch.isfinite(x) for x in losses)


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


@pytest.mark.slow  # ~35 s; the trainer itself is checked above
def test_example_runs_and_matches(capsys):
    """examples/grpo_trl.py: TRL's own sampling; GRPOTrainer, the tree trainer's defaults
    (the same micro-batch losses) and keep_groups_together=True (other micro-batches, the same
    sum per optimizer step): the same parameters."""
    import pathlib
    import runpy

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "grpo_trl.py"
    runpy.run_path(str(path), run_name="example")["main"](["--steps", "2"])
    out = capsys.readouterr().out
    errs = [float(x) for x in re.findall(r"max relative difference ([\d.e+-]+)", out)]
    rows = [[float(x) for x in r] for r in
            re.findall(r"^\s+\d+\s+(-?[\d.]+)\s+(-?[\d.]+)\s+(-?[\d.]+)$", out, re.M)]
    assert len(rows) == 4 and len(errs) == 2 and max(errs) <= RTOL, out
    assert all(abs(t - s) <= 1e-6 for s, t, _ in rows), out
    for step in (rows[:2], rows[2:]):  # 2 micro-batches an optimizer step
        assert abs(sum(r[2] for r in step) - sum(r[0] for r in step)) <= 2e-6, out
