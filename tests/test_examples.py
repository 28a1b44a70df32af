"""Every script in examples/ runs, with each option its docstring documents, and what it prints
holds: the tree's losses, objectives and gradients equal the per-sequence ones it prints beside
them. Sizes are the smallest the scripts offer; the default sizes of examples/sft.py (minutes)
run with ``-m slow``.

The scripts that do their work at import (quickstart, the GRPO ones) run in this process through
runpy, examples/sft.py through its ``main(argv)``, examples/fsdp.py in processes of its own
(one, and two through torchrun, gloo on the CPU)."""

from __future__ import annotations

import importlib.util
import os
import re
import runpy
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import treefx.tools.cli

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
NUMBER = r"(-?[\d.]+(?:e[+-]?\d+)?)"


def _number(pattern: str, out: str) -> float:
    m = re.search(pattern.replace("NUMBER", NUMBER), out)
    assert m, f"{pattern!r} not in the output:\n{out}"
    return float(m.group(1))


def _numbers(pattern: str, out: str) -> tuple[float, ...]:
    m = re.search(pattern.replace("NUMBER", NUMBER), out)
    assert m, f"{pattern!r} not in the output:\n{out}"
    return tuple(map(float, m.groups()))


def test_quickstart_prints_equal_losses(capsys):
    runpy.run_path(str(EXAMPLES / "quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    tree_loss, seq_loss = _numbers(r"tree loss NUMBER = per-sequence loss NUMBER", out)
    assert abs(tree_loss - seq_loss) < 1e-5


def test_demo_runs_and_matches(capsys):
    assert treefx.tools.cli.main(["demo", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    worst = _number(r"largest relative gradient difference.*: NUMBER", out)
    assert worst < 1e-4
    rows = [ln.split() for ln in out.splitlines() if re.match(r"\s+\d+\s+\d+\s", ln)]
    assert len(rows) == 2
    for row in rows:
        assert abs(float(row[2]) - float(row[3])) < 1e-4


# ----------------------------------------------------------------------------- examples/sft.py

def _sft(argv: list[str], capsys) -> list[list[str]]:
    """Run examples/sft.py's main(argv); its table's rows, split into columns."""
    # imported as a module of its own: Dynamo looks up the step's module by its name
    spec = importlib.util.spec_from_file_location("sft_example", EXAMPLES / "sft.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        module.main(argv)
    finally:
        del sys.modules[spec.name]
    out = capsys.readouterr().out
    assert "tree loss" in out and "per-branch" in out, out
    return [ln.split() for ln in out.splitlines() if re.match(r"\s*\d+\s+\d+\s+\d+\s", ln)]


def _check_sft_rows(rows, steps: int, check_steps: int):
    assert [int(r[0]) for r in rows] == list(range(steps))
    checked = 0
    for r in rows:
        tokens, baseline = int(r[1]), int(r[2])
        assert tokens < baseline  # the prompts are shared
        tree_loss = float(r[5])
        assert 0 < tree_loss < 20
        if len(r) > 7 and re.fullmatch(r"-?\d+\.\d+", r[6]):  # the per-branch column
            assert abs(tree_loss - float(r[6])) <= 2e-5, r  # printed with 5 decimals
            checked += 1
    assert checked == check_steps


@pytest.mark.parametrize("model", ["tiny", "qwen3"])
def test_sft_small_prints_equal_losses(model, capsys):
    """``--small`` trees; ``--model qwen3`` is a Hugging Face model called without
    attention_mask (exact on transformers 5.24 since treefx.families.hf_packing's fix)."""
    rows = _sft(["--model", model, "--small", "--steps", "2", "--check-steps", "2"], capsys)
    _check_sft_rows(rows, steps=2, check_steps=2)


@pytest.mark.slow
def test_sft_qwen3_full_size(capsys):
    """The default trees (4-8k tokens) with Qwen3, as issue 32 ran it: about 1.5 min."""
    rows = _sft(["--model", "qwen3", "--steps", "2", "--check-steps", "1"], capsys)
    _check_sft_rows(rows, steps=2, check_steps=1)
    assert int(rows[0][1]) > 2000


# ----------------------------------------------------------------------------- GRPO examples

def test_hf_trainer_example_equals_the_stock_trainer(capsys, monkeypatch):
    pytest.importorskip("accelerate")
    monkeypatch.setattr(sys, "argv", ["hf_trainer.py"])
    runpy.run_path(str(EXAMPLES / "hf_trainer.py"), run_name="__main__")
    out = capsys.readouterr().out
    ref = _numbers(r"losses, Trainer: +\[NUMBER, NUMBER\]", out)
    got = _numbers(r"losses, TreeTrainer: \[NUMBER, NUMBER\]", out)
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(ref, got)), out
    assert _number(r"largest relative difference NUMBER", out) <= 1e-5
    assert _number(r"\(NUMBERx fewer\)", out) > 1.5


def test_sft_trl_example_equals_trls_sft_trainer(capsys):
    """examples/sft_trl.py: TRL's SFTTrainer and TreeSFTTrainer, the same steps: each step's
    loss, entropy, accuracy and token count, and the parameters after training."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    runpy.run_path(str(EXAMPLES / "sft_trl.py"), run_name="example")["main"]([])
    out = capsys.readouterr().out
    rows = re.findall(rf"^\s+(\d+)\s+(SFTTrainer|TreeSFTTrainer)\s+{NUMBER}\s+{NUMBER}\s+"
                      rf"{NUMBER}\s+(\d+)$", out, re.M)
    assert len(rows) == 4, out
    for ref, got in zip(rows[::2], rows[1::2]):
        assert (ref[0], ref[1], got[1]) == (got[0], "SFTTrainer", "TreeSFTTrainer"), out
        (loss_r, ent_r, acc_r), (loss_t, ent_t, acc_t) = (map(float, x[2:5]) for x in (ref, got))
        assert abs(loss_t - loss_r) <= 1e-5 * abs(loss_r) + 1e-7, out  # printed to 7 places
        assert abs(ent_t - ent_r) <= 1e-5 * abs(ent_r) + 1e-7, out
        assert acc_t == acc_r and ref[5] == got[5], out
    assert _number(r"largest relative difference NUMBER", out) <= 1e-5
    assert _number(r"\(NUMBERx fewer\)", out) > 1.1


def test_grpo_update_prints_equal_objectives(capsys):
    threads = torch.get_num_threads()
    try:  # the script runs on one thread
        runpy.run_path(str(EXAMPLES / "grpo_update.py"), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for when in ("before", "after"):
        tree, branch = _numbers(rf"objective {when} the step\s+NUMBER\s+NUMBER", out)
        assert abs(tree) > 1e-3  # advantages differ per call here: not a sum that cancels
        assert abs(tree - branch) <= 1e-5 * abs(branch) + 1e-7
    assert _number(r"max relative gradient difference NUMBER", out) < 1e-4
    assert 0 < _number(r"clip fraction NUMBER", out) < 1


def test_grpo_from_rollouts_explains_its_zero_objective(capsys):
    runpy.run_path(str(EXAMPLES / "grpo_from_rollouts.py"), run_name="__main__")
    out = capsys.readouterr().out
    before = _numbers(r"objective before the step\s+NUMBER\s+NUMBER\s+NUMBER", out)
    after = _numbers(r"objective after the step\s+NUMBER\s+NUMBER\s+NUMBER", out)
    scale = _number(r"mean \|A_p\| = NUMBER", out)
    assert 0.1 < scale < 10
    # Before the step: 0 (every ratio 1, the advantages sum to 0), both sides rounding noise.
    assert "objective is -(1/P) Σ_p A_p = 0:" in out
    assert abs(before[0]) < 1e-5 * scale and abs(before[1]) < 1e-5 * scale
    assert abs(before[2] - abs(before[0] - before[1])) <= 1e-9
    # After the step the ratios moved: an objective far from 0 that the calls agree on.
    assert abs(after[1]) > 1e-3
    assert abs(after[0] - after[1]) <= 1e-5 * abs(after[1])
    assert _number(r"max relative gradient difference NUMBER", out) < 1e-4
    assert _number(r"after the step: clip fraction NUMBER", out) > 0


# ----------------------------------------------------------------------------- examples/fsdp.py

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_losses(processes: int, *args: str) -> list[float]:
    """Run examples/fsdp.py in ``processes`` processes (plain python for one, torchrun for
    more); the global loss of each step it prints. Fails on transformers' deprecation
    warning for gradient_checkpointing_enable."""
    script = str(EXAMPLES / "fsdp.py")
    if processes == 1:
        env = dict(os.environ, MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                   LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        cmd = [sys.executable, script, *args]
    else:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={processes}", script, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "gradient_checkpointing_enable` is deprecated" not in out.stderr
    losses = [float(x) for x in re.findall(r"step \d+: loss ([\d.]+) \(global mean",
                                           out.stdout)]
    assert len(losses) == int(args[args.index("--steps") + 1]), out.stdout
    assert all(0 < x < 20 for x in losses), out.stdout
    return losses


@pytest.fixture(scope="module")
def fsdp_one_process():
    """``python examples/fsdp.py``, two steps: the global batch of 2 trees per step."""
    return _fsdp_losses(1, "--steps", "2", "--trees-per-rank", "2")


def test_fsdp_example_runs_in_one_process(fsdp_one_process):
    assert len(fsdp_one_process) == 2


@pytest.mark.parametrize("wrapper", ["fsdp", pytest.param("ddp", marks=pytest.mark.slow)])
def test_fsdp_example_two_processes_equal_one(wrapper, fsdp_one_process):
    """``torchrun --nproc_per_node=2 examples/fsdp.py [--ddp]``: two ranks of one tree each
    train on the same global batch as one process with both trees: the same loss at the first
    step (the global mean over sequences), and after one AdamW step on the gradients reduced
    over the ranks, at the second. About a minute each on 2 cores: ``--ddp`` with ``-m slow``."""
    extra = ["--ddp"] if wrapper == "ddp" else []
    losses = _fsdp_losses(2, "--steps", "2", "--trees-per-rank", "1", *extra)
    assert losses == pytest.approx(fsdp_one_process, abs=2e-4)


def test_fsdp_example_shapes_are_what_they_are_called():
    """``--shape qwen3-8b`` (and qwen3-1.7b) have their names' parameter counts; the default is
    the small Qwen3 the docstring describes. Built on the meta device: no memory."""
    transformers = pytest.importorskip("transformers")
    shapes = runpy.run_path(str(EXAMPLES / "fsdp.py"), run_name="fsdp_example")["SHAPES"]
    assert shapes["small"]["hidden_size"] == 256 and shapes["small"]["num_hidden_layers"] == 4
    expected = {"qwen3-1.7b": 1.72e9, "qwen3-8b": 8.19e9}
    for name, params in expected.items():
        cfg = transformers.AutoConfig.for_model("qwen3", **shapes[name])
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=0.01)


# ----------------------------------------------------------------------------- checkpointing

def test_enable_activation_checkpointing_without_deprecation_warning():
    """treefx.models.enable_activation_checkpointing: the new name where transformers has it
    (5.24: the old one warns), the old one where it has only that (5.17)."""
    transformers = pytest.importorskip("transformers")
    from treefx.models import enable_activation_checkpointing

    cfg = transformers.AutoConfig.for_model(
        "qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        enable_activation_checkpointing(model, use_reentrant=False)
        on = (model.is_activation_checkpointing if hasattr(model, "activation_checkpointing_enable")
              else model.is_gradient_checkpointing)
    assert on is True

    class Old:  # a model of transformers 5.17
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            self.kwargs = gradient_checkpointing_kwargs

    old = Old()
    enable_activation_checkpointing(old, use_reentrant=False)
    assert old.kwargs == {"use_reentrant": False}
    enable_activation_checkpointing(old)
    assert old.kwargs is None  # transformers' default
    with pytest.raises(TypeError, match="no activation checkpointing"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))
