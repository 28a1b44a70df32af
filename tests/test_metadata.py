"""Tree metadata: task ids, rollouts, rewards, advantages, sampling log-probs and keys treefx
does not know, checked when a tree is built, kept by JSONL, pickling, copies and subtrees, and
read by ``treefx stats`` (one row per task)."""

import copy
import json
import math
import pickle
import re

import numpy as np
import pytest

import treefx
from treefx import Tree, read_jsonl, rl, write_jsonl
from treefx.tools.cli import main


def rich_tree() -> Tree:
    return Tree.from_sequences(
        [[1, 2, 3], [1, 2, 4, 5], [1, 2, 4]],
        weights=[1.0, 2.0, 0.5],
        loss_masks=[[0, 1, 1], [0, 0, 1, 1], [0, 1, 1]],
        metadata={
            "task": "task-3",
            "rollouts": [0, 0, "r1"],
            "rewards": [1.0, 1.0, -0.5],
            "advantages": [[0.5, 0.5], [1, 2, 3], [0.0, -1.0]],
            "logprobs": [None, [None, -0.25, -1.5], [-0.1, float("nan")]],
            "engine": {"name": "vllm", "temperature": 1.0, "stop": ["<|im_end|>"]},
            "step": 12,
        },
    )


def test_known_keys_are_checked_and_stored_as_read_only_arrays():
    t = rich_tree()
    assert t.metadata["task"] == "task-3"
    assert t.metadata["rollouts"] == (0, 0, "r1")
    assert t.metadata["rewards"].tolist() == [1.0, 1.0, -0.5]
    assert [a.tolist() for a in t.metadata["advantages"]] == [[0.5, 0.5], [1, 2, 3], [0, -1]]
    lp = t.metadata["logprobs"]
    assert np.isnan(lp[0]).all() and len(lp[0]) == 2
    assert np.isnan(lp[1][0]) and lp[1][1:].tolist() == [-0.25, -1.5]
    for arr in (t.metadata["rewards"], *lp, *t.metadata["advantages"]):
        assert not arr.flags.writeable
    assert t.metadata["engine"]["stop"] == ("<|im_end|>",)
    assert "task='task-3'" in repr(t)


def test_metadata_cannot_change():
    t = rich_tree()
    with pytest.raises(TypeError):
        t.metadata["step"] = 13
    with pytest.raises(TypeError):
        t.metadata["engine"]["name"] = "sglang"
    with pytest.raises(AttributeError, match="does not change once built"):
        t.metadata = {}
    with pytest.raises(ValueError, match="read-only"):
        t.metadata["rewards"][0] = 5.0
    # the caller's data is copied
    rewards = [1.0, 2.0]
    u = Tree.from_sequences([[1, 2], [1, 3]], metadata={"rewards": rewards, "x": [rewards]})
    rewards[0] = 9.0
    assert u.metadata["rewards"].tolist() == [1.0, 2.0] and u.metadata["x"] == ((1.0, 2.0),)


def test_jsonl_round_trip_keeps_every_key(tmp_path):
    trees = [rich_tree(), Tree.from_sequences([[7, 8]]),
             Tree.from_sequences([[7, 9], [7]], metadata={"task": 5, "rewards": [0, 1]})]
    path = tmp_path / "rollouts.jsonl"
    write_jsonl(path, trees)
    first = json.loads(path.read_text().splitlines()[0])
    assert first["logprobs"] == [[None, None], [None, -0.25, -1.5], [-0.1, None]]  # JSON null
    assert first["engine"] == {"name": "vllm", "temperature": 1.0, "stop": ["<|im_end|>"]}
    assert first["task"] == "task-3" and first["step"] == 12
    back = list(read_jsonl(path))
    assert back == trees
    assert back[2].metadata["task"] == 5
    assert back[0] != trees[0].with_metadata(step=13)
    assert back[0] != trees[0].with_metadata(logprobs=None)


def test_pickle_copy_and_deepcopy_keep_metadata():
    t = rich_tree()
    for c in (pickle.loads(pickle.dumps(t)), copy.copy(t), copy.deepcopy(t)):
        assert c == t and c.metadata["engine"]["stop"] == ("<|im_end|>",)
        assert not c.metadata["logprobs"][1].flags.writeable
        with pytest.raises(AttributeError):
            c.weights = None


def test_subtree_and_with_metadata():
    t = rich_tree()
    s = t.subtree([2, 0])
    assert s.sequences == [[1, 2, 4], [1, 2, 3]]
    assert s.metadata["rollouts"] == ("r1", 0)
    assert s.metadata["rewards"].tolist() == [-0.5, 1.0]
    assert s.metadata["advantages"][0].tolist() == [0.0, -1.0]
    assert s.metadata["logprobs"][0][0] == -0.1 and np.isnan(s.metadata["logprobs"][1]).all()
    assert s.metadata["engine"] == t.metadata["engine"] and s.metadata["task"] == "task-3"
    u = t.with_metadata(step=None, rewards=[0, 0, 0])
    assert "step" not in u.metadata and u.metadata["rewards"].tolist() == [0, 0, 0]
    assert u.sequences == t.sequences and "step" in t.metadata  # t itself unchanged
    # partition's parts are subtrees: each part carries its sequences' metadata
    parts = treefx.partition(t, 4)
    assert sorted(r for p in parts for r in p.metadata["rewards"].tolist()) == [-0.5, 1.0, 1.0]


@pytest.mark.parametrize("meta, exc, match", [
    ({"rewards": [1.0]}, ValueError, "metadata 'rewards' has 1 entries but the tree has 2"),
    ({"rewards": [1.0, float("nan")]}, ValueError, "metadata 'rewards', entry 1: nan is not "
                                                   "finite"),
    ({"rewards": [1.0, "a"]}, TypeError, "metadata 'rewards', entry 1: 'a' is not a number"),
    ({"task": 1.5}, TypeError, "metadata 'task' must be a string or an integer id"),
    ({"task": True}, TypeError, "metadata 'task'"),
    ({"rollouts": [0, [1]]}, TypeError, r"metadata 'rollouts', sequence 1: rollout id \[1\]"),
    ({"advantages": [1.0, [1.0]]}, TypeError, "metadata 'advantages' mixes numbers and lists"),
    ({"advantages": [[1.0], [1.0, float("inf")]]}, ValueError,
     "metadata 'advantages', sequence 1, entry 1: inf is not finite"),
    ({"logprobs": [[-1.0], [-1.0]]}, ValueError,
     "metadata 'logprobs', sequence 1 has 1 entries but its sequence has 3 tokens; give 2"),
    ({"weights": [1, 1]}, ValueError, "metadata key 'weights' is part of the tree itself"),
    ({"x": {1, 2}}, TypeError, "metadata 'x': a set is not JSON-like data"),
    ([("task", 1)], TypeError, "metadata must be a mapping"),
])
def test_bad_metadata_is_an_error(meta, exc, match):
    with pytest.raises(exc, match=match):
        Tree.from_sequences([[1, 2], [1, 3, 4]], metadata=meta)


def test_rl_reads_metadata_in_its_own_forms():
    t = rich_tree()
    u = Tree.from_sequences([[5, 6, 7]], metadata={"advantages": [2.0], "task": "other",
                                                   "rewards": [3.0]})
    batch = treefx.pack([t, u])
    adv = rl.from_metadata(batch, "advantages")  # per token in t: per token for all
    assert [a.tolist() for a in adv] == [[0.5, 0.5], [1, 2, 3], [0, -1], [2.0, 2.0]]
    assert rl.from_metadata(batch, "rewards").tolist() == [1.0, 1.0, -0.5, 3.0]
    # GRPO: t's rollouts 0 (two calls, reward 1) and "r1" (-0.5); u alone in its task
    a = (1.0 - 0.25) / (np.std([1.0, -0.5], ddof=1) + 1e-6)
    assert rl.grpo_advantages(batch).tolist() == pytest.approx([a, a, -a, 0.0])
    # the per-token advantages drive the objective like any list the caller gives
    lp = torch_zeros(batch.num_tokens)
    assert rl.policy_gradient_loss(lp, batch, adv).item() == 0.0
    with pytest.raises(ValueError, match="tree 1 of the batch has no metadata 'logprobs'"):
        rl.from_metadata(batch, "logprobs")
    with pytest.raises(ValueError, match="metadata 'engine' is neither one number per sequence"):
        rl.from_metadata(treefx.pack(t), "engine")


def torch_zeros(n):
    import torch

    return torch.zeros(n)


def _table(out):
    return [ln.split() for ln in out.splitlines() if ln.strip() and not set(ln) <= {"-", " "}]


def test_stats_reports_por_per_task(tmp_path, capsys):
    a1 = Tree.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5]], metadata={"task": "a"})
    a2 = Tree.from_sequences([[1, 2, 3, 4, 6]], metadata={"task": "a"})
    lone = Tree.from_sequences([[7, 8], [7, 9]])
    b = Tree.from_sequences([[1, 2], [1, 2, 3]], metadata={"task": "b", "rewards": [0, 1]})
    path = tmp_path / "tasks.jsonl"
    write_jsonl(path, [a1, a2, lone, b])
    assert main(["stats", str(path)]) == 0
    rows = _table(capsys.readouterr().out)
    assert rows[0] == ["task", "trees", "sequences", "unique", "baseline", "POR", "bound"]

    def row(name, trees, seqs, unique, baseline):
        por = 1 - unique / baseline
        return [*name.split(), str(trees), str(seqs), str(unique), str(baseline), f"{por:.3f}",
                f"{1 / (1 - por):.2f}x"]

    # task a: its two trees added up (they are separate trees: nothing shared between them)
    assert rows[1] == row("a", 2, 3, 5 + 5, 4 + 4 + 5)
    assert rows[2] == row("tree 2", 1, 2, 3, 4)
    assert rows[3] == row("b", 1, 2, 3, 5)
    assert rows[4] == row("total", 4, 7, 16, 22)
    assert main(["stats", str(path), "--max-tokens", "5"]) == 0
    rows = _table(capsys.readouterr().out)
    assert rows[0][-15:-9] == ["parts", "ERR", "ERR/POR", "rf", "parts", "rf"]  # "rf parts", ...
    parts = [q for t in (a1, a2) for q in treefx.partition(t, 5)]
    err = 1 - sum(q.num_tokens for q in parts) / 13
    rf = [treefx.parts.plan(treefx.pack(t), 5) for t in (a1, a2)]
    assert rows[1][7:] == [str(len(parts)), f"{err:.3f}", f"{err / (1 - 10 / 13):.3f}",
                           str(sum(p.num_parts for p in rf)), f"{1 - 10 / 13:.3f}",
                           str(max(p.peak_held_tokens() for p in rf)),
                           str(max(p.peak_context_tokens() for p in rf)),
                           f"{sum(p.host_tokens for p in rf) / 10:.3f}",
                           f"{sum(p.recompute_tokens for p in rf) / 10:.3f}"]
    # Without task ids the table is per tree, as before.
    write_jsonl(path, [lone, lone])
    main(["stats", str(path)])
    rows = _table(capsys.readouterr().out)
    assert rows[0][0] == "tree" and [r[0] for r in rows[1:]] == ["0", "1", "total"]
    assert re.fullmatch(r"\d\.\d{3}", rows[1][4])
    assert not math.isnan(float(rows[1][4]))
