"""The package version, in a module of its own so that any module can read it."""

__version__ = "0.1.0"

# The transformers releases treefx was run against: pyproject.toml's range (a test holds the two
# equal). A release outside it is warned about once, when treefx first reads Hugging Face's
# kernels (:func:`treefx.families.hf_kernels.check_release`).
TESTED_TRANSFORMERS = ("5.5.3", "5.25.0")
