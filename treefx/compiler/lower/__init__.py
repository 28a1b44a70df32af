"""The lowerings: sites (:mod:`treefx.compiler.sites`) into tree ops, for the whole tree
(:mod:`.whole`) or a part of one (:mod:`.parts`); and the rewrites that need neither mode nor
backend and run before the recognisers that read their result (:mod:`.positions`,
:mod:`.heads`)."""
