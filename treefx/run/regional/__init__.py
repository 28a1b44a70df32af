"""Regional execution: the rewritten tree graph cut at the model's blocks (its decoder layers),
each block's piece compiled once per distinct layer and run through the block module's own
call.

Why. A sharded model (FSDP2's ``fully_shard`` per decoder layer) gathers a layer's parameters
in a forward pre-hook of that layer and frees them in its post-hook; DDP reduces gradients from
hooks its wrapper installs. Those hooks are eager Python around each module call (collectives,
storage resizing, streams); Dynamo cannot trace them into the one graph the passes need, and
the passes need the whole forward at once (the tree mask is built once and read by every
layer; positions are evaluated before the first layer). So treefx keeps the capture whole and
cuts *after* the passes:

1. **Capture** (:func:`capture_state`) on the model as it computes: every FSDP unit gathered
   (``unshard``), FSDP's own hooks hidden from Dynamo (replaced by the one thing they do to the
   values, the mixed-precision input and output casts), DDP's wrapper skipped. The passes then
   run on the whole graph exactly as without regions.
2. **Split** (:func:`build`): each node belongs to the outermost block module in its
   ``nn_module_stack`` (the FSDP units below the root; otherwise the layers Hugging Face names
   in ``_no_split_modules``; otherwise the children of a ``ModuleList``), treefx's own nodes
   between two nodes of one block to that block, everything else to the glue before, between
   and after the blocks. Each piece becomes a graph of its own: parameters and buffers are its
   first inputs, read from the module *when it runs*; the values other pieces made are the
   rest.
3. **Compile**: pieces are compiled one by one with the treefx backend (Inductor or eager),
   on fake inputs, as Dynamo's own DDP optimizer does. Pieces with the same code on inputs of
   the same kinds (the decoder layers of one type) share one compiled function: compile time
   is one layer per layer type, plus the glue, whatever the depth.
4. **Run** (:class:`RegionalGraph`): the glue and blocks run in program order; a block runs
   inside ``nn.Module.__call__`` of its module with the module's ``forward`` pointed at the
   compiled piece, so FSDP gathers, frees, casts and reduce-scatters around it exactly as in
   eager training, and the root's call (FSDP's root hooks, or the DDP wrapper's) wraps the
   whole. Activation checkpointing captured in a block stays inside its piece.

What keeps it exact: the pieces are the rewritten graph's own nodes, run in the graph's order;
every parameter a piece reads is checked when it runs (a plain tensor of the captured shape and
dtype, so a shard or a parameter of another FSDP unit is an error, not a silent misread); the
inputs' dtypes after the hooks are checked against the capture; Dynamo's shape guards on the
token count (and a part's other sizes) are re-evaluated on every call, and the call's other
arguments compared with the capture's (numbers are constants of the graph, other sizes
static): a call that differs is captured anew; a model
whose blocks or root carry forward hooks besides FSDP's is refused (they were traced into the
graph and would run twice).

The package, one concept a module: :mod:`.blocks` (the blocks, the capture's state, a block's
call), :mod:`.split` (:func:`build`: the cut and the compile), :mod:`.keys` (the structure keys
compiled pieces are shared by), :mod:`.guards` (the shape guards), :mod:`.graph`
(:class:`RegionalGraph`, the run).
"""

from __future__ import annotations

# what the model is wrapped in (read here too by the model's and the engine's callers)
from ..wrapping import distributed_kind, is_fsdp_unit, unwrap_ddp
from .blocks import call_with_forward, capture_state, check_hooks, find_blocks, \
    forward_replaced
from .graph import Piece, RegionalGraph
from .keys import getattr_path
from .split import build

__all__ = ["Piece", "RegionalGraph", "build", "call_with_forward", "capture_state",
           "check_hooks", "distributed_kind", "find_blocks", "forward_replaced", "getattr_path",
           "is_fsdp_unit", "unwrap_ddp"]
