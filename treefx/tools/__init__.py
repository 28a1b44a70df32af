"""The tools beside the core: the command line, the zoo, explain, pictures, demo and synth.

The core (every treefx module outside ``treefx.tools`` and ``treefx.models``) never imports
this package. ``import treefx`` reaches :mod:`treefx.tools.debug` (``treefx.debug``,
``treefx.explain``) and :mod:`treefx.tools.synth` (``treefx.synth``) lazily, on first use.
"""
