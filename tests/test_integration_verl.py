"""treefx's verl engine (treefx.integrations.verl) against verl's own FSDP engine.

Runs where verl 0.9.1 is installed (its own environment: verl pins transformers <5.11, so the
suite's environment does not have it; ``tests/test_verl_environment.py`` makes that environment
and runs this file there). One gloo process on the CPU, float32, a tiny Qwen3 saved once and
loaded by both engines (the same weights); verl's stock ``FSDPEngineWithLMHead`` and
``TreeFSDPEngine`` are built from the same four configs and fed the same micro-batches, as
verl's trainer makes them (padded rows, ``left_right_2_no_padding``, the worker's metadata).
Compared: log-probs, entropies, sum of squared probabilities, verl's PPO loss (clipped policy
loss, KL loss, entropy bonus) and its metrics, every parameter's gradient after micro-batches
accumulated over several calls, and the optimizer's next parameters (SGD with momentum, two
steps: see ``_configs``).
"""

from __future__ import annotations

import functools
import os

import pytest

verl = pytest.importorskip("verl")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

RTOL = 1e-5


@pytest.fixture(scope="module")
def tv():
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            os.environ.setdefault(k, v)
        dist.init_process_group("gloo")
    import treefx.integrations.verl as tv

    tv.use_cpu_platform()
    return tv


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("qwen3")
    Qwen3ForCausalLM(cfg).save_pretrained(folder)
    return str(folder)


def _configs(model_dir, *, strategy="fsdp2", lora_rank=0, checkpointing=False, **model_kw):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    model = HFModelConfig(path=model_dir, load_tokenizer=False, use_remove_padding=True,
                          enable_gradient_checkpointing=checkpointing, lora_rank=lora_rank,
                          override_config={"attn_implementation": "sdpa"}, **model_kw)
    engine = FSDPEngineConfig(strategy=strategy, model_dtype="fp32", use_torch_compile=False,
                              mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32",
                                               "buffer_dtype": "fp32"})
    # SGD (torch.optim, as verl builds it): its update is linear in the gradient, so the next
    # parameters compare at the gradients' precision. AdamW's first step moves each element by
    # about lr * sign(gradient), so an element whose gradient is at rounding level (~1e-9
    # here) moves by +lr or -lr on either path: no tolerance below lr holds for it.
    optim = FSDPOptimizerConfig(lr=1e-1, total_training_steps=10, weight_decay=0.01,
                                optimizer="SGD", override_optimizer_config={"momentum": 0.9})
    return model, engine, optim, CheckpointConfig()


def _engine(cls, model_dir, **kw):
    engine = cls(*_configs(model_dir, **kw))
    engine.initialize()
    return engine


@pytest.fixture(scope="module")
def engines(tv, model_dir):
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    return _engine(FSDPEngineWithLMHead, model_dir), _engine(tv.TreeFSDPEngine, model_dir)


def _rows(seed=0, vocab=96):
    """Prompts and responses of two tasks: each task's prompts share a system prompt and earlier
    turns (a multi-turn prompt), three responses each, with a duplicate response, a one-token
    response and a response that is a prefix of another."""
    g = torch.Generator().manual_seed(seed)
    tok = lambda n: torch.randint(1, vocab, (n,), generator=g).tolist()  # noqa: E731
    system = tok(9)
    rows = []
    for task in range(2):
        history = system + tok(5 + 3 * task)
        prompt = history + tok(4)
        a, b = tok(6), tok(1)
        for resp in (a, a, b) if task == 0 else (a, a[:3], tok(7)):
            rows.append((prompt, resp))
    second_turn = rows[0][0] + rows[0][1] + tok(3)   # a later turn of task 0's first rollout
    rows.append((second_turn, tok(5)))
    rows.append((rows[3][0], tok(2)))
    rows.append((system + tok(2), tok(1)))     # a third task: its only row
    return rows


def _batch(rows, *, temperature=1.0, seed=1):
    """verl's update batch for ``rows`` (``update_batch``: padded as its rollout returns them,
    made jagged by ``left_right_2_no_padding``, the worker's metadata), with random old and
    reference log-probs and advantages."""
    import treefx.integrations.verl as tv

    g = torch.Generator().manual_seed(seed)
    B, R = len(rows), max(len(r) for _, r in rows)
    return tv.update_batch(rows, {
        "old_log_probs": -torch.rand(B, R, generator=g) * 3,
        "ref_log_prob": -torch.rand(B, R, generator=g) * 3,
        "advantages": torch.randn(B, R, generator=g),
    }, temperature=temperature, global_batch_size=B, use_remove_padding=True,
        use_fused_kernels=False)


def _meta(td, **kw):
    from verl.utils import tensordict_utils as tu

    td = td.clone()
    tu.assign_non_tensor(td, **kw)
    return td


def _close(a, b, what):
    a, b = a.detach().double(), b.detach().double()
    scale = max(float(b.abs().max()), 1.0)
    err = float((a - b).abs().max()) / scale
    assert err <= RTOL, f"{what}: relative difference {err:.3g} > {RTOL}"


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _infer(engine, td, **kw):
    with engine.eval_mode():
        out = engine.infer_batch(_meta(td, use_dynamic_bsz=False, micro_batch_size_per_gpu=3,
                                       compute_loss=False, **kw))
    return out["model_output"]


def _values(x):
    return x.values() if x.is_nested else x


def _cat_outputs(outs, key):
    return torch.cat([_values(o[key]) for o in outs]) if isinstance(outs, list) else \
        _values(outs[key])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_entropy_and_sum_pi_squared_match_verls_engine(engines, temperature):
    stock, tree = engines
    td = _batch(_rows(), temperature=temperature)
    kw = dict(calculate_entropy=True, calculate_sum_pi_squared=True)
    want, got = _infer(stock, td, **kw), _infer(tree, td, **kw)
    for key in ("log_probs", "entropy", "sum_pi_squared"):
        _close(_cat_outputs(got, key), _cat_outputs(want, key), key)
    # the tree ran fewer tokens than the rows hold
    assert tree.tree_stats["tree_tokens"] < tree.tree_stats["sequence_tokens"]


def _ppo_loss(**overrides):
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    cfg = dict(strategy="fsdp2", rollout_n=3, ppo_micro_batch_size_per_gpu=3, use_kl_loss=True,
               kl_loss_coef=0.1, entropy_coeff=0.01, loss_agg_mode="token-mean")
    cfg.update(overrides)
    return functools.partial(ppo_loss, ActorConfig(**cfg))


def _metrics(metrics: dict) -> dict:
    """verl's logged metrics as numbers: each ``Metric``'s per-micro-batch values, numbers kept."""
    from verl.utils.metric import Metric

    out = {}
    for key, value in metrics.items():
        values = value if isinstance(value, list) else [value]
        if all(isinstance(v, Metric) for v in values):
            out[key] = [float(v) for m in values for v in m.values]
        elif all(isinstance(v, (int, float)) for v in values):
            out[key] = [float(v) for v in values]
    return out


def _train_step(engine, td, loss_fn, **kw):
    """One of verl's updates: micro-batches accumulated, then the optimizer's step. Returns the
    outputs, the gradients before the step and the parameters after it."""
    with engine.train_mode():
        engine.optimizer_zero_grad()
        out = engine.forward_backward_batch(_meta(td, calculate_entropy=True, **kw), loss_fn)
        grads = {n: _full(p.grad).clone() for n, p in engine.module.named_parameters()}
        engine.optimizer_step()
        params = {n: _full(p.data).clone() for n, p in engine.module.named_parameters()}
    return out, grads, params


_FIXED = dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=3)   # three micro-batches
_DYNAMIC = dict(use_dynamic_bsz=True, max_token_len_per_gpu=64)     # verl's token-budget packing
_GSPO = dict(loss_agg_mode="seq-mean-token-mean", policy_loss={"loss_mode": "gspo"})


@pytest.mark.parametrize("micro, loss, checkpointing", [
    (_FIXED, {}, False), (_DYNAMIC, {}, False), (_FIXED, _GSPO, False), (_DYNAMIC, _GSPO, False),
    (_FIXED, {}, True),
], ids=["ppo-fixed", "ppo-dynamic", "gspo-fixed", "gspo-dynamic", "ppo-checkpointing"])
def test_ppo_update_matches_verls_engine(tv, model_dir, micro, loss, checkpointing):
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    td = _batch(_rows(seed=3), temperature=0.9)
    results = []
    for cls in (FSDPEngineWithLMHead, tv.TreeFSDPEngine):
        engine = _engine(cls, model_dir, checkpointing=checkpointing)
        step1 = _train_step(engine, td, _ppo_loss(**loss), **micro)
        step2 = _train_step(engine, _batch(_rows(seed=4)), _ppo_loss(**loss), **micro)
        results.append((step1, step2))
    for (want, got) in zip(*results):
        (out_w, grads_w, params_w), (out_g, grads_g, params_g) = want, got
        assert abs(sum(out_w["loss"]) - sum(out_g["loss"])) <= RTOL * max(1, abs(sum(out_w["loss"])))
        metrics_w, metrics_g = _metrics(out_w["metrics"]), _metrics(out_g["metrics"])
        assert metrics_w.keys() == metrics_g.keys()
        assert {"actor/pg_loss", "actor/entropy_loss", "kl_loss"} <= metrics_w.keys()
        for key, value in metrics_w.items():
            _close(torch.tensor(metrics_g[key]), torch.tensor(value), key)
        assert grads_w.keys() == grads_g.keys()
        for name in grads_w:
            _close(grads_g[name], grads_w[name], f"grad {name}")
            _close(params_g[name], params_w[name], f"param {name}")


def test_registered_for_the_cpu_and_built_by_config(tv, model_dir):
    from verl.workers.engine.base import EngineRegistry

    engine = EngineRegistry.new(model_type=tv.MODEL_TYPE, backend="fsdp2",
                                model_config=_configs(model_dir)[0],
                                engine_config=_configs(model_dir)[1],
                                optimizer_config=_configs(model_dir)[2],
                                checkpoint_config=_configs(model_dir)[3])
    assert isinstance(engine, tv.TreeFSDPEngine)


@pytest.mark.parametrize("kw, says", [
    (dict(strategy="fsdp"), "strategy='fsdp'"),
    (dict(lora_rank=4), "LoRA"),
])
def test_unsupported_settings_are_refused_in_one_line(tv, model_dir, kw, says):
    with pytest.raises(ValueError, match=says) as e:
        tv.TreeFSDPEngine(*_configs(model_dir, **kw))
    assert "\n" not in str(e.value)


def test_rows_numbered_otherwise_are_refused(engines):
    _, tree = engines
    td = _batch(_rows())
    pos = td["position_ids"]
    td["position_ids"] = torch.nested.nested_tensor_from_jagged(pos.values() + 1, pos.offsets())
    with pytest.raises(ValueError, match="position ids"):
        _infer(tree, td)


def test_other_verl_versions_are_refused(tv):
    with pytest.raises(ImportError, match="0.9.1"):
        tv.check_verl_version("0.8.0")


def test_the_example_runs_and_the_engines_agree():
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "examples/verl_engine.py"], cwd=root,
                          capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, MASTER_PORT=str(29600 + os.getpid() % 300)))
    assert done.returncode == 0, done.stderr[-3000:]
    loss, grad = map(float, re.search(r"loss difference (\S+), largest gradient difference (\S+)",
                                      done.stdout).groups())
    assert loss <= 1e-5 and grad <= 1e-5, done.stdout
    trees, rows = map(int, re.search(r"tokens: (\d+) in the trees, (\d+) in the rows",
                                     done.stdout).groups())
    assert trees < rows / 2, done.stdout


def _worker(model_dir, model_type, loss_fn):
    """verl's own ``TrainingWorker`` (what its actor runs), configured as a user would."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    model, engine, optim, _ = _configs(model_dir, model_type=model_type,
                                       external_lib="treefx.integrations.verl")
    engine.use_dynamic_bsz, engine.micro_batch_size_per_gpu = False, 3  # as the actor sets them
    worker = TrainingWorker(TrainingWorkerConfig(
        model_type=model_type, model_config=model, engine_config=engine,
        optimizer_config=optim, checkpoint_config=CheckpointConfig()))
    worker.reset()
    worker.set_loss_fn(loss_fn)
    return worker


def test_verls_training_worker_picks_the_engine_by_config_and_trains_as_stock(tv, model_dir):
    """The model config's ``model_type`` (with ``external_lib``) selects the tree engine in
    verl's ``TrainingWorker``; two PPO epochs over the shuffled batch, three micro-batches each
    (verl's iterator, lr scheduler, metrics), train the parameters verl's own engine trains."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    # verl registers its own engine for accelerators only; the CPU gets it here, for this test
    EngineRegistry._engines["language_model"]["fsdp2"].setdefault("cpu", FSDPEngineWithLMHead)
    results = {}
    for model_type in ("language_model", tv.MODEL_TYPE):
        worker = _worker(model_dir, model_type, _ppo_loss())
        td = _batch(_rows(seed=5), temperature=1.0)
        tu.assign_non_tensor(td, calculate_entropy=True, global_batch_size=9, mini_batch_size=9,
                             epochs=2, seed=7, dataloader_kwargs={"shuffle": True},
                             compute_loss=True)
        out = worker.train_mini_batch(td)
        params = {n: _full(p.data).clone() for n, p in worker.engine.module.named_parameters()}
        results[model_type] = (type(worker.engine), _metrics(tu.get(out, "metrics")), params)
    (cls_w, metrics_w, params_w), (cls_g, metrics_g, params_g) = results.values()
    assert cls_w is FSDPEngineWithLMHead and cls_g is tv.TreeFSDPEngine
    assert metrics_w.keys() == metrics_g.keys() and "actor/pg_loss" in metrics_w
    for key in metrics_w:
        if key.startswith("perf/") or key in ("mfu",):
            continue  # time and memory
        _close(torch.tensor(metrics_g[key]), torch.tensor(metrics_w[key]), key)
    for name in params_w:
        _close(params_g[name], params_w[name], f"param {name}")


def test_the_benchmarks_dry_run_agrees(tmp_path):
    """benchmarks/verl_engine.py --dry-run: both engines through verl's update and
    compute_log_prob on GRPO rows of multi-turn prompts; it exits non-zero if they differ."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "verl_engine.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.verl_engine", "--dry-run",
                           "--out", str(out)], cwd=root, capture_output=True, text=True,
                          timeout=900, env=dict(os.environ, MASTER_PORT=str(29700 + os.getpid() % 200)))
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["comparison"]["within_tolerance"], res["comparison"]
    stats = res["engines"]["treefx"]["tree_stats"]
    assert stats["tree_tokens"] < stats["sequence_tokens"]


def _two_ranks(rank: int, world: int, port: int, model_dir: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import treefx.integrations.verl as tv
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

        tv.use_cpu_platform()
        rows = _rows(seed=6)[:8]
        mine = rows[rank * 4:(rank + 1) * 4]   # verl's dispatch: each rank its share of rows
        td = _batch(mine, temperature=1.0)
        from verl.utils import tensordict_utils as tu
        tu.assign_non_tensor(td, global_batch_size=len(rows))
        result = {}
        for cls in (FSDPEngineWithLMHead, tv.TreeFSDPEngine):
            engine = _engine(cls, model_dir)
            out, grads, params = _train_step(engine, td, _ppo_loss(),
                                             use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
            as_arrays = lambda d: {k: v.numpy() for k, v in d.items()}  # noqa: E731
            result[cls.__name__] = (sum(out["loss"]), as_arrays(grads), as_arrays(params))
        queue.put((rank, result))  # by value: numpy arrays, not tensors shared by descriptor
    finally:
        dist.destroy_process_group()


def test_two_ranks_under_fsdp2_match_verls_engine(model_dir):
    """Two gloo processes, FSDP2 sharding the model over both, each rank its half of the rows
    (two micro-batches each): the gathered gradients and next parameters of the tree engine
    are verl's engine's."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29800 + os.getpid() % 150
    procs = [ctx.Process(target=_two_ranks, args=(r, 2, port, model_dir, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, result in got.items():
        (loss_w, grads_w, params_w) = result["FSDPEngineWithLMHead"]
        (loss_g, grads_g, params_g) = result["TreeFSDPEngine"]
        assert abs(loss_w - loss_g) <= RTOL * max(1.0, abs(loss_w)), (rank, loss_w, loss_g)
        for name in grads_w:
            _close(torch.from_numpy(grads_g[name]), torch.from_numpy(grads_w[name]),
                   f"rank {rank} grad {name}")
            _close(torch.from_numpy(params_g[name]), torch.from_numpy(params_w[name]),
                   f"rank {rank} param {name}")
