"""Trains the 32k byte-level BPE the SWE trees are tokenized with (no hub here; BENCHMARKS.md,
"Real agent trajectories"), on every tenth trajectory of a folder, for ``treefx ingest``."""

from __future__ import annotations

import argparse
import glob
import json
import os

from treefx.models.chat import tiny_chat_tokenizer


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trajectories", help="folder of trajectory files (*.json, searched below)")
    p.add_argument("out", help="folder to save the tokenizer in")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--every", type=int, default=10, help="train on every N-th file (sorted)")
    args = p.parse_args(argv)
    files = sorted(glob.glob(os.path.join(args.trajectories, "**", "*.json"), recursive=True))
    if not files:
        raise SystemExit(f"no *.json files below {args.trajectories}")
    corpus = []
    for f in files[::args.every]:
        with open(f) as fh:
            doc = json.load(fh)
        msgs = doc.get("messages", []) if isinstance(doc, dict) else doc
        corpus += [m["content"] for m in msgs if isinstance(m, dict)
                   and isinstance(m.get("content"), str)]
    tok = tiny_chat_tokenizer(corpus, vocab_size=args.vocab_size, generation_markers=False)
    tok.save_pretrained(args.out)
    print(f"trained on {len(files[::args.every])} of {len(files)} files, {len(tok)} tokens: "
          f"{args.out}")


if __name__ == "__main__":
    main()
