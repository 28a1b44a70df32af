"""Trees in JSON Lines files, one tree a line, as :meth:`treefx.Tree.to_dict` writes it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator

from .core import Tree

__all__ = ["read_jsonl", "write_jsonl"]


def read_jsonl(path: str | os.PathLike) -> Iterator[Tree]:
    """Trees from a JSON Lines file, one tree a line; errors name the line."""
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield Tree.from_dict(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{os.fspath(path)}, line {lineno}: not valid JSON ({e})") from e
            except (ValueError, TypeError) as e:
                raise type(e)(f"{os.fspath(path)}, line {lineno}: {e}") from e


def write_jsonl(path: str | os.PathLike, trees: Iterable[Tree]) -> int:
    """Write trees as JSON Lines; returns the number written."""
    n = 0
    with open(path, "w") as f:
        for t in trees:
            f.write(json.dumps(t.to_dict(), separators=(",", ":")))
            f.write("\n")
            n += 1
    return n
