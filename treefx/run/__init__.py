"""The run layer: what a capture runs under (:mod:`.capture`), the engine that captures and
rewrites (:mod:`.engine`, :mod:`.regional`, :mod:`.backends`), and the three front ends that
build its :class:`~treefx.plan.Plan`: a compiled model (:mod:`.model`), a ``@treefx.step``
(:mod:`.step`) and a tree in parts (:mod:`.backward`)."""
