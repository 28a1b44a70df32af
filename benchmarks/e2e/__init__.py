"""End-to-end training-step benchmark: treefx against sequence packing on synthetic agent trees
(BENCHMARKS.md, "Training step against sequence packing"; benchmarks/README.md for options)."""
