"""End-to-end training-step benchmark: treefx against sequence packing on synthetic agent trees
(BENCHMARKS.md, "Training step against sequence packing"; benchmarks/README.md for options).

    python -m benchmarks.e2e                 # GPU, ~6-8 min on an H200
    python -m benchmarks.e2e --quick         # hidden 1024 only, fewer reps
    python -m benchmarks.e2e --dry-run       # CPU: tiny, float32, checks

One step = layout + mask + forward + loss + backward, CUDA events, median of --reps after
--warmup; the dry run checks every method against the per-sequence oracle (:mod:`.dry_checks`).
"""
