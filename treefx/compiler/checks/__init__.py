"""What runs after the lowerings: dead code out (:mod:`.dce`), then the checks that nothing
left in the graph mixes the tokens of different sequences (:mod:`.tokens`, :mod:`.leftovers`,
:mod:`.subgraphs`, which also finds the higher-order-op bodies the passes go into)."""
