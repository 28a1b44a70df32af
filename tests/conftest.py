"""Test-wide settings.

Compiled models verify themselves against the oracle on their first call by default; the
tests compare against the oracle themselves, so they switch that off here, and the tests of
verification (tests/test_verification.py) turn it on explicitly.
"""

import os

os.environ.setdefault("TREEFX_VERIFY", "0")

# Under pytest-xdist (``-n N``) the workers share the cores: each takes its share of torch's
# intra-op threads, so N workers do not oversubscribe a small machine. Most of a test's time
# is Dynamo tracing and compiling in Python, one core a worker.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))
