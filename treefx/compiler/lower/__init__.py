"""The lowerings: sites (:mod:`treefx.compiler.sites`) into tree ops, for the whole tree
(:mod:`.whole`) or a part of one (:mod:`.parts`); and the positions rewrite, which needs
neither mode nor backend and runs before the recognisers that read its result
(:mod:`.positions`)."""
