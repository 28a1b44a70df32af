"""Command line: ``treefx demo``, ``stats FILE.jsonl``, ``synth -o FILE.jsonl``, ``explain MODEL``,
``check MODEL``, ``draw FILE.jsonl``."""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import synth
from ._progress import Progress
from .tree import Tree, write_jsonl

_BIG_FILE = 1 << 20  # show a progress bar from 1 MiB on


def _iter_trees_with_progress(path: str, show: bool | None):
    size = os.path.getsize(path)
    enabled = (size >= _BIG_FILE and sys.stderr.isatty()) if show is None else show
    with open(path, "rb") as f, Progress(size, f"reading {path}", enabled=enabled) as bar:
        for lineno, line in enumerate(f, 1):
            bar.update(len(line))
            if not line.strip():
                continue
            try:
                yield Tree.from_dict(json.loads(line))
            except (ValueError, TypeError) as e:
                raise SystemExit(f"treefx: {path}, line {lineno}: {e}") from None


def _stats_row(name, seqs, unique, baseline, extra=()):
    por = 1 - unique / baseline
    return [name, str(seqs), str(unique), str(baseline), f"{por:.3f}", f"{1 / (1 - por):.2f}x",
            *extra]


def _print_table(header, rows):
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for k, r in enumerate([header, *rows]):
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))
        if k == 0 or k == len(rows) - 1 and len(rows) > 1:
            print("  ".join("-" * w for w in widths))


def cmd_stats(args) -> int:
    """One row per tree, or, when trees carry a task id (metadata "task"), one row per task:
    its trees added up (a tree without a task id is a row of its own)."""
    if args.max_tokens is not None:
        from .partition import partition

    rows: dict = {}  # row -> [trees, sequences, unique, baseline tokens, parts, parts' tokens]
    by_task = False
    for i, tree in enumerate(_iter_trees_with_progress(args.file, args.progress)):
        parts = []
        if args.max_tokens is not None:
            try:
                parts = partition(tree, args.max_tokens)
            except ValueError as e:
                raise SystemExit(f"treefx: tree {i}: {e}") from None
        task = tree.metadata.get("task")
        by_task |= task is not None
        counts = rows.setdefault(("task", task) if task is not None else ("tree", i), [0] * 6)
        for k, v in enumerate((1, tree.num_sequences, tree.num_tokens, tree.num_baseline_tokens,
                               len(parts), sum(p.num_tokens for p in parts))):
            counts[k] += v
    if not rows:
        raise SystemExit(f"treefx: {args.file} holds no trees")
    header = (["task", "trees"] if by_task else ["tree"]) + ["sequences", "unique", "baseline",
                                                               "POR", "bound"]
    if args.max_tokens is not None:
        header += ["parts", "ERR", "ERR/POR"]

    def row(name, c, parts):
        extra = ()
        if args.max_tokens is not None:
            e, por = 1 - c[5] / c[3], 1 - c[2] / c[3]
            extra = (parts, f"{e:.3f}", f"{e / por:.3f}" if por > 0 else "-")
        r = _stats_row(name, c[1], c[2], c[3], extra)
        return r[:1] + [str(c[0])] + r[1:] if by_task else r

    table = [row(str(name) if kind == "task" or not by_task else f"tree {name}", c, str(c[4]))
             for (kind, name), c in rows.items()]
    table.append(row("total", [sum(c[k] for c in rows.values()) for k in range(6)], ""))
    _print_table(header, table)
    return 0


def cmd_synth(args) -> int:
    trees = synth.dataset(
        args.n, args.seed, rollouts=args.rollouts, target_por=args.target_por,
        vocab_size=args.vocab_size, mask_outputs=args.mask_outputs,
    )
    n = write_jsonl(args.output, trees)
    print(f"wrote {n} trees to {args.output}")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(steps=args.steps, seed=args.seed)


def _load_factory(spec: str):
    """``MODULE:FACTORY`` -> the object FACTORY names in MODULE (dots allowed in FACTORY)."""
    import importlib

    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise SystemExit(f"treefx: expected MODULE:FACTORY (e.g. "
                         f"treefx.debug.examples:qwen3_tiny), got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like python -m: modules of the current directory
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as e:
        raise SystemExit(f"treefx: cannot import {mod_name!r}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SystemExit(f"treefx: {mod_name} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


class _Verbose:
    """``-v``: the ``treefx`` logger to stderr at INFO (``-vv``: DEBUG) while a command runs."""

    def __init__(self, level: int):
        import logging

        self.logger = logging.getLogger("treefx")
        self.level = level
        self.handler = logging.StreamHandler(sys.stderr)
        self.handler.setFormatter(logging.Formatter("treefx: %(message)s"))
        self.saved = self.logger.level

    def __enter__(self):
        import logging

        if self.level > 0:
            self.logger.addHandler(self.handler)
            self.logger.setLevel(logging.INFO if self.level == 1 else logging.DEBUG)
        return self

    def __exit__(self, *exc):
        if self.level > 0:
            self.logger.removeHandler(self.handler)
            self.logger.setLevel(self.saved)
        return False


def _load_model(spec: str):
    """A model spec on the command line: ``hf:MODEL_TYPE`` (a tiny Hugging Face model of that
    type with random weights, as the zoo builds it) or ``MODULE:FACTORY`` (a zero-argument
    callable returning the module, or the module itself)."""
    import torch

    if spec.startswith("hf:"):
        from .zoo import build_model

        try:
            return build_model(spec[3:])
        except Exception as e:  # noqa: BLE001 - any config failure is the user's answer
            raise SystemExit(f"treefx: cannot build a tiny {spec[3:]!r} model: "
                             f"{type(e).__name__}: {e}") from None
    factory = _load_factory(spec)
    model = factory() if callable(factory) and not isinstance(factory, torch.nn.Module) \
        else factory
    if not isinstance(model, torch.nn.Module):
        raise SystemExit(f"treefx: {spec} returned a {type(model).__name__}, not a "
                         "torch.nn.Module")
    return model


def cmd_explain(args) -> int:
    import torch

    from .debug import explain
    from .debug.examples import demo_tree
    from .layout import pack
    from .reference import vocab_size

    model = _load_model(args.factory)
    if args.trees:
        trees = list(_iter_trees_with_progress(args.trees, None))
        if args.num_trees is not None:
            trees = trees[:args.num_trees]
        if not trees:
            raise SystemExit(f"treefx: {args.trees} holds no trees")
    else:
        vocab = vocab_size(model) or 256
        trees = [demo_tree(vocab)]
    device = next(model.parameters(), torch.empty(0)).device
    batch = pack(trees).to(device)
    with _Verbose(args.verbose):
        report = explain(model, batch, backend=args.backend, verify=args.verify)
    print(report)
    if args.diff:
        print()
        print(report.diff())
    report.to_html(args.html)
    print(f"\nwrote {args.html}")
    return 0 if report.ok and (report.verification is None or report.verification.passed) else 1


def cmd_check(args) -> int:
    import torch

    from .passes import TreeCompileError
    from .tree_model import compile as tree_compile
    from .tree_model import verify
    from .verification import VerificationUnavailable

    model = _load_model(args.model)
    dtype = {"float32": torch.float32, "float64": torch.float64,
             "bfloat16": torch.bfloat16}[args.dtype]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device=device, dtype=dtype)
    if args.checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None) or getattr(
            model, "gradient_checkpointing_enable", None)
        if enable is None:
            raise SystemExit("treefx: --checkpointing needs a Hugging Face model "
                             "(gradient_checkpointing_enable)")
        enable()
        model.train()
    trees = list(_iter_trees_with_progress(args.trees, None)) if args.trees else None
    if trees is not None and not trees:
        raise SystemExit(f"treefx: {args.trees} holds no trees")
    with _Verbose(args.verbose):
        try:
            tm = tree_compile(model, backend=args.backend, verify=False)
            report = verify(tm, trees, params=args.params, raise_on_failure=False)
        except VerificationUnavailable as e:
            print(f"treefx check: {args.model}: cannot verify: {e}")
            return 3
        except TreeCompileError as e:
            print(f"treefx check: {args.model}: refused ({type(e).__name__}): {e}")
            return 2
    print(f"treefx check: {args.model}, {args.backend} backend on {device}, {args.dtype}")
    print(report)
    return 0 if report.passed else 1


def cmd_draw(args) -> int:
    from .debug import draw

    trees = list(_iter_trees_with_progress(args.file, None))
    if not trees:
        raise SystemExit(f"treefx: {args.file} holds no trees")
    if not -len(trees) <= args.index < len(trees):
        raise SystemExit(f"treefx: --index {args.index} is out of range; {args.file} holds "
                         f"{len(trees)} trees")
    try:
        draw(trees[args.index], args.output, max_mask=args.max_mask)
    except ValueError as e:
        raise SystemExit(f"treefx: {e}") from None
    print(f"wrote {args.output}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="treefx", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="train a small decoder on synthetic agent trees, checking "
                       "the tree loss against per-sequence training")
    d.add_argument("--steps", type=int, default=5)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(fn=cmd_demo)

    s = sub.add_parser("stats", help="sequences, unique and baseline tokens, POR per tree")
    s.add_argument("file", help="JSON Lines, one tree a line")
    s.add_argument("--max-tokens", type=int, help="also partition each tree under this budget")
    s.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: on a terminal, for files from 1 MiB)")
    s.set_defaults(fn=cmd_stats)

    g = sub.add_parser("synth", help="write synthetic agent trees as JSON Lines")
    g.add_argument("-o", "--output", required=True)
    g.add_argument("-n", type=int, default=10)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--rollouts", type=int, default=4)
    g.add_argument("--target-por", type=float)
    g.add_argument("--vocab-size", type=int, default=32000)
    g.add_argument("--mask-outputs", action="store_true",
                   help="loss masks cover only what each call generated")
    g.set_defaults(fn=cmd_synth)

    x = sub.add_parser("explain", help="show what treefx does to a model: rewrites, nodes left "
                       "alone, graph breaks, the graph diff; writes an HTML page")
    x.add_argument("factory", metavar="MODEL",
                   help="MODULE:FACTORY, a zero-argument callable returning the "
                        "torch.nn.Module (e.g. treefx.debug.examples:qwen3_tiny), or "
                        "hf:MODEL_TYPE (a tiny Hugging Face model, random weights)")
    x.add_argument("--trees", metavar="FILE.jsonl",
                   help="trees to pack (default: a small synthetic agent tree)")
    x.add_argument("-n", "--num-trees", type=int, help="only the first N trees of --trees")
    x.add_argument("--html", default="treefx-explain.html", help="page to write "
                   "(default: %(default)s)")
    x.add_argument("--backend", default="eager", choices=["eager", "inductor", "auto"])
    x.add_argument("--diff", action="store_true", help="also print the unified graph diff")
    x.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                   help="also compare with each sequence run alone (default: on, unless "
                        "TREEFX_VERIFY=0)")
    x.add_argument("-v", "--verbose", action="count", default=0,
                   help="log what the passes do (-vv: every node)")
    x.set_defaults(fn=cmd_explain)

    c = sub.add_parser("check", help="compile a model for trees and compare it with the "
                       "unmodified model on each sequence alone (log-probs and gradients)",
                       description="Exit status: 0 exact within the dtype's tolerance, 1 "
                       "different (treefx would train it wrongly), 2 refused by treefx (an "
                       "error names the node), 3 not comparable (random ops in the graph).")
    c.add_argument("model", metavar="MODEL",
                   help="hf:MODEL_TYPE (a tiny Hugging Face model of that type, random "
                        "weights, e.g. hf:qwen3) or MODULE:FACTORY (a zero-argument callable "
                        "returning the torch.nn.Module)")
    c.add_argument("--trees", metavar="FILE.jsonl",
                   help="trees to compare on (default: treefx's probe forest)")
    c.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    c.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    c.add_argument("--backend", default="auto", choices=["eager", "inductor", "auto"])
    c.add_argument("--params", default="auto", choices=["auto", "all", "sample"],
                   help="parameters whose gradients are compared (default: all up to 100M)")
    c.add_argument("--checkpointing", action="store_true",
                   help="HF gradient checkpointing on, train mode")
    c.add_argument("-v", "--verbose", action="count", default=0)
    c.set_defaults(fn=cmd_check)

    w = sub.add_parser("draw", help="draw a tree and its attention mask (.png or .svg)")
    w.add_argument("file", help="JSON Lines, one tree a line")
    w.add_argument("-o", "--output", required=True, help="tree.png or tree.svg")
    w.add_argument("--index", type=int, default=0, help="which tree of the file (default 0)")
    w.add_argument("--max-mask", type=int, default=512,
                   help="largest mask picture side; bigger masks are OR-pooled over blocks")
    w.set_defaults(fn=cmd_draw)

    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
