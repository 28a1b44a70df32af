"""The README's entry points run: the quickstart and the demo agree with the oracle."""

import re
import runpy
from pathlib import Path

import treefx.cli

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_prints_equal_losses(capsys):
    runpy.run_path(str(ROOT / "examples" / "quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    tree_loss, seq_loss = map(float, re.search(r"tree loss ([\d.]+) = per-sequence loss ([\d.]+)",
                                                out).groups())
    assert abs(tree_loss - seq_loss) < 1e-5


def test_demo_runs_and_matches(capsys):
    assert treefx.cli.main(["demo", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    worst = float(re.search(r"largest relative gradient difference.*: ([\d.e+-]+)", out).group(1))
    assert worst < 1e-4
    rows = [ln.split() for ln in out.splitlines() if re.match(r"\s+\d+\s+\d+\s", ln)]
    assert len(rows) == 2
    for row in rows:
        assert abs(float(row[2]) - float(row[3])) < 1e-4


def test_fsdp_example_runs_in_one_process():
    """examples/fsdp.py as a group of one (gloo on the CPU): FSDP2, regional execution,
    treefx.distributed. Two processes: tests/test_distributed.py."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "fsdp.py"), "--steps", "1"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    loss = float(re.search(r"step 0: loss ([\d.]+) \(global mean", out.stdout).group(1))
    assert 0 < loss < 20
