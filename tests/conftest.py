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
    _threads = max(1, (os.cpu_count() or 1) // _workers)
    torch.set_num_threads(_threads)
    # The processes a test starts (examples/fsdp.py, the benchmarks' dry runs, the floor
    # run, ...) take the same share: torch sizes its thread pool from OMP_NUM_THREADS. With
    # torch's default (every core) beside the other workers, a run of examples/fsdp.py took
    # 48 s of CPU instead of 21 s on 2 cores, the same losses: the threads wait on each other.
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))

# Tests that run for minutes in processes of their own, started first so that no worker is
# left running one of them alone at the end (pytest-xdist hands out the tests in the order
# collected, alphabetically by file). Each group stays together: a module-scoped fixture that
# starts processes (tests/test_distributed.py's spawn of every case, the one-process run of
# examples/fsdp.py) runs once per worker that gets one of its tests.
LONG_FIRST = (
    "tests/test_transformers_releases.py",  # the sample with the oldest and newest transformers
    "tests/test_distributed_parts.py",  # two processes, every case
    "tests/test_distributed.py",
    "tests/test_examples.py::test_fsdp_example",  # examples/fsdp.py, one process and two
    "tests/test_distributed_data.py::test_pack_over_two_gloo_ranks",
)


def _long_rank(item) -> int:
    for i, prefix in enumerate(LONG_FIRST):
        if item.nodeid.startswith(prefix):
            return i
    return len(LONG_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_long_rank)  # stable: each group and the rest keep their order
