"""Real agent data in: a vendored mini-swe-agent trajectory (4 model calls of a SWE-bench task,
tests/data/mini_swe_agent, MIT) through treefx.trajectories and treefx.data.from_trajectories
with a think-mode (Qwen3-style) chat template and a BPE tokenizer trained offline on the
trajectory's own text. Each call's tokens and loss mask are recovered from the tree and
compared with the tokenizer's own rendering of that call (apply_chat_template), never with
treefx's."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from test_data import expected_call, unique_prefixes  # noqa: E402

import treefx  # noqa: E402
from treefx import data, trajectories  # noqa: E402
from treefx.models import tiny_chat_tokenizer  # noqa: E402
from treefx.tools.cli import main  # noqa: E402

SWE = Path(__file__).parent / "data" / "mini_swe_agent" / "django__django-16255.traj.json"


@pytest.fixture(scope="module")
def run():
    (t,) = trajectories.read_trajectories(SWE)
    return t


@pytest.fixture(scope="module")
def tok(run):
    return tiny_chat_tokenizer([m["content"] for m in run.messages], vocab_size=1500)


def test_the_mini_swe_agent_file_reads_as_one_run_of_four_calls(run):
    assert run.task == "django__django-16255" and run.reward is None
    calls = trajectories.conversation_calls(run.messages)
    assert len(calls) == 4
    assert [len(c) for c in calls] == [3, 5, 7, 9]
    raw = json.loads(SWE.read_text())["messages"]
    for c in calls:
        last = c[-1]
        assert last["role"] == "assistant" and "extra" not in last
        reasoning = raw[len(c) - 1]["extra"]["response"]["choices"][0]["message"]["reasoning"]
        assert last.get("reasoning_content") == (reasoning or None)
    assert sum("reasoning_content" in c[-1] for c in calls) == 2  # as the API returned it


def test_each_calls_tokens_and_loss_mask_come_back_from_the_tree(run, tok):
    (tree,) = data.from_trajectories([run], tok)
    calls = trajectories.conversation_calls(run.messages)
    assert tree.metadata["task"] == run.task and tree.num_sequences == len(calls)
    seqs = []
    for i, c in enumerate(calls):
        prompt, completion = expected_call(tok, c)
        assert tree.sequence(i).tolist() == prompt + completion
        assert tree.loss_mask(i).tolist() == [0] * len(prompt) + [1] * len(completion)
        seqs.append(prompt + completion)
    # think mode: a call's completion holds its reasoning; the next call's prompt has the
    # turn without it, so the calls branch there and share everything before
    reasoning = calls[0][-1]["reasoning_content"].strip()
    own = tok.decode(tree.sequence(0).tolist())
    later = tok.decode(expected_call(tok, calls[1])[0])
    assert reasoning in own and reasoning not in later
    assert tree.num_tokens == unique_prefixes(seqs) < sum(map(len, seqs))
    assert tree.num_nodes > len(calls)  # branched, not a chain of prefixes


def test_trials_of_one_task_become_one_tree_with_their_rewards(run, tok, tmp_path):
    """τ-bench's result list: two tasks, two trials each, the second trial diverging after
    the first call."""
    other = copy.deepcopy(run.messages)
    other[3]["content"] = "<returncode>1</returncode>\n<output>\nno such file\n</output>"
    results = [{"task_id": 7, "trial": 0, "reward": 1.0, "traj": run.messages[:5]},
               {"task_id": 7, "trial": 1, "reward": 0.0, "traj": other[:7]},
               {"task_id": 9, "trial": 0, "reward": 0.5, "traj": run.messages[:3]},
               {"task_id": 9, "trial": 1, "reward": 0.5, "traj": run.messages[:3]}]
    path = tmp_path / "tau.json"
    path.write_text(json.dumps(results))
    runs = list(trajectories.read_trajectories(path))
    assert [(r.task, r.trial, r.reward) for r in runs] == [
        ("7", 0, 1.0), ("7", 1, 0.0), ("9", 0, 0.5), ("9", 1, 0.5)]
    t7, t9 = data.from_trajectories(runs, tok)
    assert t7.metadata["task"] == "7" and list(t7.metadata["rollouts"]) == [0, 0, 1, 1, 1]
    assert list(t7.metadata["rewards"]) == [1.0, 1.0, 0.0, 0.0, 0.0]
    first = expected_call(tok, trajectories.conversation_calls(run.messages)[0])
    assert t7.sequence(0).tolist() == t7.sequence(2).tolist() == sum(first, [])
    assert t9.num_sequences == 2 and t9.num_tokens == len(t9.sequence(0))  # duplicates


def test_conversations_as_jsonl_and_errors(run, tok, tmp_path):
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps({"id": "a", "messages": run.messages[:3]}) + "\n\n"
                    + json.dumps(run.messages[:5]) + "\n")
    runs = list(trajectories.read_trajectories(path))
    assert [r.task for r in runs] == ["a", "runs:3"]
    with pytest.raises(ValueError, match="no assistant message"):
        trajectories.conversation_calls(run.messages[:2])
    with pytest.raises(ValueError, match="starts with an assistant"):
        trajectories.conversation_calls(run.messages[2:5])
    with pytest.raises(ValueError, match="message 1 is not a chat message"):
        trajectories.conversation_calls([run.messages[0], "hello"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"steps": []}))
    with pytest.raises(ValueError, match="not an agent trajectory"):
        list(trajectories.read_trajectories(bad))
    broken = trajectories.Trajectory("t", run.messages[:2])
    with pytest.raises(ValueError, match="task 't': the conversation has no assistant"):
        list(data.from_trajectories([broken], tok))


@pytest.mark.parametrize("workers", [1, 2])
def test_treefx_ingest_writes_the_trees(run, tok, tmp_path, capsys, workers):
    tok.save_pretrained(tmp_path / "tok")
    out = tmp_path / "trees.jsonl"
    assert main(["ingest", str(SWE), str(SWE), "--tokenizer", str(tmp_path / "tok"),
                 "-o", str(out), "--workers", str(workers)]) == 0
    assert "wrote 2 trees" in capsys.readouterr().out
    want = list(data.from_trajectories([run], tok))
    assert list(treefx.read_jsonl(out)) == want * 2
    assert main(["stats", str(out)]) == 0
    assert "django__django-16255" in capsys.readouterr().out


def _ingest_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


def test_treefx_ingest_errors_name_the_file_and_what_is_wrong(tok, tmp_path, capsys):
    tok.save_pretrained(tmp_path / "tok")
    out = tmp_path / "trees.jsonl"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(json.loads(SWE.read_text())) + "\n\n" + '{"messages": [x]}\n')
    err = _ingest_error(["ingest", str(bad), "--tokenizer", str(tmp_path / "tok"),
                         "-o", str(out)], capsys)
    assert err == (f"treefx ingest: error: {bad}:3: not valid JSON: Expecting value at "
                   "column 15")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    err = _ingest_error(["ingest", str(empty), "--tokenizer", str(tmp_path / "tok"),
                         "-o", str(out)], capsys)
    assert err == f"treefx ingest: error: {empty} holds no trajectories"
    err = _ingest_error(["ingest", str(SWE), "--tokenizer", str(tmp_path / "no_tok"),
                         "-o", str(out)], capsys)
    assert err.startswith(f"treefx ingest: error: --tokenizer {tmp_path / 'no_tok'}: no such "
                          "folder"), err
    assert not out.exists()  # nothing written on an error
