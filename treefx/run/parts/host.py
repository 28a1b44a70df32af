"""Host parts' saved tensors held in host memory (:class:`HostStore`): what a host part's
forward saves for its backward (activations, the context's keys and values its attention
read) is copied out to the host as the forward saves it and copied back when the backward
unpacks it, so that the part's forward runs once however little of the device the budget
leaves (:mod:`treefx.parts`: ``beyond="host"``), instead of running again at its backward
(a recompute part).

On a GPU the copies go to pinned host buffers on a stream of their own, so they overlap the
compute that follows (the copy stream waits for the tensor to be made; the tensor's memory is
kept for the copy with ``record_stream``; the backward's stream waits for the copy back). On
the CPU the device *is* the host: nothing is copied (``copy=True`` copies all the same, which
the tests use to check the path). Parameters, and tensors sharing a parameter's or a kept
gradient's memory, are never copied: they stay where they are."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["HostStore"]


class HostStore:
    """Saved tensors of the host parts, held in host memory between their forward and their
    backward. ``device``: the model's. ``keep``: tensors whose memory is never copied
    (the parameters, the gradients the graphs add into). ``copy``: copy even where the
    device is the host (the CPU; for tests)."""

    def __init__(self, device: torch.device, keep=(), *, copy: bool | None = None):
        self.device = torch.device(device)
        self.copy = self.device.type != "cpu" if copy is None else copy
        self.keep = set()
        for t in keep:
            try:
                self.keep.add(t.untyped_storage().data_ptr())
            except (RuntimeError, AttributeError):
                pass  # a storage freed for now (an FSDP2-sharded parameter's unsharded one)
        self.pinned = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.pinned else None
        self.bytes = 0  # held on the host now
        self.peak_bytes = 0
        self.copied = 0  # tensors copied out

    def _skip(self, t: torch.Tensor) -> bool:
        return (not self.copy or t.device.type != self.device.type or t.numel() == 0
                or t.layout != torch.strided or isinstance(t, torch.nn.Parameter)
                or isinstance(t._base, torch.nn.Parameter)
                or t.untyped_storage().data_ptr() in self.keep
                or t.storage_offset() != 0
                or t.untyped_storage().nbytes() != t.numel() * t.element_size())

    def pack(self, t: torch.Tensor):
        if self._skip(t):
            return t
        # the tensor covers its storage exactly: its strides kept (a transposed weight's
        # gradient input, a permuted head layout)
        host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=self.pinned)
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        else:
            host.copy_(t)
            done = None
        n = t.numel() * t.element_size()
        self.bytes += n
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.copied += 1
        return _Packed(t.device, host, done, n)

    def unpack(self, packed):
        if not isinstance(packed, _Packed):
            return packed
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(packed.done)
                out = packed.host.to(packed.device, non_blocking=True)
            current = torch.cuda.current_stream(packed.device)
            current.wait_stream(self.stream)
            out.record_stream(current)
        else:
            out = packed.host.clone() if packed.device.type == "cpu" else \
                packed.host.to(packed.device)  # (a device without streams)
        return out

    def release(self, packed_list) -> None:
        """Count what a host part's backward freed (its saved tensors' host copies)."""
        self.bytes -= sum(p.nbytes for p in packed_list)

    @contextlib.contextmanager
    def saving(self):
        """Tensors saved for backward in this block are held in host memory."""
        packed: list = []

        def pack(t):
            p = self.pack(t)
            if isinstance(p, _Packed):
                packed.append(p)
            return p

        with torch.autograd.graph.saved_tensors_hooks(pack, self.unpack):
            yield packed


class _Packed:
    __slots__ = ("device", "host", "done", "nbytes")

    def __init__(self, device, host, done, nbytes):
        self.device, self.host, self.done, self.nbytes = device, host, done, nbytes
