"""Test-wide settings.

Compiled models verify themselves against the oracle on their first call by default; the
tests compare against the oracle themselves, so they switch that off here, and the tests of
verification (tests/test_verification.py) turn it on explicitly.
"""

import os

os.environ.setdefault("TREEFX_VERIFY", "0")
