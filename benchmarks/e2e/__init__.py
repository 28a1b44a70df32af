"""End-to-end training-step benchmark: treefx against sequence packing on synthetic agent trees
(BENCHMARKS.md, "Training step against sequence packing"; benchmarks/README.md for options).

    python -m benchmarks.e2e                 # GPU, ~6-8 min on an H200
    python -m benchmarks.e2e --quick         # hidden 1024 only, fewer reps
    python -m benchmarks.e2e --dry-run       # CPU: tiny, float32, checks

One step = layout + mask + forward + loss + backward, CUDA events, median of --reps after
--warmup; each method in its own module of :mod:`benchmarks.e2e.methods`; with ``--profile``
GPU time by kernel kind (:mod:`.profile`).
``--dry-run``: the CPU, eager backends, SDPA with a dense mask for packing, every method's loss
and gradients against the per-sequence oracle (:mod:`.dry_checks`). What was retired:
benchmarks/README.md.
"""
