"""Optional integrations of treefx with training libraries.

Each submodule needs its library (an extra of the package: ``pip install "treefx[trl]"``) and is
imported by name, never by ``import treefx``: the core knows nothing of them.

- :mod:`treefx.integrations.trl`: TRL's ``GRPOTrainer`` with every model call on prefix trees
  (``TreeGRPOTrainer``).
"""
