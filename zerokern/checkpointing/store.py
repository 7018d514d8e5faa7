"""Where a checkpointed input is kept between the forward and the recompute: the saved-tensor
hooks around torch's non-reentrant checkpoint.

[Note: hooks around torch's checkpoint]
`torch.utils.checkpoint(use_reentrant=False)` keeps a checkpointed call's tensor inputs as
saved tensors, made while the caller's saved-tensor hooks are active (the call's own ops save
through torch's inner hooks, which hold nothing), and its recompute reads them back through
those hooks. `checkpoint` wraps torch's call in this store's `saved_tensors_hooks`, so the pack
hook sees exactly the checkpointed inputs and the unpack hook runs right before the recompute;
autograd, the recompute and its RNG replay stay torch's. Pack keeps each input one of four ways:
- as it is (no option applies): the reference torch would keep;
- its 1/tp piece (partition_activations: partition.py [Note: partitioned checkpoints]);
- in a row of a contiguous buffer (contiguous.py [Note: contiguous checkpoint buffers]);
- in a host buffer from the pool (cpu_checkpointing: host_pool.py [Note: the host pool]);
(the last three combine: the piece goes into the row or the host buffer). Unpack brings it back
to its device and all-gathers the pieces. A kept input is freed, and its host buffer returned
to the pool, when autograd frees the saved tensor (after the backward, or when the graph is
dropped). As DeepSpeed, only floating tensors are split, offloaded or made contiguous; other
inputs (masks, indices) are kept as they are.

[Note: what stats() counts]
checkpoints (inputs kept now), device_bytes / host_bytes (the bytes they hold where they are
kept: on their device, or in host memory), peak_bytes (the largest device_bytes + host_bytes
since the last reset), pool_allocations / pool_bytes (host buffers ever allocated / owned by
the pool), copies_to_host / copies_from_host (checkpoints copied into the pool / restored from
it), gathers (all-gathers of pieces), contiguous_bytes (bytes of the contiguous buffers),
forward_s / recompute_s (with profile=True: the time in checkpointed forwards / recomputes).
An input kept as it is counts its own bytes, though its storage may be shared with a tensor the
model holds anyway.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional

import torch

from . import partition
from .contiguous import ContiguousBuffers
from .groups import TPGroup
from .host_pool import HostPool
from zerokern.platform.device import handle


class _Kept:
    """One checkpointed input, as kept ([Note: hooks around torch's checkpoint]); returns its
    bytes (and its host buffer) when autograd frees it."""

    __slots__ = ("store", "data", "shape", "numel", "device", "split", "where", "nbytes",
                 "pooled", "event", "done", "__weakref__")

    def __del__(self) -> None:
        store = self.store
        if store is not None:
            store._forget(self)


class Store:
    """The pack/unpack hooks of one configuration, and its counters ([Note: what stats()
    counts])."""

    def __init__(self, tp: TPGroup, partition_activations: bool, checkpoint_in_cpu: bool,
                 contiguous: bool, num_checkpoints: Optional[int]) -> None:
        self.tp = tp
        self.split = partition_activations and tp.size > 1
        self.cpu = checkpoint_in_cpu
        self.pool = HostPool()
        self.contiguous = ContiguousBuffers(num_checkpoints, host=checkpoint_in_cpu,
                                            pin=self.pool.pin) if contiguous else None
        self._lock = threading.Lock()
        self.live = 0
        self.device_bytes = 0
        self.host_bytes = 0
        self.peak_bytes = 0
        self.gathers = 0
        self.forward_s = 0.0
        self.recompute_s = 0.0
        self._row: Optional[int] = None
        self._index = 0

    # ---- one checkpointed call ----------------------------------------------------------
    def check_room(self) -> None:
        """Raise before a call that would pass num_checkpoints (nothing changes)."""
        if self.contiguous is not None:
            self.contiguous.check_room(self.live == 0)

    def begin_call(self) -> None:
        self._row = None if self.contiguous is None else \
            self.contiguous.begin_call(self.live == 0)
        self._index = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    # ---- the hooks ----------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> _Kept:
        x = t.detach()
        k = _Kept()
        k.store, k.shape, k.numel, k.device = None, x.shape, x.numel(), x.device
        k.split, k.pooled, k.event, k.done = False, False, None, None
        index = self._index
        self._index += 1
        handle = x.is_floating_point() and (self.split or self.cpu or self.contiguous)
        if not handle:
            k.data, k.where = x, "device"
        else:
            k.split = self.split and partition.splittable(x, self.tp)
            src = partition.my_piece(x, self.tp) if k.split else x.reshape(-1)
            row = None
            if self.contiguous is not None and self._row is not None:
                row = self.contiguous.row(self._row, index, src)
            if row is not None:
                if row.device.type == "cpu" and src.is_cuda:
                    k.data, k.event = self._copy_into_host(src, row)
                else:
                    row.copy_(src)
                    k.data = row
                    if self.cpu:
                        self.pool.copies_out += 1
                k.where = "host" if self.cpu else "device"
            elif self.cpu:
                k.data, k.event = self.pool.to_host(src)
                k.where, k.pooled = "host", True
            else:  # split only: a copy of the piece, so that the whole input can be freed
                k.data = src.clone() if src._base is not None or src is x else src
                k.where = "device"
        k.nbytes = k.data.numel() * k.data.element_size()
        with self._lock:
            self.live += 1
            if k.where == "host":
                self.host_bytes += k.nbytes
            else:
                self.device_bytes += k.nbytes
            self.peak_bytes = max(self.peak_bytes, self.device_bytes + self.host_bytes)
        k.store = self
        return k

    def _copy_into_host(self, src: torch.Tensor, row: torch.Tensor):
        """A device piece into a host row of a contiguous buffer, on the side stream."""
        dev = handle(src)
        stream = self.pool.side_stream()
        stream.wait_stream(dev.current_stream(src.device))
        with dev.use_stream(stream):
            row.copy_(src, non_blocking=True)
            event = dev.recorded_event(stream)
        src.record_stream(stream)
        self.pool.copies_out += 1
        return row, event

    def unpack(self, k: _Kept) -> torch.Tensor:
        data = k.data
        if k.where == "host":
            data, k.done = self.pool.from_host(data, k.event, k.device)
        if k.split:
            with self._lock:
                self.gathers += 1
            return partition.gather(data, k.numel, k.shape, self.tp)
        return data.view(k.shape)

    def _forget(self, k: _Kept) -> None:
        with self._lock:
            self.live -= 1
            if k.where == "host":
                self.host_bytes -= k.nbytes
            else:
                self.device_bytes -= k.nbytes
        if k.pooled:
            self.pool.release(k.data, k.done)
        k.store = None

    # ---- bookkeeping --------------------------------------------------------------------
    def reset(self) -> None:
        if self.contiguous is not None:
            self.contiguous.reset()
        self.pool.reset()
        self.peak_bytes = self.device_bytes + self.host_bytes

    def stats(self) -> Dict[str, Any]:
        return {"checkpoints": self.live, "device_bytes": self.device_bytes,
                "host_bytes": self.host_bytes, "peak_bytes": self.peak_bytes,
                "pool_allocations": self.pool.allocations, "pool_bytes": self.pool.pool_bytes,
                "copies_to_host": self.pool.copies_out,
                "copies_from_host": self.pool.copies_in, "gathers": self.gathers,
                "contiguous_bytes": 0 if self.contiguous is None else
                self.contiguous.allocated_bytes,
                "forward_s": self.forward_s, "recompute_s": self.recompute_s}
