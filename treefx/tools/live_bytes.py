"""The bytes of tensors a piece of code allocates and holds, at their peak: measured on any
device, the CPU included, by watching every op's outputs (a ``TorchDispatchMode``).

    with LiveBytes() as live:
        treefx.backward(tm, trees, max_tokens=4096)
    live.peak            # bytes: the most held at once by tensors made inside the block
    live.at_peak         # {what made them: bytes} at that moment, largest first

What counts: every storage an op hands out inside the block (activations, what autograd
saves, gradients, buffers), from its creation until it is freed (its storage's Python object
is finalized, which PyTorch delays until no tensor, view or saved variable holds it). What
does not: tensors made before the block (weights, existing gradients), an op's scratch memory
that never leaves it, and the allocator's caching and fragmentation, which a GPU's
``torch.cuda.max_memory_allocated()`` includes in part. On a GPU, prefer the allocator's own
figures; on the CPU, where PyTorch keeps no such count, this is the measurement.
"""

from __future__ import annotations

import collections
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages ops make inside the ``with`` block while they live;
    ``peak`` the most at once, ``at_peak`` what held them then (by op), ``live`` now."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self._held: dict[int, tuple[int, str]] = {}  # id of a storage object -> (bytes, op)
        self._by_op: collections.Counter = collections.Counter()  # live bytes by op

    @classmethod
    def is_infra_mode(cls) -> bool:
        # torch.compile refuses to run its compiled frames under a user's dispatch mode (it
        # would fall back to the model's own code); counting changes no op, so it runs them
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        grew = False
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            try:
                storage = t.untyped_storage()
            except (NotImplementedError, RuntimeError):  # a tensor without storage
                continue
            key = id(storage)
            if key in self._held or storage.nbytes() == 0:
                continue
            op = str(func.overloadpacket.__name__)
            self._held[key] = (storage.nbytes(), op)
            self._by_op[op] += storage.nbytes()
            self.live += storage.nbytes()
            weakref.finalize(storage, self._free, key)
            grew = True
        if grew and self.live > self.peak:
            self.peak = self.live
            self.at_peak = {op: n for op, n in self._by_op.most_common() if n}
        return out

    def _free(self, key: int) -> None:
        n, op = self._held.pop(key, (0, ""))
        self._by_op[op] -= n
        self.live -= n
