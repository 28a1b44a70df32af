"""The one-pass Gated DeltaNet tree path (treefx.families.fla_tree) on the CPU, through fla's
own Triton kernels run by Triton's interpreter (``TRITON_INTERPRET=1``), against fla depth by
depth and a float64 walk along the tree (:func:`benchmarks.fla_tree_check.exact_case`), float32:

    python -m benchmarks.fla_tree_interpret [short long-nodes forest three-sequences]
    python -m benchmarks.fla_tree_interpret state-pass    # no fla needed

``state-pass``: treefx's own one-launch state pass (:mod:`treefx.families.fla_tree_state`),
forward and backward, against its float64 reference on random forests (nodes of one token and
across chunks, roots from given states, final states handed out), float32, key heads of 64 and
128; within 1e-5 relative.

Needs fla 0.4.2, Triton and NumPy < 2.3 (the interpreter turns one-element arrays into Python
numbers, which newer NumPy refuses) importable; no GPU. Slow (the interpreter runs every
program of every kernel in Python): about 10 s for the short tree, minutes for the forest.
The kernels run as written, with three adjustments for the interpreter, none to their
arithmetic: autotuning takes the first configuration (it cannot time kernels), fla's
per-device context is skipped (no CUDA device), and in two state kernels the loop counter,
a Python int under the interpreter, is used as is where the compiled kernel casts it to int64
(``i_t.to(tl.int64)``). Exit status 1 if any case fails.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import ast  # noqa: E402
import contextlib  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import linecache  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402


def _interpreter_adjustments() -> None:
    import triton.runtime.autotuner as autotuner

    autotuner.Autotuner.do_bench = property(
        lambda self: (lambda fn, quantiles=None: [1.0, 1.0, 1.0]))
    import fla.utils

    fla.utils.custom_device_ctx = lambda index: contextlib.nullcontext()
    from fla.ops.common import chunk_delta_h

    for name in ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
                 "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64"):
        f = getattr(chunk_delta_h, name)
        while not hasattr(f, "arg_names") or hasattr(f.fn, "fn"):
            f = f.fn  # autotuner / heuristics -> the interpreted function
        tree = ast.parse(textwrap.dedent(inspect.getsource(f.fn)))
        tree.body[0].decorator_list = []
        src = ast.unparse(tree).replace("i_t.to(tl.int64)", "i_t")
        scope = dict(f.fn.__globals__)
        filename = f"<{name}, adjusted for the interpreter>"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        exec(compile(src, filename, "exec"), scope)
        f.fn = f.rewriter.fn = scope[name]


def state_pass_case() -> bool:
    """The one-launch state pass's kernels (interpreted) against their float64 reference."""
    from benchmarks.fla_tree_check import state_pass_exact

    ok = True
    for seed, shape in enumerate([(2, 128, 32), (3, 64, 64), (1, 128, 48)]):
        res = state_pass_exact("cpu", seed, *shape)
        print(json.dumps({"case": "state-pass", **res}), flush=True)
        ok = ok and res["passed"]
    return ok


def main(argv=None) -> int:
    import numpy as np

    if tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 3):
        raise SystemExit(f"NumPy {np.__version__}: Triton's interpreter needs NumPy < 2.3")
    names = list(argv if argv is not None else sys.argv[1:])
    failed = []
    if "state-pass" in names:
        names.remove("state-pass")
        if not state_pass_case():
            failed.append("state-pass")
        if not names:
            return 1 if failed else 0
    _interpreter_adjustments()
    import torch

    import treefx
    from benchmarks.fla_check import odd_trees
    from benchmarks.fla_tree_check import exact_case
    from treefx.families import fla_tree

    if fla_tree.kernels() is None:
        raise SystemExit("fla's internals are not those of fla 0.4.2 (or fla is missing)")
    trees = odd_trees(1024)
    rng = np.random.default_rng(0)
    trees["separate-sequences"] = [treefx.Tree.from_sequences(
        [[int(t) for t in rng.integers(3, 1000, n)] for n in (40, 90, 200)])]
    names = [n for n in names if n != "l2norm-long"] or ["short", "separate-sequences"]
    for case, backend in (("model", "eager"), ("model-traced", "aot-eager")):
        # HF Qwen3-Next whole and in parts (treefx.backward) on fla's path; model-traced:
        # through AOTAutograd (the recurrence as the traced graph's op, its kept graph)
        if case not in names:
            continue
        names = [n for n in names if n != case]
        from benchmarks.fla_check import model_case
        from treefx.compiler.recurrences import recurrence

        rec = recurrence("qwen3_next_gated_delta_rule")
        rec.varlen_devices, rec.varlen_check = ("cpu",), None
        res = model_case("cpu", "qwen3_next", trees["forest"], 96, backend, bf16=False)
        print(json.dumps({"case": f"{case}-qwen3_next", **{k: res.get(k) for k in (
            "fp32", "oracle_floor", "fp32_tolerance", "passed_fp32")}}, default=str),
            flush=True)
        if not res.get("passed_fp32"):
            failed.append(case)
    for name in names:
        res = exact_case("cpu", torch.float32, trees[name])
        worst = {k: max(v for kk, v in res[k].items() if kk != "paths")
                 for k in ("depth_by_depth", "one_pass")}
        print(json.dumps({"case": name, "tokens": res["tokens"], "nodes": res["nodes"],
                          "depths": res["depths"], "worst": worst,
                          "paths": res["one_pass"]["paths"], "passed": res["passed"]}),
              flush=True)
        if not res["passed"]:
            failed.append(name)
    # fla's L2-norm kernels ran with their row-length key fixed: one tuning per width, dtype
    from fla.modules import l2norm as fla_l2norm_kernels

    from treefx.families import fla_l2norm

    keys = {k[:2] for kern in (fla_l2norm_kernels.l2norm_fwd_kernel,
                               fla_l2norm_kernels.l2norm_bwd_kernel) for k in kern.cache}
    print(json.dumps({"case": "l2norm-keys", "fixed_key": fla_l2norm.available(),
                      "keys (width, row-length key)": sorted(keys)}), flush=True)
    turned_off = os.environ.get(fla_l2norm.ENV, "").strip().lower() in ("0", "off", "false", "no")
    if not turned_off and (not fla_l2norm.available() or keys - {(128, fla_l2norm.FIXED_NB)}):
        failed.append("l2norm-keys")
    if "l2norm-long" in (argv if argv is not None else sys.argv[1:]):
        # 80,000 rows, where fla's wrapper hands its kernels another key (NB = 2): the fixed
        # key's output, 1/norm and gradient equal fla's own, bit for bit
        g = torch.Generator().manual_seed(0)
        x, dy = (torch.randn(20_000, 4, 128, generator=g) for _ in range(2))
        y, r = fla_l2norm.l2norm_fwd(x)
        y0, r0 = fla_l2norm_kernels.l2norm_fwd(x)
        dx, dx0 = fla_l2norm.l2norm_bwd(y, r, dy), fla_l2norm_kernels.l2norm_bwd(y0, r0, dy)
        same = all(torch.equal(a, b) for a, b in ((y, y0), (r, r0), (dx, dx0)))
        print(json.dumps({"case": "l2norm-long", "rows": 80_000, "equal to fla's": same}),
              flush=True)
        if not same:
            failed.append("l2norm-long")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
