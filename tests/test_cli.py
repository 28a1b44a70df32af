"""Command line: synth and stats."""

from __future__ import annotations

import json

import pytest

import treefx
from treefx import read_jsonl, synth
from treefx.cli import main


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
    assert trees == synth.dataset(3, 0, rollouts=4)


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
    msg = str(info.value.code)
    assert "line 3" in msg and str(path) in msg


@pytest.mark.parametrize(
    "line, match",
    [
        ('{"sequences": [[1, -2]]}', "line 2: sequence 0, position 1"),
        ('{"sequences": [[1]], "weight": [1]}', "line 2: tree record key 'weight'"),
        ("[1, 2]", 'line 2: a tree record must be an object'),
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
    assert header == ["tree", "sequences", "unique", "baseline", "POR", "bound",
                      "parts", "ERR", "ERR/POR"]
    total_part_tokens = 0
    for i, (row, t) in enumerate(zip(rows, trees)):
        parts = partition(t, budget)
        assert all(p.num_tokens <= budget for p in parts)
        assert sum(p.num_sequences for p in parts) == t.num_sequences
        assert sum(p.num_baseline_tokens for p in parts) == t.num_baseline_tokens
        e = err(t, parts)
        assert e == pytest.approx(1 - sum(p.num_tokens for p in parts) / t.num_baseline_tokens)
        assert e <= t.por + 1e-12
        total_part_tokens += sum(p.num_tokens for p in parts)
        assert row == _expected_row(str(i), t.num_sequences, t.num_tokens, t.num_baseline_tokens) + [
            str(len(parts)), f"{e:.3f}", f"{e / t.por:.3f}"
        ]
    baseline = sum(t.num_baseline_tokens for t in trees)
    e_tot = 1 - total_part_tokens / baseline
    por_tot = 1 - sum(t.num_tokens for t in trees) / baseline
    # The total row has an empty "parts" cell.
    assert rows[-1][:6] == _expected_row(
        "total", sum(t.num_sequences for t in trees), sum(t.num_tokens for t in trees), baseline
    )
    assert rows[-1][6:] == [f"{e_tot:.3f}", f"{e_tot / por_tot:.3f}"]


def test_stats_max_tokens_too_small_names_the_tree(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"sequences": [[1, 2]]}) + "\n" + json.dumps({"sequences": [[1, 2, 3, 4]]}) + "\n"
    )
    with pytest.raises(SystemExit, match="tree 1: "):
        main(["stats", str(path), "--max-tokens", "3"])


def test_unknown_command_and_missing_arguments(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["synth"])  # -o is required
    assert info.value.code == 2
    capsys.readouterr()
