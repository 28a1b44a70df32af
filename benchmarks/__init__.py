"""treefx's benchmark suite. Run each part from the repository root as a module:

    python -m benchmarks.e2e            # one training step: treefx vs packing, one by one, ...
    python -m benchmarks.attention      # tree attention alone vs SDPA / FlexAttention causal
    python -m benchmarks.gpu_check      # GPU exactness against the per-sequence oracle
    python -m benchmarks.checkpointing  # activation checkpointing: exactness, memory, verify

Every part takes ``--dry-run`` (CPU, tiny float32 model, eager backends: checks the harness
without a GPU) and ``--out`` (default ``benchmarks/results/<name>_<date>_<device>.json``).
Shared setup lives in :mod:`benchmarks.common`, the one timer in :mod:`benchmarks.timing`,
and every import of treefx internals in :mod:`benchmarks.internals`. See
``benchmarks/README.md``.
"""
