"""Command line: synth and stats."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

import treefx
from treefx import read_jsonl, synth, write_jsonl
from treefx.tools.cli import SYNTH_VOCAB, build_parser, main


def _table(out: str):
    """(header, rows without the separators) of the stats table."""
    lines = [ln for ln in out.splitlines() if ln.strip()]
    header = lines[0].split()
    rows = [ln.split() for ln in lines[1:] if not set(ln.replace(" ", "")) <= {"-"}]
    seps = [i for i, ln in enumerate(lines) if set(ln.replace(" ", "")) <= {"-"}]
    return header, rows, seps, lines


def _expected_row(name, seqs, unique, baseline):
    por = 1 - unique / baseline
    return [name, str(seqs), str(unique), str(baseline), f"{por:.3f}", f"{1 / (1 - por):.2f}x"]


@pytest.fixture
def synth_file(tmp_path, capsys):
    path = tmp_path / "trees.jsonl"
    assert main(["synth", "-o", str(path), "-n", "3"]) == 0
    assert f"wrote 3 trees to {path}" in capsys.readouterr().out
    return path


def test_synth_writes_the_dataset(synth_file):
    trees = list(read_jsonl(synth_file))
    assert trees == synth.dataset(3, 0, rollouts=4, vocab_size=SYNTH_VOCAB)


def test_synth_options(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    main(["synth", "-o", str(path), "-n", "2", "--seed", "4", "--rollouts", "2",
          "--vocab-size", "100", "--mask-outputs", "--target-por", "0.6"])
    trees = list(read_jsonl(path))
    assert trees == synth.dataset(2, 4, rollouts=2, vocab_size=100, mask_outputs=True,
                                  target_por=0.6)
    assert all(t.loss_masks is not None and abs(t.por - 0.6) <= 0.01 for t in trees)


def test_stats_table_matches_trees(synth_file, capsys):
    assert main(["stats", str(synth_file)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # no progress bar off a terminal
    header, rows, seps, lines = _table(captured.out)
    assert header == ["tree", "sequences", "unique", "baseline", "POR", "bound"]
    trees = list(read_jsonl(synth_file))
    assert len(rows) == len(trees) + 1
    for i, (row, t) in enumerate(zip(rows, trees)):
        assert row == _expected_row(str(i), t.num_sequences, t.num_tokens, t.num_baseline_tokens)
        assert float(row[4]) == pytest.approx(t.por, abs=5e-4)
        assert float(row[5][:-1]) == pytest.approx(t.bound, abs=5e-3)
    total = rows[-1]
    assert total == _expected_row(
        "total",
        sum(t.num_sequences for t in trees),
        sum(t.num_tokens for t in trees),
        sum(t.num_baseline_tokens for t in trees),
    )
    assert float(total[4]) == pytest.approx(treefx.por(trees), abs=5e-4)
    # Separators under the header and above the total; columns line up.
    assert seps == [1, len(lines) - 2]
    assert len({len(ln) for ln in lines}) == 1


def test_stats_single_tree(tmp_path, capsys):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"sequences": [[1, 2, 3], [1, 2, 4], [5]]}) + "\n")
    main(["stats", str(path)])
    header, rows, seps, lines = _table(capsys.readouterr().out)
    assert rows == [_expected_row("0", 3, 5, 7), _expected_row("total", 3, 5, 7)]
    assert rows[0][4] == "0.286" and rows[0][5] == "1.40x"


def test_stats_malformed_file_names_the_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"sequences": [[1, 2]]}\n\n{"sequences": [[1, 2]\n')
    with pytest.raises(SystemExit) as info:
        main(["stats", str(path)])
    assert info.value.code == 2
    assert str(info.value) == f"{path}:3: not valid JSON: Expecting ',' delimiter at column 22"


@pytest.mark.parametrize(
    "line, match",
    [
        ('{"sequences": [[1, -2]]}', ":2: sequence 0, position 1"),
        ('{"sequences": [[1]], "weight": [1]}', ":2: tree record key 'weight'"),
        ("[1, 2]", ':2: a tree record must be an object'),
    ],
)
def test_stats_bad_record_names_the_line(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"sequences": [[1, 2]]}\n' + line + "\n")
    with pytest.raises(SystemExit, match=match):
        main(["stats", str(path)])


def test_stats_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(SystemExit, match="holds no trees"):
        main(["stats", str(path)])


def test_stats_progress_bar_when_forced(synth_file, capsys):
    main(["stats", str(synth_file), "--progress"])
    err = capsys.readouterr().err
    assert "reading" in err and "100.0%" in err


def test_stats_max_tokens(synth_file, capsys):
    from treefx.partition import err, partition

    trees = list(read_jsonl(synth_file))
    budget = max(int(t.sequence_lengths.max()) for t in trees) + 500
    assert any(t.num_tokens > budget for t in trees)  # something gets split
    main(["stats", str(synth_file), "--max-tokens", str(budget)])
    header, rows, seps, lines = _table(capsys.readouterr().out)
    assert header[:9] == ["tree", "sequences", "unique", "baseline", "POR", "bound",
                          "parts", "ERR", "ERR/POR"]
    assert header[9:] == ["rf", "parts", "rf", "ERR", "rf", "held", "rf", "K/V", "rf", "host",
                          "rf", "recomp"]
    total_part_tokens = 0
    held = kv = recomputed = hosted = 0
    for i, (row, t) in enumerate(zip(rows, trees)):
        parts = partition(t, budget)
        assert all(p.num_tokens <= budget for p in parts)
        assert sum(p.num_sequences for p in parts) == t.num_sequences
        assert sum(p.num_baseline_tokens for p in parts) == t.num_baseline_tokens
        e = err(t, parts)
        assert e == pytest.approx(1 - sum(p.num_tokens for p in parts) / t.num_baseline_tokens)
        assert e <= t.por + 1e-12
        total_part_tokens += sum(p.num_tokens for p in parts)
        rf = treefx.parts.plan(treefx.pack(t), budget)  # redundancy-free: ERR = POR
        held = max(held, rf.peak_held_tokens())
        kv = max(kv, rf.peak_context_tokens())
        recomputed += rf.recompute_tokens
        hosted += rf.host_tokens
        assert rf.peak_held_tokens() <= budget
        assert row == _expected_row(str(i), t.num_sequences, t.num_tokens, t.num_baseline_tokens) + [
            str(len(parts)), f"{e:.3f}", f"{e / t.por:.3f}", str(rf.num_parts), f"{t.por:.3f}",
            str(rf.peak_held_tokens()), str(rf.peak_context_tokens()),
            f"{rf.host_tokens / t.num_tokens:.3f}", f"{rf.recompute_tokens / t.num_tokens:.3f}"
        ]
    baseline = sum(t.num_baseline_tokens for t in trees)
    e_tot = 1 - total_part_tokens / baseline
    por_tot = 1 - sum(t.num_tokens for t in trees) / baseline
    # The total row has an empty "parts" cell.
    assert rows[-1][:6] == _expected_row(
        "total", sum(t.num_sequences for t in trees), sum(t.num_tokens for t in trees), baseline
    )
    assert rows[-1][6:] == [f"{e_tot:.3f}", f"{e_tot / por_tot:.3f}", f"{por_tot:.3f}", str(held),
                            str(kv), f"{hosted / sum(t.num_tokens for t in trees):.3f}",
                            f"{recomputed / sum(t.num_tokens for t in trees):.3f}"]


def test_stats_max_tokens_below_a_sequence_plans_redundancy_free_parts_only(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"sequences": [[1, 2]]}) + "\n" + json.dumps({"sequences": [[1, 2, 3, 4]]}) + "\n"
    )
    main(["stats", str(path), "--max-tokens", "3"])
    _, rows, _, _ = _table(capsys.readouterr().out)
    # tree 1's sequence of 4 tokens fits no part of whole sequences; it takes the fewest
    # redundancy-free parts of at most 3 tokens (2): the first two tokens are recomputed by
    # default (their keys and values, the open path, kept for the last two, which attend to
    # them; no part of one token), so at most 2 tokens hold activations at once, none on the
    # host
    assert rows[1][6:] == ["-", "-", "-", "2", "0.000", "2", "2", "0.000", "0.500"]


def test_unknown_command_and_missing_arguments(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["synth"])  # -o is required
    assert info.value.code == 2
    capsys.readouterr()


# ------------------------------------------------------------------ errors: one line, status 2


def _error(argv, capsys) -> str:
    """The one stderr line of a command that fails on what it was given (status 2)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert f"treefx {argv[0]}: error: " in err if argv[0] in _COMMANDS else "treefx: error: " in err
    return err.strip()


_COMMANDS = ("demo", "stats", "synth", "ingest", "explain", "check", "draw")


@pytest.fixture
def small_file(tmp_path):
    path = tmp_path / "small.jsonl"
    path.write_text(json.dumps({"sequences": [[1, 2, 3], [1, 2, 4]]}) + "\n")
    return path


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["stats", "{tmp}/missing.jsonl"], "{tmp}/missing.jsonl: no such file"),
        (["stats", "{tmp}"], "{tmp}: is a folder, not a file"),
        (["draw", "{tmp}/missing.jsonl", "-o", "{tmp}/t.png"], "missing.jsonl: no such file"),
        (["check", "treefx.tools.debug.examples:tiny_decoder", "--trees", "{tmp}/missing.jsonl"],
         "missing.jsonl: no such file"),
        (["ingest", "{tmp}/missing.json", "--tokenizer", "{tmp}", "-o", "{tmp}/t.jsonl"],
         "no such file: {tmp}/missing.json"),
        (["ingest", "{small}", "--tokenizer", "{tmp}", "-o", "{tmp}/t.jsonl"],
         "--tokenizer {tmp}: no tokenizer could be loaded from it"),
        (["ingest", "{small}", "--tokenizer", "{tmp}", "-o", "{tmp}/t.jsonl", "--workers", "0"],
         "argument --workers: must be at least 1, got 0"),
        (["demo", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
        (["demo", "--steps", "two"], "argument --steps: expected an integer, got 'two'"),
        (["synth", "-o", "{tmp}/t.jsonl", "-n", "0"], "argument -n: must be at least 1, got 0"),
        (["synth", "-o", "{tmp}/t.jsonl", "--seed", "-1"], "argument --seed: must be at least 0"),
        (["synth", "-o", "{tmp}/t.jsonl", "--rollouts", "0"], "argument --rollouts: must be at "
         "least 1"),
        (["synth", "-o", "{tmp}/t.jsonl", "--vocab-size", "1"], "argument --vocab-size: must "
         "be at least 2"),
        (["synth", "-o", "{tmp}/t.jsonl", "--target-por", "0.99", "-n", "1"],
         "argument --target-por: target_por=0.99 is out of reach for this shape"),
        (["synth", "-o", "{tmp}/t.jsonl", "--target-por", "1"],
         "argument --target-por: a POR is in [0, 1), got 1.0"),
        (["synth", "-o", "{tmp}/no/such/folder/t.jsonl"], "-o {tmp}/no/such/folder/t.jsonl: "
         "the folder {tmp}/no/such/folder does not exist"),
        (["synth", "-o", "{tmp}"], "-o {tmp}: is a folder; give a file name"),
        (["draw", "{small}", "-o", "{tmp}/t.png", "--max-mask", "0"],
         "argument --max-mask: must be at least 1, got 0"),
        (["draw", "{small}", "-o", "{tmp}/t.png", "--max-leaves", "0"],
         "argument --max-leaves: must be at least 1, got 0"),
        (["draw", "{small}", "-o", "{tmp}/missing/t.png"], "the folder {tmp}/missing does not"),
        (["draw", "{small}", "-o", "{tmp}/t.jpg"], "use a .png or .svg file name"),
        (["draw", "{small}", "-o", "{tmp}/t.png", "--index", "1"], "--index 1 is out of range"),
        (["explain", "treefx.tools.debug.examples:tiny_decoder", "--html", "{tmp}/missing/e.html"],
         "--html {tmp}/missing/e.html: the folder {tmp}/missing does not exist"),
        (["stats", "{small}", "--max-tokens", "0"], "argument --max-tokens: must be at least 1"),
        (["check", "treefx.tools.debug.examples"], "expected MODULE:FACTORY"),
        (["check", "treefx.models:tiny_decoder", "--checkpointing"],
         "--checkpointing needs a Hugging Face model (activation_checkpointing_enable)"),
        (["synth"], "the following arguments are required: -o/--output"),
        (["nope"], "argument COMMAND: invalid choice: 'nope'"),
    ],
)
def test_errors_are_one_line_with_status_2(argv, expected, tmp_path, small_file, capsys):
    def fill(text):
        return text.format(tmp=tmp_path, small=small_file)

    err = _error([fill(a) for a in argv], capsys)
    assert fill(expected) in err
    assert not list(tmp_path.glob("t.*"))  # nothing written on an error


def test_malformed_jsonl_names_file_and_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"sequences": [[1, 2]]}\n\n{"sequences": [[1, 2], [3]}\n')
    err = _error(["stats", str(path)], capsys)
    assert err == (f"treefx stats: error: {path}:3: not valid JSON: Expecting ',' delimiter "
                   "at column 27")
    path.write_bytes(b'{"sequences": [[1, 2]]}\n{"sequences": [[1, 2\xff]]}\n')
    assert f"{path}:2: not valid JSON" in _error(["draw", str(path), "-o", str(tmp_path / "t.png")],
                                                 capsys)


@pytest.mark.parametrize("command", ["check", "explain"])
def test_token_ids_outside_the_vocabulary_are_one_line(command, tmp_path, capsys):
    path = tmp_path / "big_vocab.jsonl"
    write_jsonl(path, [treefx.Tree.from_sequences([[1, 2, 3], [1, 2, 300, 5]])])
    argv = [command, "treefx.tools.debug.examples:tiny_decoder", "--trees", str(path)]
    if command == "explain":
        argv += ["--html", str(tmp_path / "e.html")]
    err = _error(argv, capsys)
    assert err == (f"treefx {command}: error: {path}: tree 0 holds token id 300, outside the "
                   "model's vocabulary of 256 (ids 0 to 255); write trees for it with treefx "
                   "synth --vocab-size 256")


def test_the_command_line_fails_without_a_traceback(tmp_path):
    """The installed entry point: one stderr line, status 2, for an error deep in a command."""
    out = subprocess.run([sys.executable, "-m", "treefx", "synth", "-o", str(tmp_path / "t.jsonl"),
                          "-n", "1", "--target-por", "0.99"], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.startswith("treefx synth: error: argument --target-por: target_por=0.99 "
                                 "is out of reach") and out.stderr.count("\n") == 1, out.stderr


# ------------------------------------------------------------------ version, help


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"treefx {treefx.__version__}\n"


def _subcommands():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, sub


def test_top_level_help_lists_every_command(capsys):
    parser, sub = _subcommands()
    assert set(sub.choices) == set(_COMMANDS)
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for choice in sub._choices_actions:
        assert choice.help and f"{choice.dest} {choice.help}" in out


@pytest.mark.parametrize("command", _COMMANDS)
def test_every_option_has_help(command, capsys):
    parser, sub = _subcommands()
    sub_parser = sub.choices[command]
    assert sub_parser.description  # its own --help says what it does
    for action in sub_parser._actions:
        assert action.help and action.help != argparse.SUPPRESS, (command, action.dest)
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert sub_parser.description.split(".")[0] in " ".join(capsys.readouterr().out.split())


# ------------------------------------------------------------------ synth fits the example models


def test_synth_vocabulary_fits_every_built_in_model():
    from treefx.tools import zoo
    from treefx.tools.debug import examples
    from treefx.models import tiny_decoder
    from treefx.reference import vocab_size

    assert build_parser().parse_args(["synth", "-o", "x"]).vocab_size == SYNTH_VOCAB
    assert SYNTH_VOCAB <= min(zoo.VOCAB, examples.VOCAB, vocab_size(tiny_decoder()), 512)  # 512: demo


def test_synth_then_check_an_example_model(tmp_path, capsys):
    """What a new user runs first: synthetic trees with the defaults, checked on an example
    model (one small tree: the CPU check is quadratic in the tokens)."""
    path = tmp_path / "trees.jsonl"
    assert main(["synth", "-o", str(path), "-n", "1", "--rollouts", "1"]) == 0
    assert max(max(s) for s in next(read_jsonl(path)).sequences) >= 100  # ids span the vocab
    capsys.readouterr()
    assert main(["check", "treefx.tools.debug.examples:qwen3_tiny", "--trees", str(path)]) == 0
    assert "treefx verify passed" in capsys.readouterr().out


# ------------------------------------------------------------------ issue 32: a newcomer's mistakes

_NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.mark.parametrize("command", ["check", "explain"])
@pytest.mark.parametrize(
    "options, expected",
    [
        pytest.param(["--device", "cuda"], "--device cuda: CUDA is not available "
                     "(torch.cuda.is_available() is False); use --device cpu", marks=_NO_CUDA),
        (["--device", "tpu"], "--device tpu: unknown device; use cpu or cuda"),
        (["--device", "meta"], "--device meta: treefx runs on cpu or cuda, not meta"),
        (["--device", "cpu", "--backend", "inductor"], "--backend inductor needs CUDA, but "),
        pytest.param(["--backend", "inductor"], "--backend inductor needs CUDA, but CUDA is not "
                     "available here; use --backend auto (inductor on CUDA, eager elsewhere) or "
                     "--backend eager", marks=_NO_CUDA),
        (["-n", "5"], "-n 5 needs --trees: it takes the first N trees of that file"),
    ],
)
def test_device_and_backend_mistakes_are_one_line(command, options, expected, tmp_path, capsys):
    """Checked before the model is built (hf:qwen3 would take seconds)."""
    argv = [command, "hf:qwen3", *options]
    if command == "explain":
        argv += ["--html", str(tmp_path / "e.html")]
    assert expected in _error(argv, capsys)
    assert not (tmp_path / "e.html").exists()


_FACTORIES = '''
import torch


def needs_args(n_layers, dim=4):
    return torch.nn.Linear(dim, dim)


def raises():
    raise RuntimeError("no weights at /nowhere/model.bin\\nsecond line")


def no_embedding():
    return torch.nn.Sequential(torch.nn.Linear(8, 8))


def no_parameters():
    return torch.nn.Identity()


def not_a_module():
    return 7


class NeedsPositions(torch.nn.Module):
    """Requires position_ids: the per-sequence check calls model(input_ids) alone."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids, position_ids):
        return self.head(self.emb(input_ids))
'''


@pytest.fixture
def factories(tmp_path, monkeypatch):
    """A module of model factories a user might write, importable as ``cli_factories``."""
    (tmp_path / "cli_factories.py").write_text(_FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cli_factories", raising=False)
    return "cli_factories"


@pytest.mark.parametrize("command", ["check", "explain"])
@pytest.mark.parametrize(
    "factory, expected",
    [
        ("needs_args", "factory cli_factories:needs_args failed: it needs arguments (n_layers), "
         "but MODEL is called with none; write a function without arguments that calls it and "
         "returns the model"),
        ("raises", "factory cli_factories:raises failed: RuntimeError: no weights at "
         "/nowhere/model.bin"),
        ("no_embedding", "cli_factories:no_embedding: cannot tell which token ids the model "
         "takes: it declares no vocabulary (no config.vocab_size, get_input_embeddings() or "
         "get_output_embeddings()), and running it on two tokens of id 0 failed: RuntimeError: "),
        ("no_parameters", "cli_factories:no_parameters: the model has no parameters"),
        ("not_a_module", "factory cli_factories:not_a_module returned a int, not a "
         "torch.nn.Module"),
    ],
)
def test_model_mistakes_are_one_line_with_status_2(command, factory, expected, factories,
                                                   tmp_path, capsys):
    """Not a traceback with exit status 1, which check keeps for "different"; in CLI terms."""
    argv = [command, f"{factories}:{factory}", "--device", "cpu"]
    if command == "explain":
        argv += ["--html", str(tmp_path / "e.html")]
    err = _error(argv, capsys)
    assert expected in err
    assert "trees=" not in err and "Traceback" not in err
    if factory == "no_embedding":
        assert err.endswith("; pass --trees with trees of its token ids")


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("hf:doesnotexist", "cannot build a tiny 'doesnotexist' model: not a causal-LM model type "
         "of transformers "),
        ("hf:lama", "the closest: llama, "),
    ],
)
def test_unknown_hf_model_type_names_the_closest(spec, expected, capsys):
    pytest.importorskip("transformers")
    err = _error(["check", spec], capsys)
    assert expected in err and err.endswith("docs/zoo.md lists every type with how treefx did "
                                            "on it")
    assert len(err) < 400  # not every config type of transformers


def test_synth_vocab_size_is_bounded_at_parse_time(tmp_path, capsys):
    err = _error(["synth", "-o", str(tmp_path / "t.jsonl"), "--vocab-size",
                  "100000000000000000000"], capsys)
    assert err.startswith("treefx synth: error: argument --vocab-size: must be at most "
                          f"{2**63} (token ids are int64), got 100000000000000000000")
    assert main(["synth", "-o", str(tmp_path / "t.jsonl"), "-n", "1", "--vocab-size",
                 str(2**63)]) == 0  # the largest that fits
    assert max(max(s) for s in next(read_jsonl(tmp_path / "t.jsonl")).sequences) < 2**63


def test_synth_streams_each_tree_to_the_file(tmp_path, capsys, monkeypatch):
    """Each tree is on disk before the next is made (never all of them in memory), with a
    progress bar on stderr when asked for (by default: on a terminal)."""
    path = tmp_path / "t.jsonl"
    lines_when_made = []
    make = synth.agent_tree

    def watched(seed, **kw):  # the real generator, watched from outside
        lines_when_made.append(path.read_text().count("\n") if path.exists() else None)
        return make(seed, **kw)

    monkeypatch.setattr(synth, "agent_tree", watched)
    assert main(["synth", "-o", str(path), "-n", "4", "--rollouts", "1", "--progress"]) == 0
    assert lines_when_made == [None, 1, 2, 3]  # tree 0 before the file exists: its errors
    captured = capsys.readouterr()
    assert captured.out == f"wrote 4 trees to {path}\n"
    assert f"writing {path}" in captured.err and "100.0% 4/4 trees" in captured.err
    monkeypatch.setattr(synth, "agent_tree", make)
    assert list(read_jsonl(path)) == synth.dataset(4, 0, rollouts=1, vocab_size=SYNTH_VOCAB)


def test_check_and_explain_document_the_same_exit_statuses(capsys):
    from treefx.tools.cli import EXIT_STATUSES

    for command in ("check", "explain"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "Exit status: 0 exact" in out and "1 different (treefx would train it wrongly)" \
            in out and "2 refused by treefx" in out and "3 not comparable" in out, command
    parser, sub = _subcommands()
    for command in ("check", "explain"):  # the same default backend too
        backend = next(a for a in sub.choices[command]._actions if a.dest == "backend")
        assert backend.default == "auto"
    assert "1 different" in EXIT_STATUSES


def test_a_model_that_fails_in_the_check_is_one_line(factories, capsys):
    """The check runs each sequence alone as model(input_ids); a model that cannot run so
    fails there: one line naming the error (-v: its traceback too), exit status 2."""
    err = _error(["check", f"{factories}:NeedsPositions"], capsys)
    assert err.startswith("treefx check: error: cli_factories:NeedsPositions: running the model "
                          "failed: TypeError: ")
    assert "'position_ids'" in err and err.endswith("(-v prints the traceback)")


def test_synth_interrupted_keeps_the_whole_trees_written(tmp_path, capsys, monkeypatch):
    """Ctrl-C during a long run: the trees written so far stay, each line a whole tree."""
    path = tmp_path / "t.jsonl"
    make = synth.agent_tree

    def ctrl_c_at_the_third(seed, **kw):
        if seed == 2:
            raise KeyboardInterrupt
        return make(seed, **kw)

    monkeypatch.setattr(synth, "agent_tree", ctrl_c_at_the_third)
    with pytest.raises(SystemExit) as info:
        main(["synth", "-o", str(path), "-n", "5", "--rollouts", "1"])
    assert info.value.code == 130
    assert capsys.readouterr().err == f"treefx synth: interrupted: {path} holds the first 2 trees\n"
    monkeypatch.setattr(synth, "agent_tree", make)
    assert list(read_jsonl(path)) == synth.dataset(2, 0, rollouts=1, vocab_size=SYNTH_VOCAB)


def test_progress_off_a_terminal_is_plain_lines(capsys):
    """A long synth run into a log file: a plain line now and then, no carriage returns."""
    from treefx._progress import Progress

    with Progress(4, "writing t.jsonl", enabled=False, unit=" trees", lines_every=0.0) as bar:
        bar.update(1)
        bar.update(1)
    assert capsys.readouterr().err == ("writing t.jsonl: 1/4 trees, 25.0%, 0 s\n"
                                       "writing t.jsonl: 2/4 trees, 50.0%, 0 s\n")


def test_treefx_failing_is_status_4_naming_the_releases(monkeypatch, tmp_path, small_file,
                                                        capsys):
    """treefx's own failure is not a refusal or a bad argument (2), nor "different" (1): status
    4, its last line naming the releases in use."""
    import torch

    import treefx.tools.cli as cli

    def broken(*args, **kwargs):
        raise AttributeError("'Func' object has no attribute '__name__'")

    monkeypatch.setattr(cli, "_print_table", broken)  # inside `treefx stats`
    with pytest.raises(SystemExit) as info:
        main(["stats", str(small_file)])
    assert info.value.code == cli.EXIT_INTERNAL == 4
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("treefx stats: internal error: AttributeError: 'Func' object"), last
    assert f"torch {torch.__version__}" in last and "transformers " in last, last


def test_a_failure_in_treefx_running_a_model_is_status_4(monkeypatch, capsys):
    """A failure raised in treefx's own code while it runs the user's model is treefx's
    (status 4), not "running the model failed" (a bad argument, 2)."""
    import treefx.run.engine as engine
    import treefx.tools.cli as cli

    def broken(model):
        raise KeyError("no recurrence 'x' is registered")

    monkeypatch.setattr(engine, "prepare_model", broken)  # called by the engine's first call
    with pytest.raises(SystemExit) as info:
        main(["check", "treefx.tools.debug.examples:tiny_decoder"])
    assert info.value.code == cli.EXIT_INTERNAL
    err = capsys.readouterr().err.strip()
    assert "treefx failed: KeyError" in err and "transformers " in err, err
