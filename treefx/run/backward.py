"""The former home of ``treefx.backward``, now the package :mod:`treefx.run.parts` (one job
a module): its public names, for code that imports them from here."""

from .parts import PartRunner, backward, part_forward, part_step_function, runners

__all__ = ["PartRunner", "backward", "part_forward", "part_step_function", "runners"]
