"""treefx: train LLMs on prefix trees of agent trajectories, computing every shared prefix once.

Commands: ``treefx demo``, ``stats FILE.jsonl``, ``synth -o FILE.jsonl``, ``explain MODEL``,
``check MODEL``, ``draw FILE.jsonl``. A problem with what a command is given is one line on
stderr (``treefx CMD: error: ...``) and exit status 2, as argparse does for its own errors.
``check`` and ``explain`` share their exit statuses (:data:`EXIT_STATUSES`): 1 means only that
treefx would train the model wrongly. treefx itself failing (a bug, or a release of torch or
transformers it cannot run with) is status 4 (:data:`EXIT_INTERNAL`), its last line naming the
releases in use.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time
import traceback
from pathlib import Path

from .._progress import Progress
from .._version import __version__
from ..tree import Tree
from . import synth
from .debug.pictures import MAX_DEPTH, MAX_LEAVES

_BIG_FILE = 1 << 20  # show a progress bar from 1 MiB on

# ``treefx synth``'s default vocabulary: the smallest of the built-in models' (hf:TYPE models
# of the zoo: 128; treefx.tools.debug.examples and treefx.models.tiny_decoder: 256; the demo:
# 512), so that synthetic trees run on every one of them as they are (test_cli checks the list).
SYNTH_VOCAB = 128

# Token ids are int64: ``treefx synth --vocab-size`` at most this.
MAX_VOCAB = 1 << 63

# The exit statuses of ``treefx check`` and ``treefx explain`` (their --help says them).
EXIT_STATUSES = ("Exit status: 0 exact within the dtype's tolerance, 1 different (treefx would "
                 "train it wrongly), 2 refused by treefx (an error names the node) or a bad "
                 "argument, 3 not comparable (random ops in the graph), 4 treefx itself "
                 "failed (the line names the treefx, torch and transformers releases).")

# The exit status of every command when treefx itself fails (not the user's input or model).
EXIT_INTERNAL = 4


class CLIError(SystemExit):
    """What a command was given is wrong: :func:`main` prints ``treefx CMD: error: MESSAGE``
    (one line) and exits with status 2. ``str()`` is the message."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = " ".join(ln.strip() for ln in str(message).splitlines() if ln.strip())

    def __str__(self) -> str:
        return self.message


class InternalError(SystemExit):
    """treefx itself failed: :func:`main` prints ``treefx CMD: internal error: MESSAGE (treefx
    X, torch Y, transformers Z)`` as the last line and exits with :data:`EXIT_INTERNAL`."""

    def __init__(self, message: str):
        super().__init__(EXIT_INTERNAL)
        self.message = f"{' '.join(str(message).split())} ({_releases()})"

    def __str__(self) -> str:
        return self.message


def _releases() -> str:
    """The releases in use, for a report of treefx's own failure."""
    import importlib.metadata

    found = []
    for dist in ("torch", "transformers"):
        try:
            found.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{dist} not installed")
    return ", ".join([f"treefx {__version__}", *found])


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (a missing argument, a bad value) as one line, status 2."""

    def error(self, message):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise CLIError(message)


def _int_at_least(low: int, high: int | None = None, why: str = ""):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}{why}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its messages
    return parse


def _por(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"a POR is in [0, 1), got {value}")
    return value


def _input_file(path: str) -> str:
    if not os.path.exists(path):
        raise CLIError(f"{path}: no such file")
    if os.path.isdir(path):
        raise CLIError(f"{path}: is a folder, not a file")
    return path


def _output_file(path: str, option: str) -> str:
    """Checked before the work: a file name whose folder exists and is not itself a folder."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CLIError(f"{option} {path}: the folder {os.path.dirname(path) or folder} does "
                       "not exist")
    if os.path.isdir(path):
        raise CLIError(f"{option} {path}: is a folder; give a file name")
    return path


def _iter_trees_with_progress(path: str, show: bool | None):
    size = os.path.getsize(_input_file(path))
    enabled = (size >= _BIG_FILE and sys.stderr.isatty()) if show is None else show
    with open(path, "rb") as f, Progress(size, f"reading {path}", enabled=enabled) as bar:
        for lineno, line in enumerate(f, 1):
            bar.update(len(line))
            if not line.strip():
                continue
            try:
                record = json.loads(line.strip())  # columns count from the line's start
            except json.JSONDecodeError as e:
                raise CLIError(f"{path}:{lineno}: not valid JSON: {e.msg} at column "
                               f"{e.colno}") from None
            except (ValueError, RecursionError) as e:  # not UTF-8, nested too deep
                raise CLIError(f"{path}:{lineno}: not valid JSON: {e}") from None
            try:
                yield Tree.from_dict(record)
            except (ValueError, TypeError) as e:
                raise CLIError(f"{path}:{lineno}: {e}") from None


def _read_trees(path: str, limit: int | None = None) -> list[Tree]:
    """The trees of a file (its first ``limit``), at least one."""
    trees = []
    for tree in _iter_trees_with_progress(path, None):
        if limit is not None and len(trees) == limit:
            break
        trees.append(tree)
    if not trees:
        raise CLIError(f"{path} holds no trees")
    return trees


def _check_vocabulary(model, trees: list[Tree], path: str) -> None:
    """Token ids of ``trees`` inside the model's vocabulary (what it declares, or the width of
    its logits: :func:`treefx.verification.probe_vocab_size`), or an error that names the
    first id outside and what to do."""
    from ..verification import VocabularyUnknown, probe_vocab_size

    try:
        vocab = probe_vocab_size(model)
    except VocabularyUnknown:
        return
    for i, tree in enumerate(trees):
        top = max(int(s.max()) for s in tree.segments if len(s))
        if top >= vocab:
            raise CLIError(f"{path}: tree {i} holds token id {top}, outside the model's "
                           f"vocabulary of {vocab} (ids 0 to {vocab - 1}); write trees for it "
                           f"with treefx synth --vocab-size {vocab}")


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
    its trees added up (a tree without a task id is a row of its own). With ``--max-tokens``,
    both ways of training a tree over the budget: parts of whole sequences
    (:func:`treefx.partition`, shared prefixes recomputed: ERR below POR; "-" when a
    sequence alone is over the budget) and redundancy-free parts (:func:`treefx.backward`:
    every token once, ERR = POR), with the most tokens those hold activations for at once
    (at most the budget), the longest open path whose keys and values they keep for later
    parts, the share of the tokens whose activations would wait in host memory with
    ``beyond="host"`` (none as planned by default) and of those whose forward runs twice
    (recompute parts, the default)."""
    memory = _memory_model(args)
    if args.max_tokens is not None or memory is not None:
        from ..layout import pack
        from ..partition import partition
        from ..parts import plan
        from ..run.parts import memory as mem

    # row -> [trees, sequences, unique, baseline tokens, parts, parts' tokens, rf parts,
    #         rf held tokens (max), rf open-path K/V tokens (max), rf recomputed tokens,
    #         rf host tokens];
    #         parts' entries None when a tree cannot be partitioned
    rows: dict = {}
    by_task = False
    for i, tree in enumerate(_iter_trees_with_progress(args.file, args.progress)):
        whole, rf = None, None
        if args.max_tokens is not None:
            try:
                whole = partition(tree, args.max_tokens)
            except ValueError:
                whole = None  # a sequence over the budget: not as whole sequences
            rf = plan(pack(tree), args.max_tokens)
        task = tree.metadata.get("task")
        by_task |= task is not None
        counts = rows.setdefault(("task", task) if task is not None else ("tree", i),
                                 [0] * 6 + [0] * 5 + [None, 0, 0])
        if memory is not None:  # [11] mem tokens (min), [12] mem parts, [13] mem peak (max)
            batch = pack(tree)
            try:
                tokens = mem.plan_tokens(memory, args.max_memory, batch)
            except ValueError as e:
                raise CLIError(f"--max-memory {args.max_memory}: {e}") from None
            mp = plan(batch, tokens)
            counts[11] = tokens if counts[11] is None else min(counts[11], tokens)
            counts[12] += mp.num_parts
            counts[13] = max(counts[13], memory.plan_peak(mp))
        for k, v in enumerate((1, tree.num_sequences, tree.num_tokens, tree.num_baseline_tokens)):
            counts[k] += v
        if args.max_tokens is not None:
            for k, v in ((4, None if whole is None else len(whole)),
                         (5, None if whole is None else sum(p.num_tokens for p in whole))):
                counts[k] = None if v is None or counts[k] is None else counts[k] + v
            counts[6] += rf.num_parts
            counts[7] = max(counts[7], rf.peak_held_tokens())
            counts[8] = max(counts[8], rf.peak_context_tokens())
            counts[9] += rf.recompute_tokens
            counts[10] += rf.host_tokens
    if not rows:
        raise CLIError(f"{args.file} holds no trees")
    header = (["task", "trees"] if by_task else ["tree"]) + ["sequences", "unique", "baseline",
                                                               "POR", "bound"]
    if args.max_tokens is not None:
        header += ["parts", "ERR", "ERR/POR", "rf parts", "rf ERR", "rf held", "rf K/V",
                   "rf host", "rf recomp"]
    if memory is not None:
        header += ["mem tokens", "mem parts", "mem peak"]

    def row(name, c, show_parts):
        extra = ()
        if args.max_tokens is not None:
            por = 1 - c[2] / c[3]
            if c[4] is None:
                extra = ("-", "-", "-")
            else:
                e = 1 - c[5] / c[3]
                extra = (str(c[4]) if show_parts else "", f"{e:.3f}",
                         f"{e / por:.3f}" if por > 0 else "-")
            extra += (str(c[6]) if show_parts else "", f"{por:.3f}", str(c[7]), str(c[8]),
                      f"{c[10] / c[2]:.3f}", f"{c[9] / c[2]:.3f}")
        if memory is not None:
            extra += (str(c[11]), str(c[12]), f"{c[13] / 2 ** 30:.2f} GiB")
        r = _stats_row(name, c[1], c[2], c[3], extra)
        return r[:1] + [str(c[0])] + r[1:] if by_task else r

    table = [row(str(name) if kind == "task" or not by_task else f"tree {name}", c, True)
             for (kind, name), c in rows.items()]
    total = [sum(c[k] for c in rows.values()) for k in range(4)]
    total += [None if any(c[k] is None for c in rows.values()) else
              sum(c[k] for c in rows.values()) for k in (4, 5)]
    total += [sum(c[6] for c in rows.values()), max(c[7] for c in rows.values()),
              max(c[8] for c in rows.values()), sum(c[9] for c in rows.values()),
              sum(c[10] for c in rows.values())]
    if memory is not None:
        total += [min(c[11] for c in rows.values()), sum(c[12] for c in rows.values()),
                  max(c[13] for c in rows.values())]
    table.append(row("total", total, False))
    if memory is not None:
        print(f"memory model ({args.model}{', checkpointing' if args.checkpointing else ''}):"
              f" {memory.per_token:,} bytes a token held, {memory.context_per_token:,} an "
              f"open-path token, loss {memory.loss(memory.chunk_rows) / 2 ** 30:.2f} GiB at "
              f"most, fixed {memory.fixed / 2 ** 30:.2f} GiB; budget {args.max_memory} "
              "(estimates from the shape, not measured)")
    _print_table(header, table)
    return 0


def _memory_model(args):
    """``--max-memory``'s memory model (:mod:`treefx.run.parts.memory`) from ``--model``, or
    None without ``--max-memory``."""
    extra = [o for o, v in (("--model", args.model), ("--fixed-memory", args.fixed_memory),
                            ("--checkpointing", args.checkpointing)) if v]
    if args.max_memory is None:
        if extra:
            raise CLIError(f"{extra[0]} goes with --max-memory")
        return None
    from ..run.parts import memory as mem

    try:
        mem.parse_size(args.max_memory)
        fixed = None if args.fixed_memory is None else mem.parse_size(args.fixed_memory)
    except ValueError as e:
        raise CLIError(str(e)) from None
    if args.model is None:
        raise CLIError("--max-memory needs --model: a Hugging Face config.json (or its "
                       "folder), or a shape like hidden=4096,intermediate=12288,layers=36,"
                       "heads=32,kv_heads=8,vocab=151936")
    path = Path(args.model)
    if path.is_dir():
        path = path / "config.json"
    try:
        if path.is_file():
            config = json.loads(path.read_text(encoding="utf-8"))
            config = config.get("text_config", config)
        else:
            config = mem.parse_shape(args.model)
        if fixed is None:
            dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
            fixed = 2 * mem.parameter_count(config) * mem.dtype_size(dtype)
        return mem.from_config(config, checkpointing=args.checkpointing, fixed_bytes=fixed)
    except (ValueError, TypeError, AttributeError, OSError) as e:
        raise CLIError(f"--model {args.model}: {e}") from None


def _ingest_file(path: str, tokenizer, options: dict) -> list:
    """The trees of one trajectory file (a worker's job in ``treefx ingest``)."""
    from .. import data, trajectories
    runs = list(trajectories.read_trajectories(path))
    if not runs:
        raise ValueError(f"{path} holds no trajectories")
    return list(data.from_trajectories(runs, tokenizer, **options))


_WORKER_TOKENIZER = []


def _ingest_worker_init(tokenizer_dir: str, chat_template: str | None) -> None:
    _WORKER_TOKENIZER[:] = [_load_tokenizer(tokenizer_dir, chat_template)]


def _ingest_in_worker(path: str, options: dict) -> list:
    return _ingest_file(path, _WORKER_TOKENIZER[0], options)


def _load_tokenizer(tokenizer_dir: str, chat_template: str | None):
    from transformers import AutoTokenizer

    if not os.path.isdir(tokenizer_dir):
        # else Hugging Face takes the path for a Hub repository id and says that is malformed
        what = "is a file, not a folder" if os.path.exists(tokenizer_dir) else "no such folder"
        raise CLIError(f"--tokenizer {tokenizer_dir}: {what} (a tokenizer folder saved with "
                       "save_pretrained)")
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CLIError(f"--tokenizer {tokenizer_dir}: no tokenizer could be loaded from it "
                       f"({why})") from None
    if chat_template is not None:
        with open(chat_template) as f:
            tok.chat_template = f.read()
    if not tok.chat_template:
        raise CLIError(f"the tokenizer in {tokenizer_dir} has no chat template; give one "
                       "with --chat-template FILE")
    return tok


def cmd_ingest(args) -> int:
    """Trajectory files to trees, one tree per task (treefx.data.from_trajectories), written
    as JSON Lines in the order of the files; with ``--workers`` N, N processes build the files'
    trees side by side. Progress: a line per file on a terminal (``--progress``)."""
    _output_file(args.output, "-o")
    files = list(args.files)
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise CLIError(f"no such file: {missing[0]}")
    options = dict(train_on=args.train_on)
    if args.no_thinking:
        options["enable_thinking"] = False
    show = args.progress
    bar = Progress(len(files), f"ingesting into {args.output}", unit=" files",
                   enabled=sys.stderr.isatty() if show is None else show,
                   delay=1.0 if show is None else 0.0,
                   lines_every=30.0 if show is None else None)
    counts = [0, 0, 0, 0]  # trees, calls, unique tokens, tokens laid out by calls
    start = time.perf_counter()

    def write(f, trees):
        for tree in trees:
            f.write(json.dumps(tree.to_dict(), separators=(",", ":")) + "\n")
            for k, v in enumerate((1, tree.num_sequences, tree.num_tokens,
                                   tree.num_baseline_tokens)):
                counts[k] += v
        bar.update(1)

    tok = _load_tokenizer(args.tokenizer, args.chat_template)  # its errors before any work
    try:
        with bar, open(args.output, "w") as f:
            if args.workers > 1:
                from concurrent.futures import ProcessPoolExecutor
                with ProcessPoolExecutor(args.workers, initializer=_ingest_worker_init,
                                         initargs=(args.tokenizer, args.chat_template)) as ex:
                    for trees in ex.map(_ingest_in_worker, files, [options] * len(files)):
                        write(f, trees)
            else:
                for path in files:
                    write(f, _ingest_file(path, tok, options))
    except (TypeError, ValueError, OSError) as e:
        os.remove(args.output)
        raise CLIError(" ".join(str(e).split())) from None
    took = time.perf_counter() - start
    bound = counts[3] / counts[2] if counts[2] else 0.0
    print(f"wrote {counts[0]} trees to {args.output}: {counts[1]} calls, {counts[2]} unique "
          f"tokens, {counts[3]} laid out call by call (bound {bound:.1f}x), in {took:.1f} s")
    return 0


def cmd_synth(args) -> int:
    """Each tree is written as it is made (one line each; never all in memory), with a
    progress bar on a terminal once the run takes more than a second (``--progress``: always;
    off a terminal, a line every 30 s of a long run). An error leaves no file behind; an
    interrupted run (Ctrl-C) leaves the trees written so far, each line a whole tree."""
    _output_file(args.output, "-o")
    made = synth.iter_dataset(args.n, args.seed, rollouts=args.rollouts,
                              target_por=args.target_por, vocab_size=args.vocab_size,
                              mask_outputs=args.mask_outputs)
    count = [0]

    def error(e: ValueError) -> CLIError:
        which = f"tree {count[0]} (seed {args.seed + count[0]}): " if count[0] else ""
        if args.target_por is not None and "target_por" in str(e):
            return CLIError(f"argument --target-por: {which}{e}")
        return CLIError(f"{which}{e}")

    try:
        first = [next(made)]  # the options' errors before the file is created
    except ValueError as e:
        raise error(e) from None
    show = args.progress
    bar = Progress(args.n, f"writing {args.output}", unit=" trees",
                   enabled=sys.stderr.isatty() if show is None else show,
                   delay=1.0 if show is None else 0.0,
                   lines_every=30.0 if show is None else None)

    try:
        with bar, open(args.output, "w") as f:
            for tree in itertools.chain(first, made):
                # one line as write_jsonl writes it, on disk before the next tree is made
                f.write(json.dumps(tree.to_dict(), separators=(",", ":")) + "\n")
                f.flush()
                count[0] += 1
                bar.update(1)
    except ValueError as e:
        os.remove(args.output)
        raise error(e) from None
    except KeyboardInterrupt:  # every line written is a whole tree: keep them
        print(f"treefx synth: interrupted: {args.output} holds the first {count[0]} trees",
              file=sys.stderr)
        raise SystemExit(130) from None
    print(f"wrote {count[0]} trees to {args.output}")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(steps=args.steps, seed=args.seed)


def _load_factory(spec: str):
    """``MODULE:FACTORY`` -> the object FACTORY names in MODULE (dots allowed in FACTORY)."""
    import importlib

    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise CLIError(f"expected MODULE:FACTORY (e.g. treefx.tools.debug.examples:qwen3_tiny) "
                       f"or hf:MODEL_TYPE, got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like python -m: modules of the current directory
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as e:
        raise CLIError(f"cannot import {mod_name!r}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CLIError(f"{mod_name} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


@contextlib.contextmanager
def _model_errors(args):
    """An exception from running the user's model (other than treefx's refusals, which the
    commands report) as one line, exit status 2; one that treefx's own code raised, or any from
    a built-in ``hf:`` model (Hugging Face's code run as the installed release has it), as
    treefx's failure (:class:`InternalError`). ``-v`` also prints the traceback."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - the model is the user's code
        from ..compiler import TreeCompileError

        if isinstance(e, (TreeCompileError, OSError)):
            raise
        if args.verbose:
            traceback.print_exc()
        spec = getattr(args, "model", None) or args.factory
        hint = "" if args.verbose else " (-v prints the traceback)"
        if spec.startswith("hf:") or _raised_by_treefx(e, spec):
            raise InternalError(f"{spec}: treefx failed: {_first_line(e)}{hint}") from None
        raise CLIError(f"{spec}: running the model failed: {_first_line(e)}{hint}") from None


def _raised_by_treefx(e: BaseException, spec: str) -> bool:
    """Whether the innermost frame of ``e``'s traceback that says whose the failure is, is
    treefx's: a frame of treefx's code is treefx's; one of the model factory's module
    (``spec``'s MODULE), or torch calling a module (a model that cannot be called so, or fails
    inside), is the model's; torch's other frames tell nothing."""
    import pathlib

    here = pathlib.Path(__file__).resolve().parent.parent
    mod = sys.modules.get(spec.split(":", 1)[0])
    user = getattr(mod, "__file__", None)
    user = pathlib.Path(user).resolve().parent if user else None
    for frame, _ in reversed(list(traceback.walk_tb(e.__traceback__))):
        path = pathlib.Path(frame.f_code.co_filename).resolve()
        if user is not None and path.is_relative_to(user) and not path.is_relative_to(here):
            return False
        if frame.f_code.co_name in ("_call_impl", "_wrapped_call_impl") and \
                path.parts[-4:] == ("torch", "nn", "modules", "module.py"):
            return False
        if path.is_relative_to(here) and path != pathlib.Path(__file__).resolve():
            return True
    return False


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


def _first_line(e: BaseException, limit: int = 300) -> str:
    """``Type: the first line of the message`` (cut at ``limit`` characters)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _hf_model(model_type: str):
    """``hf:MODEL_TYPE``: the zoo's tiny model of that type, or an error that names the closest
    causal-LM model types of the installed transformers."""
    import difflib

    from .zoo import all_model_types, build_model

    try:
        import transformers
    except ImportError:
        raise CLIError("hf:MODEL_TYPE needs transformers: pip install transformers") from None
    types = all_model_types()
    if model_type not in types:
        close = difflib.get_close_matches(model_type, types, n=5, cutoff=0.6)
        hint = f"the closest: {', '.join(close)}" if close else "none is close to it"
        raise CLIError(f"cannot build a tiny {model_type!r} model: not a causal-LM model type of "
                       f"transformers {transformers.__version__}; {hint}; docs/zoo.md lists "
                       "every type with how treefx did on it")
    try:
        return build_model(model_type)
    except Exception as e:  # noqa: BLE001 - any config failure is the user's answer
        raise CLIError(f"cannot build a tiny {model_type!r} model: {_first_line(e)} (docs/zoo.md "
                       "says how each type did)") from None


def _load_model(spec: str):
    """A model spec on the command line: ``hf:MODEL_TYPE`` (a tiny Hugging Face model of that
    type with random weights, as the zoo builds it) or ``MODULE:FACTORY`` (a zero-argument
    callable returning the module, or the module itself)."""
    import inspect

    import torch

    if spec.startswith("hf:"):
        return _hf_model(spec[3:])
    factory = _load_factory(spec)
    if isinstance(factory, torch.nn.Module):
        model = factory
    elif callable(factory):
        try:
            inspect.signature(factory).bind()
        except TypeError:
            needed = [p.name for p in inspect.signature(factory).parameters.values()
                      if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL,
                                                                 p.VAR_KEYWORD)]
            raise CLIError(f"factory {spec} failed: it needs arguments ({', '.join(needed)}), "
                           "but MODEL is called with none; write a function without "
                           "arguments that calls it and returns the model") from None
        except ValueError:  # no signature to read (a builtin): call it and see
            pass
        try:
            model = factory()
        except Exception as e:  # noqa: BLE001 - the factory is the user's code
            raise CLIError(f"factory {spec} failed: {_first_line(e)}") from None
        if not isinstance(model, torch.nn.Module):
            raise CLIError(f"factory {spec} returned a {type(model).__name__}, not a "
                           "torch.nn.Module")
    else:
        raise CLIError(f"{spec} is a {type(factory).__name__}, not a torch.nn.Module or a "
                       "function returning one")
    if next(model.parameters(), None) is None:
        raise CLIError(f"{spec}: the model has no parameters; MODEL is a causal language "
                       "model (token ids in, logits out)")
    return model


def _device(text: str | None):
    """``--device``, checked: cpu or an available CUDA device (default: cuda when
    available)."""
    import torch

    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise CLIError(f"--device {text}: unknown device; use cpu or cuda (cuda:N for one of "
                       "several GPUs)") from None
    if device.type not in ("cpu", "cuda"):
        raise CLIError(f"--device {text}: treefx runs on cpu or cuda, not {device.type}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CLIError(f"--device {text}: CUDA is not available (torch.cuda.is_available() "
                           "is False); use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise CLIError(f"--device {text}: this machine has {count} CUDA device"
                           f"{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1})")
    return device


def _check_backend(backend: str, device) -> None:
    """``--backend inductor`` runs on CUDA only (FlexAttention and Inductor's GPU kernels)."""
    import torch

    from ..run.backends import inductor_on_cpu

    if backend == "inductor" and device.type != "cuda" and not inductor_on_cpu():
        where = ("CUDA is not available here" if not torch.cuda.is_available() else
                 f"--device is {device}")
        raise CLIError(f"--backend inductor needs CUDA, but {where}; use --backend auto "
                       "(inductor on CUDA, eager elsewhere) or --backend eager")


def _check_num_trees(args) -> None:
    if args.num_trees is not None and not args.trees:
        raise CLIError(f"-n {args.num_trees} needs --trees: it takes the first N trees of that "
                       "file")


def _probe_vocabulary(model, spec: str) -> int:
    """The token ids treefx's own trees for ``model`` use are below this, or an error that
    says to pass --trees."""
    from ..verification import VocabularyUnknown, probe_vocab_size

    try:
        return probe_vocab_size(model)
    except VocabularyUnknown as e:
        raise CLIError(f"{spec}: cannot tell which token ids the model takes: {e.reason}; "
                       "pass --trees with trees of its token ids") from None


def cmd_explain(args) -> int:
    from .debug import explain
    from .debug.examples import demo_tree
    from ..layout import pack

    _check_num_trees(args)
    device = _device(args.device)
    _check_backend(args.backend, device)
    _output_file(args.html, "--html")
    if args.trees:
        _input_file(args.trees)  # before building the model
    model = _load_model(args.factory).to(device)
    if args.trees:
        trees = _read_trees(args.trees, args.num_trees)
        _check_vocabulary(model, trees, args.trees)
    else:
        trees = [demo_tree(_probe_vocabulary(model, args.factory))]
    batch = pack(trees).to(device)
    with _Verbose(args.verbose), _model_errors(args):
        report = explain(model, batch, backend=args.backend, verify=args.verify)
    print(report)
    if args.diff:
        print()
        print(report.diff())
    report.to_html(args.html)
    print(f"\nwrote {args.html}")
    if not report.ok:
        return 2  # refused: the report names the node
    if report.verification is not None:
        return 0 if report.verification.passed else 1
    return 3 if report.verification_error else 0  # the probe could not compare (random ops)


def cmd_check(args) -> int:
    import torch

    from ..compiler import TreeCompileError
    from ..run.model import compile as tree_compile
    from ..run.model import verify
    from ..verification import VerificationUnavailable

    _check_num_trees(args)
    device = _device(args.device)
    _check_backend(args.backend, device)
    if args.trees:
        _input_file(args.trees)  # before building the model
    model = _load_model(args.model)
    dtype = {"float32": torch.float32, "float64": torch.float64,
             "bfloat16": torch.bfloat16}[args.dtype]
    model = model.to(device=device, dtype=dtype)
    if args.checkpointing:
        from ..models import enable_activation_checkpointing

        try:
            enable_activation_checkpointing(model)
        except TypeError:
            raise CLIError("--checkpointing needs a Hugging Face model "
                           "(activation_checkpointing_enable)") from None
        model.train()
    trees = _read_trees(args.trees, args.num_trees) if args.trees else None
    if trees is not None:
        _check_vocabulary(model, trees, args.trees)
    else:
        _probe_vocabulary(model, args.model)
    with _Verbose(args.verbose), _model_errors(args):
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
    from .debug.pictures import draw, picture_part

    if os.path.splitext(args.output)[1].lower() not in (".png", ".svg"):
        raise CLIError(f"-o {args.output}: cannot draw to it; use a .png or .svg file name")
    _output_file(args.output, "-o")
    trees = _read_trees(args.file)
    if not -len(trees) <= args.index < len(trees):
        raise CLIError(f"--index {args.index} is out of range; {args.file} holds "
                       f"{len(trees)} trees")
    tree = trees[args.index]
    part = picture_part(tree, max_leaves=args.max_leaves)
    draw(tree, args.output, max_mask=args.max_mask, max_leaves=args.max_leaves)
    if part.capped:
        print(f"wrote {args.output}: {part.note()}; the whole tree is more than "
              f"{args.max_leaves} leaves across or {MAX_DEPTH} nodes deep (--max-leaves)")
    else:
        print(f"wrote {args.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="treefx", description=__doc__.split("\n\n")[0],
                epilog="treefx COMMAND --help: that command's options.")
    p.add_argument("--version", action="version", version=f"treefx {__version__}",
                   help="print treefx's version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str, details: str = ""):
        """A command: ``summary`` in the top-level list, and first in its own --help."""
        return sub.add_parser(name, help=summary,
                              description=f"{summary[0].upper()}{summary[1:]}. {details}".strip())
    seed_help = "random seed (an integer from 0; default %(default)s)"

    d = command("demo", "train a small decoder on synthetic agent trees, checking "
                "the tree loss against per-sequence training")
    d.add_argument("--steps", type=_int_at_least(1), default=5,
                   help="training steps, one synthetic tree each (default %(default)s)")
    d.add_argument("--seed", type=_int_at_least(0), default=0, help=seed_help)
    d.set_defaults(fn=cmd_demo)

    s = command("stats", "sequences, unique and baseline tokens, POR per tree (or "
                "per task)")
    s.add_argument("file", help="JSON Lines, one tree a line")
    s.add_argument("--max-tokens", type=_int_at_least(1),
                   help="also plan each tree under this token budget: parts of whole "
                        "sequences (treefx.partition: parts, ERR) and redundancy-free parts "
                        "(treefx.backward: rf parts, rf ERR = POR, rf held = most tokens "
                        "holding activations at once, at most the budget; rf K/V = the "
                        "longest open path, whose keys and values are kept for later parts; "
                        "rf host = share of the tokens in host parts, whose activations wait "
                        "in host memory for their backward (each forward run once); "
                        "rf recomp = share of the tokens in recompute parts, whose forward "
                        "runs twice, as treefx.backward plans by default)")
    s.add_argument("--max-memory", metavar="SIZE",
                   help="also plan each tree for treefx.backward(max_memory=SIZE), e.g. 40GiB, "
                        "with --model's memory model: mem tokens = the token budget it gives, "
                        "mem parts, mem peak = the estimated peak of the plan (GiB)")
    s.add_argument("--model", metavar="CONFIG",
                   help="with --max-memory: a Hugging Face config.json (or its folder), or a "
                        "shape: hidden=4096,intermediate=12288,layers=36,heads=32,kv_heads=8,"
                        "head_dim=128,vocab=151936,dtype=bfloat16")
    s.add_argument("--checkpointing", action="store_true",
                   help="with --max-memory: every layer activation-checkpointed")
    s.add_argument("--fixed-memory", metavar="SIZE",
                   help="with --max-memory: weights, gradients and optimizer state (default: "
                        "the weights and their gradients, from the shape)")
    s.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: on a terminal, for files from 1 MiB)")
    s.set_defaults(fn=cmd_stats)

    g = command("synth", "write synthetic agent trees as JSON Lines")
    g.add_argument("-o", "--output", required=True, metavar="FILE.jsonl",
                   help="file to write (its folder must exist)")
    g.add_argument("-n", type=_int_at_least(1), default=10,
                   help="number of trees, each written as it is made (default %(default)s)")
    g.add_argument("--seed", type=_int_at_least(0), default=0,
                   help="seed of the first tree; tree i has seed + i (default %(default)s)")
    g.add_argument("--rollouts", type=_int_at_least(1), default=4,
                   help="rollouts of one prompt per tree, a GRPO group (default %(default)s)")
    g.add_argument("--target-por", type=_por, metavar="POR",
                   help="scale the shared prompt until each tree's POR is within 0.01 of this "
                        "(in [0, 1); an error if the tree's shape cannot reach it)")
    g.add_argument("--vocab-size", type=_int_at_least(2, MAX_VOCAB, " (token ids are int64)"),
                   default=SYNTH_VOCAB,
                   help="token ids are below this (default %(default)s: fits every built-in "
                        "model, hf:TYPE and treefx.tools.debug.examples; at most 2**63)")
    g.add_argument("--mask-outputs", action="store_true",
                   help="loss masks cover only what each call generated")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: on a terminal, once the run takes more than "
                        "a second; off a terminal, a line every 30 s of a long run)")
    g.set_defaults(fn=cmd_synth)

    n = command("ingest", "build trees from agent trajectory files through a chat template",
                "Reads mini-swe-agent runs, tau-bench results and OpenAI-style message lists. "
                "Every assistant message is one model call, its prompt the messages before "
                "it; a call's reasoning is read from reasoning_content, reasoning, or "
                "mini-swe-agent's raw response. Writes one tree per task (trials of one task "
                "grouped, with their rewards).")
    n.add_argument("files", nargs="+", metavar="FILE",
                   help="trajectory files (.json: one run or a list of tau-bench results; "
                        ".jsonl: one run a line)")
    n.add_argument("--tokenizer", required=True, metavar="DIR",
                   help="a saved Hugging Face tokenizer (AutoTokenizer.from_pretrained)")
    n.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template to use instead of the tokenizer's")
    n.add_argument("-o", "--output", required=True, metavar="FILE.jsonl",
                   help="file to write (its folder must exist)")
    n.add_argument("--train-on", default="last", choices=["last", "all"],
                   help="loss mask: each call's completion (default), or every assistant "
                        "message as the call renders it")
    n.add_argument("--no-thinking", action="store_true",
                   help="render with enable_thinking=False")
    n.add_argument("--workers", type=_int_at_least(1), default=1,
                   help="processes building trees side by side (default %(default)s)")
    n.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: on a terminal, once the run takes more than "
                        "a second)")
    n.set_defaults(fn=cmd_ingest)

    x = command("explain", "show what treefx does to a model: rewrites, nodes left "
                "alone, graph breaks, the graph diff; writes an HTML page",
                "The probe check (--verify, on by default) compares the tree run with each "
                "sequence run alone. " + EXIT_STATUSES.replace(
                    "tolerance,", "tolerance (--no-verify: compiled),"))
    x.add_argument("factory", metavar="MODEL",
                   help="MODULE:FACTORY, a zero-argument callable returning the "
                        "torch.nn.Module (e.g. treefx.tools.debug.examples:qwen3_tiny), or "
                        "hf:MODEL_TYPE (a tiny Hugging Face model, random weights)")
    x.add_argument("--trees", metavar="FILE.jsonl",
                   help="trees to pack (default: a small synthetic agent tree)")
    x.add_argument("-n", "--num-trees", type=_int_at_least(1),
                   help="only the first N trees of --trees (needs --trees)")
    x.add_argument("--html", default="treefx-explain.html", metavar="FILE.html",
                   help="page to write (default: %(default)s)")
    x.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    x.add_argument("--backend", default="auto", choices=["eager", "inductor", "auto"],
                   help="backend to compile with (default %(default)s: inductor on CUDA, eager "
                        "elsewhere; inductor needs CUDA)")
    x.add_argument("--diff", action="store_true", help="also print the unified graph diff")
    x.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                   help="also compare with each sequence run alone (default: on, unless "
                        "TREEFX_VERIFY=0)")
    x.add_argument("-v", "--verbose", action="count", default=0,
                   help="log what the passes do (-vv: every node)")
    x.set_defaults(fn=cmd_explain)

    c = command("check", "compile a model for trees and compare it with the unmodified model "
                "on each sequence alone (log-probs and gradients)", EXIT_STATUSES)
    c.add_argument("model", metavar="MODEL",
                   help="hf:MODEL_TYPE (a tiny Hugging Face model of that type, random "
                        "weights, e.g. hf:qwen3) or MODULE:FACTORY (a zero-argument callable "
                        "returning the torch.nn.Module)")
    c.add_argument("--trees", metavar="FILE.jsonl",
                   help="trees to compare on (default: treefx's probe forest)")
    c.add_argument("-n", "--num-trees", type=_int_at_least(1),
                   help="only the first N trees of --trees (needs --trees)")
    c.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"],
                   help="the model's dtype (default %(default)s)")
    c.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    c.add_argument("--backend", default="auto", choices=["eager", "inductor", "auto"],
                   help="backend to compile with (default %(default)s: inductor on CUDA, eager "
                        "elsewhere; inductor needs CUDA)")
    c.add_argument("--params", default="auto", choices=["auto", "all", "sample"],
                   help="parameters whose gradients are compared (default: all up to 100M)")
    c.add_argument("--checkpointing", action="store_true",
                   help="HF gradient checkpointing on, train mode")
    c.add_argument("-v", "--verbose", action="count", default=0,
                   help="log what the passes do (-vv: every node)")
    c.set_defaults(fn=cmd_check)

    w = command("draw", "draw a tree and its attention mask (.png or .svg)")
    w.add_argument("file", help="JSON Lines, one tree a line")
    w.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="tree.png or tree.svg (its folder must exist)")
    w.add_argument("--index", type=int, default=0, help="which tree of the file (default 0; "
                   "negative counts from the end)")
    w.add_argument("--max-mask", type=_int_at_least(1), default=512,
                   help="largest mask picture side in pixels; bigger masks are OR-pooled over "
                        "blocks (default %(default)s)")
    w.add_argument("--max-leaves", type=_int_at_least(1), default=MAX_LEAVES,
                   help="a tree more than this many leaves across (or more than "
                        f"{MAX_DEPTH} nodes deep) is drawn from its first sequences, and the "
                        "picture says so (default %(default)s)")
    w.set_defaults(fn=cmd_draw)
    for parser in (d, s, g, n, x, c, w):
        parser.set_defaults(parser=parser)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except CLIError as e:
        print(f"{args.parser.prog}: error: {e}", file=sys.stderr)
        raise
    except OSError as e:  # a file that cannot be read or written
        what = f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)
        print(f"{args.parser.prog}: error: {what}", file=sys.stderr)
        raise CLIError(what) from None
    except InternalError as e:
        print(f"{args.parser.prog}: internal error: {e}", file=sys.stderr)
        raise
    except Exception as e:  # noqa: BLE001 - treefx's own failure: not a bad argument
        traceback.print_exc()
        error = InternalError(f"{_first_line(e)} (the traceback above; please report it)")
        print(f"{args.parser.prog}: internal error: {error}", file=sys.stderr)
        raise error from None


if __name__ == "__main__":
    sys.exit(main())
