"""treefx's benchmark suite. Run each part from the repository root as a module:

    python -m benchmarks.e2e            # one training step: treefx vs packing
    python -m benchmarks.gpu_check      # GPU exactness against the per-sequence oracle
    python -m benchmarks.real_trees     # real agent trees: treefx.backward vs per-call packing

Every part takes ``--dry-run`` (CPU, tiny float32 model, eager backends) and ``--out``. Shared
setup lives in :mod:`benchmarks.common`, the timer in :mod:`benchmarks.timing`, treefx's
internals in :mod:`benchmarks.internals`. See ``benchmarks/README.md``.
"""
