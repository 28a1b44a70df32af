"""Tree cumulative sum (``cumsum`` along each token's path): the custom op with pointer
jumping (:mod:`.fast`) and the plain loop (:mod:`.reference`)."""

from .fast import tree_cumsum
from .reference import tree_cumsum_reference

__all__ = ["tree_cumsum", "tree_cumsum_reference"]
