"""treefx's benchmark suite, each part a module run from the repository root
(``python -m benchmarks.e2e``, ...; ``--dry-run`` on the CPU): see ``benchmarks/README.md``.
"""
