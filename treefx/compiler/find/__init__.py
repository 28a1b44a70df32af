"""The recognisers: each turns the nodes of a graph into typed sites
(:mod:`treefx.compiler.sites`), knowing no backend and no mode (whole tree or part)."""
